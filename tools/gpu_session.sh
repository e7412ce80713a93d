#!/usr/bin/env bash
# One GPU-host session of the pipeline's GPU gates: unpack the carried Python bundle, check
# that the carried kernel library loads (else build it there), then run the steps named, in
# order. Evidence goes to /tmp/ev, bench reports to /tmp/bench, the integrate gate's worker
# logs to /tmp/integrate-logs; all three come back as $OUT/results.tgz, packed again after
# every step (the device tool returns only a few files from $OUT, so one archive, not many).
#   carry: .site build/lib (the smoke step: .live build/lib)
#   usage: bash tools/gpu_session.sh <commit> step...
# <commit>: the full sha of this checkout's HEAD, written out on the CPU machine. Never
# $(git rev-parse HEAD) in the device command: the device copy's .git is not this
# checkout's and can name another commit, which would mislabel every evidence record.
# steps: oracle oracle-quick integrate graph defrag bench-micro bench-long bench-frag bench-graph gpu-tests smoke
# env:   ORACLE_GROUPS, ORACLE_TARGETS (oracle: the case groups and targets to run; default all),
#        STEP_TIMEOUT (seconds for each oracle step, default 1200), BENCH_BUDGET (bench-micro,
#        bench-long, bench-frag: the suite's time budget in seconds, default 300),
#        SMOKE_ARGS (smoke: more flags, e.g. "--launches off-eager,on-eager --budget-s 500"),
#        LIVE_SITE (smoke: the live bundle, default .live/live.tar.xz; on a warm machine the folder
#        /tmp/smoke/site a first call unpacked serves a second call that carries no bundle)
# smoke over two calls: after the first, put its smoke/launch-*.json in .live/resume and carry
# .live again; the second goes on from them on any machine (a launch counts as done only on
# the same code, the same bundle bytes and the same GPU model)
# Bring the evidence back and record it on the CPU machine: invoke record --evidence <dir>/ev.
set -uo pipefail
commit=$1; shift
# a warm device keeps /tmp between calls: start this invocation's evidence and reports empty,
# so that results.tgz holds only what these steps wrote. Two invocations in one device
# command: copy the first one's files to $OUT before the second.
rm -rf /tmp/ev /tmp/bench /tmp/integrate-logs
mkdir -p /tmp/site /tmp/ev /tmp/bench
# the gates' bundle (SGLang 0.5.23 for the peers and the integrate gate, FlashMLA); the smoke
# step's server takes its own (.live), so a call that runs only the smoke carries no .site
[ -f .site/site.tar.xz ] && tar -xJf .site/site.tar.xz -C /tmp/site
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 KDTREE_GIT_COMMIT=$commit KDTREE_EVIDENCE_DIR=/tmp/ev
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
python3 -c "from kdtree_engine.kernel import library; l = library.load(); print('library', l.path, l.archs, l.kernel_name(0))" || {
  echo "carried library does not load; building here"; python3 -m kdtree_pipeline build --force; }
# whether this tree's csrc/ built it: a GPU gate's record names its library, and `invoke
# record` refuses one that ran another tree's library (kdtree_pipeline.run.check_library)
python3 -c "from kdtree_pipeline import evidence; p = evidence.provenance(); print('library provenance:', p['matches'], p['why'] or '')"
# STEP_TIMEOUT bounds the oracle steps: a kernel that hangs costs that much device time, not the call
T="timeout -k 5 ${STEP_TIMEOUT:-1200}"
ORACLE_ARGS="${ORACLE_GROUPS:+--groups $ORACLE_GROUPS} ${ORACLE_TARGETS:+--targets $ORACLE_TARGETS}"
BENCH="python3 -m kdtree_pipeline bench --out /tmp/bench --budget-s ${BENCH_BUDGET:-300} --suite"
GPU_TESTS="tests/test_kernel_op.py tests/test_kernel_op_serving.py tests/test_graph.py tests/test_defrag_gate.py
  tests/test_bench_gpu.py tests/test_sglang_integrate.py tests/test_sglang_plugin.py tests/test_sglang_fallback.py"
pack() { tar -czf "${OUT:-/tmp}/results.tgz" -C /tmp ev bench $(cd /tmp && ls -d integrate-logs 2>/dev/null) \
  $(cd /tmp && ls smoke/*.json smoke/*.log 2>/dev/null) 2>/dev/null; }
trap pack EXIT
for step in "$@"; do
  echo "=== $step $(date -u +%T)"
  case $step in
    oracle) $T python3 -m kdtree_pipeline oracle $ORACLE_ARGS ;;
    oracle-quick) $T python3 -m kdtree_pipeline oracle --groups edge,splits,masks,batch ;;
    integrate) python3 -m kdtree_pipeline integrate --out /tmp/integrate; rc=$?  # the gate's status, not the copies'
               mkdir -p /tmp/integrate-logs  # each worker's log and summary, named by its mode (plugin off / on)
               for m in off on; do for f in worker.log summary.json; do
                 cp /tmp/integrate/$m/$f /tmp/integrate-logs/$m-$f 2>/dev/null; done; done
               (exit $rc) ;;
    graph) python3 -m kdtree_pipeline graph ;;
    defrag) python3 -m kdtree_pipeline defrag ;;
    bench-micro) $BENCH micro ;;
    bench-long) $BENCH long-context ;;
    bench-frag) $BENCH fragmentation ;;
    bench-graph) python3 -m kdtree_pipeline bench --suite graph --out /tmp/bench ;;
    gpu-tests) python3 -m pytest -q -m gpu -p no:cacheprovider $GPU_TESTS ;;
    smoke) # SGLang 0.5.17 serving through the plugin; resumable: run the same step again to go on.
           # On a fresh machine, the launches an earlier call finished come from .live/resume
           # (their launch-*.json out of that call's results.tgz); a warm machine's own win (-n)
           mkdir -p /tmp/smoke && { [ -d .live/resume ] && cp -n .live/resume/launch-*.json /tmp/smoke/ 2>/dev/null; true; }
           python3 -m kdtree_pipeline smoke --out /tmp/smoke --site ${LIVE_SITE:-.live/live.tar.xz} ${SMOKE_ARGS:-} ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
  echo "=== $step rc=$?"
  pack  # after every step: a run cut off at its time limit still brings back what finished
done
