#!/bin/bash
# Session 24's config_ab leads (PERF_NOTES §63), on the main tree; logs under $OUT.
export PYTHONPATH=.:tools PYTHONUNBUFFERED=1 KERNELGEN_CACHE_DIR=/tmp/kc_main
L=${LEAD_T:-100}
run() { local tag=$1; shift; timeout $L python3 tools/config_ab.py "$@" > "$OUT/lead_$tag.log" 2>&1
        echo "== $tag rc=$? wrong=$(grep -c WRONG "$OUT/lead_$tag.log")"
        tail -7 "$OUT/lead_$tag.log"; }
for lead in ${LEADS:-sched rescale bn pers}; do case $lead in
  sched)   run sched --causal true --head-dims 256 --seqlens 8192 16384 --key schedule --values 1 2 ;;
  rescale) run rescale --causal true --head-dims 256 --seqlens 8192 16384 --key rescale --values 1 0 --config '{"schedule": 2}' ;;
  bn)      run bn --causal true --head-dims 64 128 --seqlens 512 1024 --key block_n --values 128 64 96 ;;
  pers)    run pers --causal false --head-dims 64 --seqlens 512 1024 --key persistent --values 1 2 ;;
esac; done
