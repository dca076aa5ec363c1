#!/bin/bash
# The decision runs for tools/wip/defer.patch (PERF_NOTES §57: non-causal kv-range and block-mask
# kernels defer their short tiles), for ALiBi hd128 on plain's config (§55's lead) and for
# tools/wip/zigzag_rule.patch (§58: the static causal zigzag only from 16 query tiles per pair):
#   bash tools/wip/defer_ab.sh prepare  # here: .ab/head (HEAD), .ab/defer (HEAD + defer.patch),
#                                       #   .ab/both (.ab/defer + zigzag_rule.patch, stacked on it)
#   bash tools/wip/defer_ab.sh ab       # on the H200 (carry [".ab"]), ~5 min: the A/Bs, the trees
#                                       #   interleaved A B A B in one call; a table last
#   bash tools/wip/defer_ab.sh ab2      # on the H200, ~2 min: the zigzag rule's A/B (both against
#                                       #   defer: the deferral does not touch causal plain kernels)
#   bash tools/wip/defer_ab.sh gpu      # on the H200, ~7 min: the whole GPU suite on .ab/both
# zigzag_rule.patch applies on top of defer.patch (land defer first; without it, `git apply
# --3way` after staging, or rebuild the patch).
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
table() {  # tags...
  for tag in "$@"; do echo "== $tag"; grep -A8 "^shipped" "$OUT/$tag.log" | tail -n +2 | grep -v "^$"; done
}
case $1 in
  prepare)
    cd "$R" && { grep -qx ".ab/" .git/info/exclude || echo ".ab/" >> .git/info/exclude; }
    rm -rf .ab/head .ab/defer .ab/both && mkdir -p .ab/head .ab/defer .ab/both
    for t in head defer both; do
      git archive HEAD kernelgen specs templates tools tests examples | tar -x -C .ab/$t
    done
    # From the root: inside .ab/ (a subdirectory of this repository) git apply skips every path
    # outside it without a word, and the trees stay the same (PERF_NOTES §53).
    git apply --directory=.ab/defer tools/wip/defer.patch || exit 1
    git apply --directory=.ab/both tools/wip/defer.patch || exit 1
    git apply --directory=.ab/both tools/wip/zigzag_rule.patch || exit 1
    diff -q .ab/head/templates/include/kernelgen/fwd_sm90_tiles.cuh \
            .ab/defer/templates/include/kernelgen/fwd_sm90_tiles.cuh > /dev/null && exit 1
    diff -q .ab/defer/templates/include/kernelgen/tile_order.cuh \
            .ab/both/templates/include/kernelgen/tile_order.cuh > /dev/null && exit 1
    echo "prepared .ab/head .ab/defer .ab/both (each differs from the one before)" ;;
  ab)
    mkdir -p "$OUT"
    for i in 1 2; do
      for t in head defer; do
        ab $t p$t$i --mod packed --causal false --head-dims 64 128 --seqlens 4096 16384 --rounds 5
        ab $t d$t$i --mod document --causal false --head-dims 128 --seqlens 4096 16384 --rounds 5
        ab $t w$t$i --mod window --causal false --head-dims 128 --seqlens 4096 --rounds 5
      done
      # ALiBi hd128 full: the shipped 128 x 144 overlap against plain's 128 x 160 pingpong, which
      # spilled before the column terms went into S (§45) and compiles clean now (§55).
      ab head a144_$i --mod alibi --causal false --head-dims 128 --seqlens 4096 16384 --rounds 5
      ab head a160_$i --mod alibi --causal false --head-dims 128 --seqlens 4096 16384 --rounds 5 \
        --config '{"block_n": 160, "schedule": 2, "persistent": 2, "q_buffers": 2}'
    done
    table phead1 pdefer1 phead2 pdefer2 dhead1 ddefer1 dhead2 ddefer2 whead1 wdefer1 whead2 \
          wdefer2 a144_1 a160_1 a144_2 a160_2 ;;
  ab2)
    mkdir -p "$OUT"
    for i in 1 2; do
      for t in defer both; do   # the shipped static causal configs: hd64 512, hd256 512-4k
        ab $t z$t$i --causal true --head-dims 64 256 --seqlens 512 1024 2048 4096 --rounds 5
      done
    done
    table zdefer1 zboth1 zdefer2 zboth2 ;;
  gpu)
    mkdir -p "$OUT"
    cd "$R/.ab/both" && PYTHONPATH=. KERNELGEN_CACHE_DIR=/tmp/kc_both timeout 540 \
      python3 -m pytest -q -m gpu -p no:cacheprovider -n 8 -rf tests/ 2>&1 \
      | tail -12 | tee "$OUT/gpu_both.log" ;;
  *) echo "usage: $0 prepare|ab|ab2|gpu"; exit 2 ;;
esac
