#!/bin/bash
# One device call: GPU tests, memcheck on ragged shapes, config sweep, benchmark. Logs under $OUT.
set -o pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 KERNELGEN_CACHE_DIR=${KERNELGEN_CACHE_DIR:-/tmp/kgcache}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS=${STEPS:-"tests memcheck sweep bench"}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv,noheader
for step in $STEPS; do
  echo "=== $step"
  case $step in
    tests)   timeout 400 python3 -m pytest -q -m gpu -x tests ${PYTEST_ARGS} 2>&1 | tee "$OUT/tests.log" | tail -25 ;;
    memcheck) timeout 300 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 \
               python3 tools/ragged.py 2>&1 | tee "$OUT/memcheck.log" | tail -8 ;;
    overhead) timeout 120 python3 tools/overhead.py 2>&1 | tee "$OUT/overhead.log" ;;
    demo)    timeout 200 python3 -m kernelgen.demo 2>&1 | tee "$OUT/demo.log" ;;
    sweep)   timeout 400 python3 tools/sweep.py ${SWEEP_ARGS} 2>&1 | tee "$OUT/sweep.log" ;;
    bench)   timeout 400 python3 -m kernelgen.cli bench --out "$OUT" ${BENCH_ARGS} 2>&1 | tee "$OUT/bench.log" ;;
  esac
done
