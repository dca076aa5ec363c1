#!/bin/bash
# The decision runs for tools/wip/defer.patch (PERF_NOTES §57, §62: non-causal kv ranges read
# from memory and block masks defer their short tiles; the list taken by tickets):
#   bash tools/wip/defer_ab.sh prepare  # here: .ab/head (HEAD), .ab/defer (HEAD + defer.patch)
#   bash tools/wip/defer_ab.sh ab       # on the H200 (carry [".ab"]), ~3 min: the A/B, the trees
#                                       #   interleaved A B A B in one call; a table last
#   bash tools/wip/defer_ab.sh gpu      # on the H200, ~7 min: the whole GPU suite on .ab/defer
# Logs under $OUT. The trees hold examples/ (the prefix-LM tests read it).
set -o pipefail
R=$(cd "$(dirname "$0")/../.." && pwd)
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
ab() {  # tree tag config_ab-args...
  local tree=$1 tag=$2; shift 2
  (cd "$R/.ab/$tree" && KERNELGEN_CACHE_DIR=/tmp/kc_$tree PYTHONPATH=.:tools \
     timeout 150 python3 tools/config_ab.py "$@" > "$OUT/$tag.log" 2>&1
   echo "$tag rc=$? wrong=$(grep -c WRONG "$OUT/$tag.log")")
}
case $1 in
  prepare)
    cd "$R" && { grep -qx ".ab/" .git/info/exclude || echo ".ab/" >> .git/info/exclude; }
    rm -rf .ab/head .ab/defer && mkdir -p .ab/head .ab/defer
    for t in head defer; do
      git archive HEAD kernelgen specs templates tools tests examples | tar -x -C .ab/$t
    done
    # From the root: inside .ab/ (a subdirectory of this repository) git apply skips every path
    # outside it without a word, and the trees stay the same (PERF_NOTES §53).
    git apply --directory=.ab/defer tools/wip/defer.patch || exit 1
    diff -q .ab/head/templates/include/kernelgen/fwd_sm90_tiles.cuh \
            .ab/defer/templates/include/kernelgen/fwd_sm90_tiles.cuh > /dev/null && exit 1
    echo "prepared .ab/head .ab/defer (they differ)" ;;
  ab)
    mkdir -p "$OUT"
    for i in 1 2; do
      for t in head defer; do
        ab $t p$t$i --mod packed --causal false --head-dims 64 128 --seqlens 4096 16384 --rounds 5
        ab $t d$t$i --mod document --causal false --head-dims 128 --seqlens 4096 16384 --rounds 5
      done
    done
    for m in p d; do for i in 1 2; do for t in head defer; do
      echo "== $m$t$i $(grep -A8 "^shipped" "$OUT/$m$t$i.log" | tail -n +2 | grep -v "^$" \
                        | awk '{printf "%s ", $4}')"
    done; done; done ;;
  gpu)
    mkdir -p "$OUT"
    cd "$R/.ab/defer" && PYTHONPATH=. KERNELGEN_CACHE_DIR=/tmp/kc_defer timeout 540 \
      python3 -m pytest -q -m gpu -p no:cacheprovider -n 8 -rf tests/ 2>&1 \
      | tail -12 | tee "$OUT/gpu_defer.log" ;;
  *) echo "usage: $0 prepare|ab|gpu"; exit 2 ;;
esac
