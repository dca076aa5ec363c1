#!/bin/bash
# One device call runs the steps named in $STEPS, each under its own time limit; logs under $OUT.
#   STEPS="fwd bwd tune sm90 memcheck" bash tools/h200_run.sh
# Each step runs under STEP_TIMEOUT seconds (240), or T_<step> where set (T_grid=300).
set -o pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 KERNELGEN_CACHE_DIR=${KERNELGEN_CACHE_DIR:-/tmp/kgcache}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS=${STEPS:-"fwd bwd tune sm90 memcheck"}
T0=${STEP_TIMEOUT:-240}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv,noheader
# XDIST workers (pytest-xdist, in the H200 image): the tests are correctness checks, so they may
# share the GPU; the workers compile in parallel, which is most of the suite's time on one.
gpu_tests() { timeout $T python3 -m pytest -q -m gpu -p no:cacheprovider --maxfail=15 \
                -n ${XDIST:-8} "$@" 2>&1; }
for step in $STEPS; do
  echo "=== $step"
  limit="T_$step"; T=${!limit:-$T0}
  case $step in
    build)   timeout $T python3 -m kernelgen.cli build --arch sm_90 --arch sm_90a -j 16 2>&1 \
               | tee "$OUT/build.log" | tail -3 ;;
    fwd)     gpu_tests tests/test_attention.py tests/test_errors.py tests/test_library.py \
               tests/test_mods_gpu.py | tee "$OUT/fwd.log" | tail -30 ;;
    fwd80)   KERNELGEN_FORWARD=sm80 gpu_tests tests/test_attention.py tests/test_library.py \
               | tee "$OUT/fwd80.log" | tail -30 ;;
    mods)    gpu_tests tests/test_mods_gpu.py tests/test_mods_sm90_gpu.py tests/test_mods_bwd_gpu.py \
               tests/test_sm90_gpu.py tests/test_library.py | tee "$OUT/mods.log" | tail -8
             KERNELGEN_FORWARD=sm80 gpu_tests tests/test_mods_gpu.py | tee "$OUT/mods80.log" | tail -4 ;;
    benchmods) timeout $T python3 -m kernelgen.cli bench --mods --out "$OUT" ${MODS_ARGS} 2>&1 \
               | tee "$OUT/benchmods.log" ;;
    bwd)     gpu_tests tests/test_backward.py tests/test_backward_tune.py tests/test_backward_compile.py | tee "$OUT/bwd.log" | tail -30 ;;
    tune)    gpu_tests tests/test_tune_gpu.py | tee "$OUT/tune.log" | tail -30 ;;
    tunemods) gpu_tests tests/test_tune_mods_gpu.py | tee "$OUT/tunemods.log" | tail -30 ;;
    bwd90)   gpu_tests tests/test_bwd_sm90_gpu.py | tee "$OUT/bwd90.log" | tail -30 ;;
    blockmask) gpu_tests tests/test_blockmask_gpu.py | tee "$OUT/blockmask.log" | tail -30
             KERNELGEN_FORWARD=sm80 gpu_tests tests/test_blockmask_gpu.py | tee "$OUT/blockmask80.log" | tail -4 ;;
    tunemodsdb) # TUNE_MODS_ARGS: argument sets of tools/tune_mods.py separated by ';'
             IFS=';' read -ra runs <<< "${TUNE_MODS_ARGS:- }"
             for args in "${runs[@]}"; do
               timeout $T python3 tools/tune_mods.py --export "$OUT/tuned_mods.json" $args 2>&1 \
                 | tee -a "$OUT/tune_mods.log" | grep -v '^\['
             done ;;
    ncu|ncusrc) # NCU_CASES: "kernel-regex@profile_fwd.py args" items separated by ';'. ncu: the
             # sections' figures; ncusrc: PC sampling per SASS instruction (tools/ncu_stalls.py ranks it)
             default="flash_attn_fwd_sm90@;sdpa|fmha|fprop|cudnn@--sdpa cudnn"
             [ $step = ncusrc ] && default="flash_attn_fwd_sm90@--head-dim 128 --seqlen 1024"
             IFS=';' read -ra cases <<< "${NCU_CASES:-$default}"
             n=0
             for case in "${cases[@]}"; do
               kernel=${case%%@*}; args=${case#*@}; n=$((n + 1))
               echo "--- $kernel $args" | tee -a "$OUT/$step.log"
               profile() { timeout $T ncu --clock-control none -k "regex:$kernel" -c 1 --launch-skip 3 \
                             "$@" python3 tools/profile_fwd.py $args; }
               if [ $step = ncu ]; then
                 profile --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \
                   --section SchedulerStats --section LaunchStats --section Occupancy \
                   --metrics "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active,sm__cycles_elapsed.avg.per_second,regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio" \
                   2>&1 | tee -a "$OUT/ncu.log" \
                   | grep -E "gmma|pipe_|per_second|Throughput|Issue Slots|Eligible|Active Warps|Registers|Duration|Block Size|Grid Size|==PROF==|==ERROR==|Context|stalled_(barrier|long|wait|math|mio|short|dispatch|no_inst|sleeping|membar|branch|lg|selected|not_selected|tex|drain|misc)" | head -60
               else
                 profile --section SourceCounters --section WarpStateStats --import-source no \
                   -f -o "$OUT/src$n" > "$OUT/src$n.prof" 2>&1 || tail -5 "$OUT/src$n.prof"
                 ncu --import "$OUT/src$n.ncu-rep" --page source --csv --print-source sass \
                   > "$OUT/src$n.csv" 2> "$OUT/src$n.err" || tail -5 "$OUT/src$n.err"
                 # the plain forward's SASS with line info (other cases: sass_lines.py refuses
                 # their arguments, and the table goes without template lines)
                 lines=
                 python3 tools/sass_lines.py $args > "$OUT/src$n.sass" 2>> "$OUT/src$n.err" \
                   && lines="--lines $OUT/src$n.sass"
                 python3 tools/ncu_stalls.py "$OUT/src$n.csv" --top ${NCU_TOP:-30} $lines 2>&1 \
                   | tee -a "$OUT/ncusrc.log"
               fi
             done ;;
    bwdcheck) # BWDCHECK_ARGS: argument sets of tools/bwd_check.py separated by ';'
             IFS=';' read -ra runs <<< "${BWDCHECK_ARGS:- }"
             for args in "${runs[@]}"; do
               timeout $T python3 tools/bwd_check.py $args 2>&1 | tee -a "$OUT/bwdcheck.log" | tail -6
             done ;;
    ab)      # AB_ARGS: argument sets of tools/config_ab.py separated by ';'
             IFS=';' read -ra runs <<< "${AB_ARGS:- }"
             for args in "${runs[@]}"; do
               eval "timeout $T python3 tools/config_ab.py $args" 2>&1 | tee -a "$OUT/ab.log" | tail -${AB_TAIL:-24}
             done ;;
    # -v: each test's outcome as it ends, so a run cut by its timeout still names its failures.
    pytest)  gpu_tests -v ${PYTEST_ARGS} | tee -a "$OUT/pytest.log" \
               | grep -E "FAILED|ERROR|passed|failed|^E " | tail -30 ;;
    all)     gpu_tests -vv tests/ | tee "$OUT/all.log" | grep -E "FAILED|ERROR|passed|failed|^E " | tail -30 ;;
    sm90)    gpu_tests tests/test_sm90_gpu.py | tee "$OUT/sm90.log" | tail -30 ;;
    memcheck|synccheck) # RAGGED_ARGS: tools/ragged.py's (--clusters: the short run)
             timeout $T compute-sanitizer --tool $step --report-api-errors no --error-exitcode 9 \
               python3 tools/ragged.py ${RAGGED_ARGS} 2>&1 | tee "$OUT/$step.log" | tail -6 ;;
    overhead) timeout 120 python3 tools/overhead.py 2>&1 | tee "$OUT/overhead.log" ;;
    demo)    timeout 200 python3 -m kernelgen.demo 2>&1 | tee "$OUT/demo.log" ;;
    sweep)   timeout $T python3 tools/sweep.py ${SWEEP_ARGS} 2>&1 | tee "$OUT/sweep.log" ;;
    tune128) for c in false true; do timeout $T python3 -m kernelgen.cli tune flash_attn_fwd \
               --set head_dim=128 --set dtype=bf16 --set causal=$c \
               --shape batch=4,seqlen=4096,heads=16 2>&1 | tail -12; done | tee "$OUT/tune128.log" ;;
    grid)    # GRID_ARGS: argument sets of one preset's tune runs separated by ';' (the export after
             # each holds the whole DB, so the last one has every run); FINALISTS: how many configs
             # are timed in full (default: every one, as the shipped table was tuned: PERF_NOTES §95)
             IFS=';' read -ra runs <<< "${GRID_ARGS:- }"
             for args in "${runs[@]}"; do
               timeout $T python3 -m kernelgen.cli tune --preset ${PRESET:-fwd-grid} --top ${TOP:-4} --finalists ${FINALISTS:-100000} \
                 --export "$OUT/tuned_${PRESET:-fwd-grid}.json" $args 2>&1 | tee -a "$OUT/grid.log" \
                 | grep -v '^\[' | grep -E "chosen|summary|wrote|Error|error" | tail -${GRID_TAIL:-40}
             done ;;
    probe)   python3 -c "import matplotlib; print('matplotlib', matplotlib.__version__)" 2>&1 | tail -1
             python3 tools/probe_tma.py 2>&1 | tee "$OUT/probe.log" ;;
    bench)   timeout $T python3 -m kernelgen.cli bench --out "$OUT" ${BENCH_ARGS} 2>&1 | tee "$OUT/bench.log" ;;
  esac
done
