#!/usr/bin/env bash
# One GPU-host session: unpack the carried bundle, check the carried library
# loads, then run what the arguments name. Evidence and logs land in $OUT.
#   carry: .site build/lib      usage: bash tools/gpu_session.sh <commit> step...
# steps: oracle-quick oracle oracle-mma first-look first-look-mma sanitize integrate bench-micro bench-long graph defrag
set -uo pipefail
commit=$1; shift
mkdir -p /tmp/site && tar -xJf .site/site.tar.xz -C /tmp/site
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 KDTREE_GIT_COMMIT=$commit KDTREE_EVIDENCE_DIR=${OUT:-build/evidence}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
python3 -c "from kdtree_engine.kernel import library; l = library.load(); print('library', l.path, l.archs)" || {
  echo "carried library does not load; building here"; python3 -m kdtree_engine build --arch sm_90 --force; }
for step in "$@"; do
  echo "=== $step $(date -u +%T)"
  case $step in
    oracle-quick) python3 -m kdtree_engine oracle --groups edge,splits,masks,batch ;;
    oracle) python3 -m kdtree_engine oracle ;;
    first-look) python3 tools/first_look.py ;;
    first-look-mma) KDTREE_KERNEL=mma python3 tools/first_look.py ;;
    oracle-mma) KDTREE_KERNEL=mma python3 -m kdtree_engine oracle --evidence-dir /tmp/oracle-mma ;;
    sanitize) timeout 240 compute-sanitizer --tool memcheck --print-limit 20 python3 tools/sanitize_case.py;
              timeout 240 compute-sanitizer --tool racecheck --print-limit 20 python3 tools/sanitize_case.py ;;
    integrate) python3 -m kdtree_engine integrate ;;
    bench-micro) python3 -m kdtree_engine bench --suite micro ;;
    bench-long) python3 -m kdtree_engine bench --suite long-context ;;
    graph) python3 -m kdtree_engine graph ;;
    defrag) python3 -m kdtree_engine defrag ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
  echo "=== $step rc=$?"
done
