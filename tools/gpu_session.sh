#!/usr/bin/env bash
# One GPU-host session: unpack the carried bundle, check the carried library
# loads (else build it there), then run the steps named. Evidence goes to
# /tmp/ev, bench reports to /tmp/bench; everything comes back as
# $OUT/results.tgz (the device tool returns at most 8 files from $OUT, results.tgz among
# them: session O's first call put 10 there and lost results.tgz).
#   carry: .site build/lib [build/variants.tar.xz]      usage: bash tools/gpu_session.sh <commit> step...
# <commit>: the full sha of this checkout's HEAD, written out on the CPU machine. Never
# $(git rev-parse HEAD) in the device command: the device copy's .git is not this
# checkout's, and on 2026-11-29 it named an older commit (evidence mislabelled).
# steps: ncu-fm-src gather-peer ncu-gather tma-row-probe racecheck-kernel ab-bench clock-probe ncu-metrics mma-peak ab-native sm120-ab ncu-sm120 gpu-test-serving count-launches ab-micro ncu-stalls ncu-flashmla nox-oracle gpu-tests gpu-test-op gpu-test-graph ncu oracle oracle-quick oracle-mma oracle-libs
#        first-look first-look-mma sanitize racecheck integrate graph defrag bench-micro bench-long bench-frag bench-graph bench-gpu-tests
# env:   AB_SHAPES (sm120-ab, ab-native: "bs,N,H,L ..."), AB_ENV, AB_ROUNDS (ab-native), NCU_CASE (ncu-sm120: "bs N H L"), ORACLE_GROUPS, ORACLE_TARGETS, ORACLE_LIBS, STEP_TIMEOUT, BENCH_BUDGET, AB_SUITE, AB_SYSTEMS, AB_LIBS, NCU_CASES, NCU_KERNEL,
#        AB_CASES, AB_MASKS, AB_FIRST_SYSTEMS, AB_LAYOUT, AB_EXTRA (more ab_bench.py flags, e.g. --alone) (ab-bench), NCU_NOHINT (ncu-metrics), NCU_LAYOUT (ncu_case.py),
#        RACECHECK_BIN, RACECHECK_LIBS, RACECHECK_CASES (racecheck: a carried racecheck_min, libraries, sanitize_case.py cases)
#        CLOCK_CASES, CLOCK_SYSTEMS, CLOCK_SECONDS, CLOCK_ROUNDS, CLOCK_LIBS, CLOCK_LAYOUT (clock-probe)
#        GATHER_CASES, GATHER_LAYOUTS, GATHER_LIBS (gather-peer: tools/gather_peer_probe.py's --cases, --layouts; the libraries)
#        FM_SRC ("LABEL=DIR ...": FlashMLA built from source by tools/build_fm_src.py, carried in build/variants.tar.xz;
#        ab-bench and clock-probe register each as system LABEL, to be named in AB_FIRST_SYSTEMS or CLOCK_SYSTEMS;
#        ncu-fm-src profiles each)
set -uo pipefail
commit=$1; shift
# a warm device keeps /tmp between calls: start this invocation's evidence and reports empty, so that
# results.tgz holds only what these steps wrote (session T's call 9 packed call 6's A/B rows: entry T3).
# Two invocations in one device command: copy the first one's files to $OUT before the second.
rm -rf /tmp/ev /tmp/bench /tmp/integrate-logs
mkdir -p /tmp/site /tmp/ev /tmp/bench && tar -xJf .site/site.tar.xz -C /tmp/site
# variant libraries for A/B steps, carried packed (xz cuts a 3.3 MB sm_90a variant to ~0.6 MB, so
# five fit the 64 MiB carry beside .site and build/lib where two did unpacked; session AF):
#   tar -cJf build/variants.tar.xz -C <folder of variant folders> .   carry: .site build/lib build/variants.tar.xz
if [ -f build/variants.tar.xz ]; then
  tar -xJf build/variants.tar.xz -C build/lib && echo "variants unpacked into build/lib:" $(tar -tJf build/variants.tar.xz | grep '\.so$')
fi
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 KDTREE_GIT_COMMIT=$commit KDTREE_EVIDENCE_DIR=/tmp/ev
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
python3 -c "from kdtree_engine.kernel import library; l = library.load(); print('library', l.path, l.archs, l.kernel_name(0))" || {
  echo "carried library does not load; building here"; python3 -m kdtree_pipeline build --force; }
# whether this tree's csrc/ built it: a GPU gate's record names it, and `invoke record` refuses
# one that ran another tree's library (pipeline.run.check_library)
python3 -c "from kdtree_pipeline import evidence; p = evidence.provenance(); print('library provenance:', p['matches'], p['why'] or '')"
# STEP_TIMEOUT (s) bounds the oracle and A/B steps: an experimental kernel that hangs
# costs that much device time, not the whole call
T="timeout -k 5 ${STEP_TIMEOUT:-1200}"
# FlashMLA-from-source peers (tools/fm_src_peer.py) for the ab-bench and clock-probe steps
FMS=""; for fm_spec in ${FM_SRC:-}; do FMS="$FMS --fm-src $fm_spec"; done
# the oracle's case selection, shared by the oracle and oracle-libs steps
ORACLE_ARGS="${ORACLE_GROUPS:+--groups $ORACLE_GROUPS} ${ORACLE_TARGETS:+--targets $ORACLE_TARGETS}"
# racecheck with every report (the racecheck and racecheck-kernel steps)
RC="compute-sanitizer --tool racecheck --racecheck-report all --print-limit 0"
# tools/NAME.cu as a binary: the carried build/lib/NAME (built on the CPU machine), else built here
# with nvcc for sm_90a; prints its path (nvcc's own output goes to stderr)
tool_bin() {
  local b=build/lib/$1
  [ -x "$b" ] || { b=/tmp/$1; nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I csrc -o "$b" "tools/$1.cu" >&2; }
  echo "$b"
}
pack() { tar -czf "${OUT:-/tmp}/results.tgz" -C /tmp ev bench $(cd /tmp && ls -d integrate-logs 2>/dev/null) 2>/dev/null; }
trap pack EXIT
for step in "$@"; do
  echo "=== $step $(date -u +%T)"
  case $step in
    oracle-quick) $T python3 -m kdtree_pipeline oracle --groups edge,splits,masks,batch ;;
    oracle) $T python3 -m kdtree_pipeline oracle $ORACLE_ARGS ;;
    sm120-ab) # the sm_120 configuration (emulation) of each library in AB_LIBS (default build/lib) next to the
              # Hopper kernel of build/lib (tools/sm120_ab.py)
              A="python3 tools/sm120_ab.py --json /tmp/bench/sm120-ab.jsonl ${AB_SHAPES:+--shapes $AB_SHAPES}"
              $T $A --label hopper
              for d in ${AB_LIBS:-build/lib}; do
                KDTREE_LIB=$PWD/$d/libkdtree_verify.so $T $A --target sm_120 --label sm120-$(basename $d)
              done ;;
    ncu-sm120) # tensor-pipe and shared-memory utilisation of the sm_120 kernel (emulation), bs1 N16 H8 64k
         KDTREE_TARGET=sm_120 timeout 300 ncu --clock-control none --section SpeedOfLight --section ComputeWorkloadAnalysis \
           --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats \
           --metrics sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_tensor_op_hmma.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed \
           -k regex:verify_attn_kernel -c 1 -o /tmp/bench/ncu-sm120 python3 tools/ncu_case.py ${NCU_CASE:-1 16 8 65536} \
           && ncu --import /tmp/bench/ncu-sm120.ncu-rep --page details > /tmp/bench/ncu-sm120.txt
         grep -E "Duration|hmma|Tensor|Issue Slots|Shared|Warp Cycles Per Issued|Achieved Occupancy|Block Limit|Registers|Dynamic Shared|Stall|mem_shared" /tmp/bench/ncu-sm120.txt | head -40
         rm -f /tmp/bench/ncu-sm120.ncu-rep ;;
    mma-peak) # this GPU's mma.sync bf16 ceiling, operands in registers (tools/mma_peak.cu, tool_bin)
              "$(tool_bin mma_peak)" | tee /tmp/bench/mma-peak.txt ;;
    gather-peer) # FlashMLA's own gather kernel (its sm_90 sparse prefill) beside ours and its dense decode
                 # (tools/gather_peer_probe.py), once per library of GATHER_LIBS (default build/lib; each in its own
                 # process, its rows labelled with the folder's name)
              for d in ${GATHER_LIBS:-build/lib}; do
                KDTREE_LIB=$PWD/$d/libkdtree_verify.so $T python3 tools/gather_peer_probe.py ${GATHER_CASES:+--cases $GATHER_CASES} \
                  ${GATHER_LAYOUTS:+--layouts $GATHER_LAYOUTS} --label $(basename $d) --json /tmp/bench/gather-peer.jsonl
              done ;;
    ncu-gather) # per-kernel cycles of the same probe's calls (--once: each system called twice, eagerly), ncu's
                # clocks as found, caches flushed: our main kernel and combine, FlashMLA's dense kernel and combine,
                # its gather kernel; the raw csv in /tmp/bench/ncu-gather.csv
              timeout -k 5 ${STEP_TIMEOUT:-600} ncu --clock-control none --csv --metrics \
                gpu__time_duration.sum,sm__cycles_elapsed.max,launch__grid_size,dram__bytes_read.sum,lts__t_sector_hit_rate.pct \
                -k regex:"verify_attn|combine|sparse_attn_fwd|flash_fwd|mla_combine" python3 tools/gather_peer_probe.py --once \
                ${GATHER_CASES:+--cases $GATHER_CASES} ${GATHER_LAYOUTS:+--layouts $GATHER_LAYOUTS} > /tmp/bench/ncu-gather.csv 2>&1
              echo "ncu-gather rc=$?"; grep -c '^"[0-9]' /tmp/bench/ncu-gather.csv; grep -E '^==|calls|Error|error' /tmp/bench/ncu-gather.csv | head -20 ;;
    tma-row-probe) # can 1-row TMA boxes gather key rows into the 128B-swizzled buffers, and how fast against cp.async
                   # (tools/tma_row_probe.cu, tool_bin)
              timeout 120 "$(tool_bin tma_row_probe)" | tee /tmp/bench/tma-row-probe.txt ;;
    oracle-mma) KDTREE_KERNEL=mma KDTREE_EVIDENCE_DIR=/tmp/oracle-mma python3 -m kdtree_pipeline oracle ;;
    oracle-libs) # the oracle (its full matrix, both targets) once on each library of ORACLE_LIBS (default: AB_LIBS, each
                 # folder once), its evidence in /tmp/bench/oracle-<folder>, never /tmp/ev: a variant's pass proves
                 # nothing of this tree
               for d in $(printf '%s\n' ${ORACLE_LIBS:-${AB_LIBS:-build/lib}} | awk '!seen[$0]++'); do
                 KDTREE_LIB=$PWD/$d/libkdtree_verify.so KDTREE_EVIDENCE_DIR=/tmp/bench/oracle-$(basename $d) $T python3 -m kdtree_pipeline oracle \
                   $ORACLE_ARGS 2>&1 | tail -3 | sed "s|^|$(basename $d): |"
               done ;;
    first-look) python3 tools/first_look.py ;;
    first-look-mma) KDTREE_KERNEL=mma python3 tools/first_look.py ;;
    sanitize) # memcheck, racecheck, then synccheck (named barriers, __syncwarp) over the six cases in one process;
              # each tool's report is kept as /tmp/bench/sanitize-<tool>.txt (results.tgz), its summary line printed
              for tool in memcheck racecheck synccheck; do
                timeout 240 compute-sanitizer --tool $tool --print-limit 20 python3 tools/sanitize_case.py \
                  > /tmp/bench/sanitize-$tool.txt 2>&1
                echo "sanitize $tool: rc $? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' /tmp/bench/sanitize-$tool.txt | tail -1)"
              done ;;
    racecheck) # issue 16 (docs/kernel-notes.md, "Issue 16: racecheck and the hand-off of the row maxima"):
               # tools/racecheck_min.cu, the sm90 kernel's hand-off of the row maxima alone, built here with nvcc
               # (else RACECHECK_BIN, default build/lib/racecheck_min: built on the CPU machine and carried), each
               # variant run plainly and under racecheck; then the real kernel, one process per case of
               # tools/sanitize_case.py (RACECHECK_CASES), for each library in RACECHECK_LIBS (default build/lib).
               # Full reports: /tmp/bench/racecheck-*.txt; here a few lines per run (tools/racecheck_summary.py)
               compute-sanitizer --version | tail -1; nvcc --version | tail -1
               rb=/tmp/racecheck_min
               nvcc -O2 -lineinfo -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o $rb tools/racecheck_min.cu \
                 || { rb=$PWD/${RACECHECK_BIN:-build/lib/racecheck_min}; echo "racecheck: no nvcc build here, using $rb"; }
               echo "racecheck_min.cu access lines: $(grep -n '// \[[A-Z]' tools/racecheck_min.cu | sed -E 's/^([0-9]+):.*(\[[A-Z0-9]+\]).*/\2 \1/' | sort -u | tr '\n' ' ')"
               for v in "kernel|--env kernel" "kernel-1iter|--env kernel --iters 1" "kernel-pred2|--env kernel --handoff arrive-pred2" \
                        "bare|--env none" \
                        "bare-order-kernel|--order kernel" "bare-order-mirror|--order mirror" \
                        "bare-writer-first|--order writer-first" "bare-reader-first|--order reader-first" \
                        "bare-256|--threads 256" "env-mbar|--env mbar" "env-wgmma|--env wgmma" "env-fence|--env fence" \
                        "kernel-order-kernel|--env kernel --order kernel" "kernel-order-mirror|--env kernel --order mirror" \
                        "fix-arrive-imm|--env kernel --handoff arrive-imm" "fix-sync|--env kernel --handoff sync" \
                        "fix-mbar|--env kernel --handoff mbar" "broken-raw|--env kernel --broken raw" \
                        "broken-war|--env kernel --broken war"; do
                 n=${v%%|*}; o=${v#*|}; f=/tmp/bench/racecheck-min-$n.txt
                 timeout -k 5 60 $rb $o > /tmp/bench/racecheck-plain-$n.txt 2>&1; p=$?
                 timeout -k 5 180 $RC $rb $o > $f 2>&1; q=$?
                 echo "--- $n ($o): plain rc=$p $(grep -ho 'mismatches [0-9]*, spin timeouts [0-9]*' /tmp/bench/racecheck-plain-$n.txt);" \
                      "racecheck rc=$q $(grep -ho 'mismatches [0-9]*, spin timeouts [0-9]*' $f)"
                 python3 tools/racecheck_summary.py $f | tail -n +2
               done
               if compute-sanitizer --help 2>&1 | grep -q racecheck-trace-sync; then  # the order racecheck saw the barriers in
                 f=/tmp/bench/racecheck-min-trace.txt
                 timeout -k 5 120 $RC --racecheck-trace-sync yes $rb --env kernel --iters 2 --blocks 1 > $f 2>&1
                 echo "--- trace (--env kernel --iters 2 --blocks 1, --racecheck-trace-sync yes): rc=$?, first events:"
                 grep -h "called by" $f | sed -E 's/^=+ *//; s/ \(active mask[^)]*\)//; s/ at .* in / @ /' | head -48
               fi
               ;&
    racecheck-kernel) # the real kernel only: the last part of `racecheck`
               for d in ${RACECHECK_LIBS:-build/lib}; do
                 for c in ${RACECHECK_CASES:-0 1 2 3 4 5}; do
                   f=/tmp/bench/racecheck-kernel-$(basename $d)-case$c.txt
                   KDTREE_LIB=$PWD/$d/libkdtree_verify.so timeout -k 5 300 $RC python3 tools/sanitize_case.py $c > $f 2>&1
                   echo "--- kernel $d case $c: rc=$? $(grep -ho 'sanitize_case: case.*' $f)"
                   python3 tools/racecheck_summary.py $f | tail -n +2
                 done
               done ;;
    integrate) python3 -m kdtree_pipeline integrate --out /tmp/integrate;
               mkdir -p /tmp/integrate-logs; cp /tmp/integrate/*/worker.log /tmp/integrate/*/summary.json /tmp/integrate-logs/ 2>/dev/null;
               for m in off on; do cp /tmp/integrate/$m/worker.log /tmp/integrate-logs/worker-$m.log 2>/dev/null; done ;;
    graph) python3 -m kdtree_pipeline graph ;;
    defrag) python3 -m kdtree_pipeline defrag ;;
    bench-gpu-tests) python3 -m pytest -q -m gpu tests/test_bench_gpu.py -x -p no:cacheprovider ;;
    bench-micro) python3 -m kdtree_pipeline bench --suite micro --out /tmp/bench --budget-s ${BENCH_BUDGET:-300} ;;
    bench-long) python3 -m kdtree_pipeline bench --suite long-context --out /tmp/bench --budget-s ${BENCH_BUDGET:-300} ;;
    bench-frag) python3 -m kdtree_pipeline bench --suite fragmentation --out /tmp/bench --budget-s ${BENCH_BUDGET:-300} ;;
    bench-graph) python3 -m kdtree_pipeline bench --suite graph --out /tmp/bench ;;
    ab-micro) # the micro suite, ours and FlashMLA only: the carried baseline (build/lib/base), any
              # variants (build/lib/var-*), then the library under test (build/lib)
              # (AB_LIBS: a list of library folders instead)
              for d in ${AB_LIBS:-build/lib/base build/lib/var-* build/lib}; do
                so=$d/libkdtree_verify.so; [ -f $so ] || continue; lib=$(basename $d); echo "--- $lib"
                KDTREE_LIB=$PWD/$so KDTREE_EVIDENCE_DIR=/tmp/ab-ev-$lib $T python3 -m kdtree_pipeline bench --suite ${AB_SUITE:-micro} \
                  --systems ${AB_SYSTEMS:-ours,flashmla} --out /tmp/bench/ab-$lib --budget-s ${BENCH_BUDGET:-150} 2>&1 | grep -E "^\| [0-9b]|^bench"
              done ;;
    ab-native) # tools/ab_native.py (CUDA-graph replay, AB_SHAPES or the batched shapes): this tree's build/lib with
               # AB_ENV (e.g. "--env KDTREE_TMA=1 --env KDTREE_TMA=0") in AB_ROUNDS rounds, any AB_LIBS folders, then the baseline tree in build/old
               A="python3 tools/ab_native.py --json /tmp/bench/ab-native.jsonl ${AB_SHAPES:+--shapes $AB_SHAPES}"
               $T $A --label new ${AB_ENV:-} --rounds ${AB_ROUNDS:-2}
               for d in ${AB_LIBS:-}; do KDTREE_LIB=$PWD/$d/libkdtree_verify.so $T $A --label $(basename $d); done
               [ -d build/old ] && PYTHONPATH=/tmp/site:$PWD/build/old/src KDTREE_LIB=$PWD/build/old/lib/libkdtree_verify.so \
                 $T $A --label old
               $T $A --label new-again ;;
    ab-bench) # tools/ab_bench.py: AB_CASES of AB_SUITE (default micro) on the bench's own inputs, one process per
              # library of AB_LIBS (default build/lib), AB_ROUNDS rounds; the first library's process also times
              # AB_FIRST_SYSTEMS (e.g. flashmla) beside AB_SYSTEMS (default ours); AB_MASKS (default tree: FlashMLA
              # runs chains only, so AB_MASKS=chain or tree,chain to time it)
              first=1
              for r in $(seq ${AB_ROUNDS:-1}); do for d in ${AB_LIBS:-build/lib}; do
                sys=${AB_SYSTEMS:-ours}; [ $first = 1 ] && [ -n "${AB_FIRST_SYSTEMS:-}" ] && sys=$sys,$AB_FIRST_SYSTEMS; first=0
                KDTREE_LIB=$PWD/$d/libkdtree_verify.so $T python3 tools/ab_bench.py --label $(basename $d) --suite ${AB_SUITE:-micro} \
                  ${AB_CASES:+--cases $AB_CASES} ${AB_LAYOUT:+--layout $AB_LAYOUT} ${AB_EXTRA:-} $FMS --systems $sys --masks ${AB_MASKS:-tree} --json /tmp/bench/ab-bench.jsonl 2>&1 \
                  | grep -E "^\| |Error|error|WRONG"
              done; done ;;
    clock-probe) # tools/clock_probe.py: the SM clock and board power while each system's replays run back to back
                 # (CLOCK_SECONDS a window, CLOCK_ROUNDS rounds), CLOCK_CASES of the micro suite, CLOCK_SYSTEMS (default
                 # ours,flashmla), once per library of CLOCK_LIBS (default build/lib)
              for d in ${CLOCK_LIBS:-build/lib}; do
                KDTREE_LIB=$PWD/$d/libkdtree_verify.so $T python3 tools/clock_probe.py --label $(basename $d) \
                  --cases ${CLOCK_CASES:?CLOCK_CASES: comma list of micro case names} --systems ${CLOCK_SYSTEMS:-ours,flashmla} $FMS \
                  --seconds ${CLOCK_SECONDS:-1.5} --rounds ${CLOCK_ROUNDS:-2} ${CLOCK_LAYOUT:+--layout $CLOCK_LAYOUT} --json /tmp/bench/clock-probe.jsonl 2>&1 \
                  | grep -E "^==|round|bench:|reading|Error|error|WRONG|labelled"
              done ;;
    ncu-metrics) # per-kernel duration, DRAM bytes and L2 hit rate of one call (the second) for each library of AB_LIBS
                 # and case of NCU_CASES ("bs,N,H,L ..."; NCU_NOHINT=1: no host prefix hint)
         for d in ${AB_LIBS:-build/lib}; do for c in ${NCU_CASES:-1,16,8,65536}; do
           echo "--- $(basename $d) $c"
           KDTREE_LIB=$PWD/$d/libkdtree_verify.so timeout 120 ncu --clock-control none --csv --metrics \
             gpu__time_duration.sum,dram__bytes_read.sum,lts__t_sector_hit_rate.pct,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active \
             -k regex:"verify_attn|combine" --launch-skip 2 --launch-count 2 python3 tools/ncu_case.py ${c//,/ } 2>&1 \
             | grep -E '^"[0-9]' | awk -F'","' '{print $5" | "$(NF-2)" | "$(NF-1)" | "$NF}' | sed 's/"//g'
         done; done 2>&1 | tee -a /tmp/bench/ncu-metrics.txt ;;
    nox-oracle) $T python3 -m nox --no-venv -s oracle -- --groups edge,splits ;;
    gpu-test-op) $T python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernel_op.py ;;
    gpu-test-serving) $T python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernel_op_serving.py ;;
    count-launches) # launches per hooked verify call: this code, then a baseline tree carried in build/old
                    # (its src/, tools/ and lib/: the code before the C-ABI change)
                    $T python3 tools/count_launches.py --layers 61
                    [ -d build/old ] && PYTHONPATH=/tmp/site:$PWD/build/old/src KDTREE_LIB=$PWD/build/old/lib/libkdtree_verify.so \
                      $T python3 build/old/tools/count_launches.py --layers 61 ;;
    gpu-test-graph) python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_graph.py ;;
    gpu-tests) python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernel_op.py tests/test_graph.py tests/test_defrag_gate.py tests/test_bench_gpu.py tests/test_sglang_integrate.py tests/test_sglang_plugin.py tests/test_sglang_fallback.py ;;
    ncu) timeout 300 ncu --clock-control none --set full -k regex:verify_attn_kernel -c 1 -o /tmp/bench/ncu-verify \
           python3 tools/ncu_case.py && ncu --import /tmp/bench/ncu-verify.ncu-rep --page details > /tmp/bench/ncu-verify.txt;
         grep -E "Duration|Throughput|Registers|Achieved Occupancy|Warp Cycles Per Issued|Issue Slots|Stall|L2 Hit|Shared Memory" /tmp/bench/ncu-verify.txt | head -40 ;;
    ncu-stalls) # per-case stall reasons and per-instruction samples (NCU_CASES="bs,N,H,L ...")
         for c in ${NCU_CASES:-1,16,8,65536 1,64,8,65536}; do
           n=ncu-${c//,/-}
           timeout 200 ncu --clock-control none --set full --import-source no -k regex:${NCU_KERNEL:-verify_attn_kernel} -c 1 -o /tmp/bench/$n \
             python3 tools/ncu_case.py ${c//,/ } || continue
           ncu --import /tmp/bench/$n.ncu-rep --page raw --csv > /tmp/bench/$n-raw.csv
           ncu --import /tmp/bench/$n.ncu-rep --page source --csv --print-source sass > /tmp/bench/$n-sass.csv 2>/tmp/bench/$n-sass.err
           ncu --import /tmp/bench/$n.ncu-rep --page details > /tmp/bench/$n.txt
           grep -E "Duration|Warp Cycles Per Issued|Issue Slots Busy" /tmp/bench/$n.txt
           # the portable kernel's key loop cut into phases (docs/kernel-notes.md, session H)
           case ${NCU_KERNEL:-} in *mma_qreg*) python3 tools/ncu_phases.py /tmp/bench/$n-sass.csv | tee /tmp/bench/$n-phases.md ;; esac
           rm -f /tmp/bench/$n.ncu-rep
         done ;;
    ncu-flashmla) # FlashMLA's kernels on the same shapes (reference: durations, tensor pipe, stalls)
         for c in ${NCU_CASES:-1,16,8,65536 1,64,8,65536}; do
           n=ncu-flashmla-${c//,/-}
           timeout 200 ncu --clock-control none --section SpeedOfLight --section ComputeWorkloadAnalysis \
             --section WarpStateStats --section LaunchStats -k regex:"mla|combine" -c 4 -o /tmp/bench/$n python3 tools/ncu_flashmla.py ${c//,/ } || continue
           ncu --import /tmp/bench/$n.ncu-rep --page details > /tmp/bench/$n.txt
           grep -E "^  [a-zA-Z_:<>, 0-9()]+\(|Duration|Grid Size|Registers Per|Issue Slots Busy|Tensor" /tmp/bench/$n.txt | head -60
           rm -f /tmp/bench/$n.ncu-rep
         done ;;
    ncu-fm-src) # FlashMLA built from source (FM_SRC "LABEL=DIR ...", tools/build_fm_src.py, -lineinfo) under ncu --set full:
                # its main kernel's third call on NCU_CASES ("bs,N,H,L ..."), its raw metrics, details and source page
         for spec in ${FM_SRC:?FM_SRC: LABEL=DIR of tools/build_fm_src.py builds}; do for c in ${NCU_CASES:-32,8,16,8192}; do
           n=ncu-${spec%%=*}-${c//,/-}
           timeout 200 ncu --clock-control none --set full --import-source no -k regex:splitkv_mla_kernel --launch-skip 2 -c 1 \
             -o /tmp/bench/$n python3 tools/ncu_flashmla.py ${c//,/ } --fm-src ${spec#*=} || continue
           ncu --import /tmp/bench/$n.ncu-rep --page raw --csv > /tmp/bench/$n-raw.csv
           ncu --import /tmp/bench/$n.ncu-rep --page source --csv --print-source sass > /tmp/bench/$n-sass.csv 2>/tmp/bench/$n-sass.err
           ncu --import /tmp/bench/$n.ncu-rep --page details > /tmp/bench/$n.txt
           echo "--- $n"; grep -E "Duration|Elapsed Cycles|SM Frequency|Warp Cycles Per Issued|Issue Slots Busy" /tmp/bench/$n.txt
           rm -f /tmp/bench/$n.ncu-rep
         done; done ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
  echo "=== $step rc=$?"
  pack  # after every step: a run cut off at its time limit still brings back what finished
done
