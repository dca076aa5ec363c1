#!/bin/bash
# The decision runs for tools/wip/wg_skip.patch (PERF_NOTES §52), for the landed static zigzag
# and for tools/wip/alibi_init.patch, whose A/Bs compared two identical trees (§47, §48, §53):
#   bash tools/wip/wg_skip_ab.sh prepare  # here: .ab/head (HEAD), .ab/skip (HEAD + wg_skip),
#                                         #   .ab/nozig (HEAD, zigzag off), .ab/alibi (+ alibi_init)
#   bash tools/wip/wg_skip_ab.sh ab       # on the H200 (carry [".ab"]), ~5 min: wg_skip's config_ab
#                                         #   A/B, the trees interleaved A B A B; a table last
#   bash tools/wip/wg_skip_ab.sh ab2      # on the H200, ~3 min: the zigzag off and alibi_init
#   bash tools/wip/wg_skip_ab.sh gpu      # on the H200, ~7 min: the GPU suite on .ab/skip
# Logs under $OUT.
set -o pipefail
R=$(cd "$(dirname "$0")/../.." && pwd)
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
ab() {  # tree tag config_ab-args...
  local tree=$1 tag=$2; shift 2
  (cd "$R/.ab/$tree" && KERNELGEN_CACHE_DIR=/tmp/kc_$tree PYTHONPATH=.:tools \
     timeout 120 python3 tools/config_ab.py "$@" > "$OUT/$tag.log" 2>&1
   echo "$tag rc=$? wrong=$(grep -c WRONG "$OUT/$tag.log")")
}
table() {  # tags...
  for tag in "$@"; do echo "== $tag"; grep -A8 "^shipped" "$OUT/$tag.log" | tail -n +2 | grep -v "^$"; done
}
case $1 in
  prepare)
    cd "$R" && { grep -qx ".ab/" .git/info/exclude || echo ".ab/" >> .git/info/exclude; }
    rm -rf .ab/head .ab/skip .ab/nozig .ab/alibi && mkdir -p .ab/head .ab/skip .ab/nozig .ab/alibi
    for t in head skip nozig alibi; do
      git archive HEAD kernelgen specs templates tools tests | tar -x -C .ab/$t
    done
    # From the root: inside .ab/ (a subdirectory of this repository) git apply skips every path
    # outside it without a word, and the trees stay the same (PERF_NOTES §53).
    git apply --directory=.ab/skip tools/wip/wg_skip.patch
    git apply --directory=.ab/alibi tools/wip/alibi_init.patch
    sed -i 's/static constexpr bool kZigzag = .*;/static constexpr bool kZigzag = false;/' \
      .ab/nozig/templates/include/kernelgen/fwd_sm90_tiles.cuh
    diff -q .ab/head/templates/include/kernelgen/flash_fwd_sm90.cuh \
            .ab/skip/templates/include/kernelgen/flash_fwd_sm90.cuh > /dev/null && exit 1
    diff -q .ab/head/templates/include/kernelgen/fwd_sm90_tiles.cuh \
            .ab/nozig/templates/include/kernelgen/fwd_sm90_tiles.cuh > /dev/null && exit 1
    diff -q .ab/head/templates/include/kernelgen/fwd_sm90_masks.cuh \
            .ab/alibi/templates/include/kernelgen/fwd_sm90_masks.cuh > /dev/null && exit 1
    echo "prepared .ab/head .ab/skip .ab/nozig .ab/alibi (each differs from head)" ;;
  ab)
    mkdir -p "$OUT"
    for i in 1 2; do
      for t in head skip; do
        ab $t c$t$i --causal true --head-dims 64 --seqlens 1024 2048 4096 --rounds 5
        ab $t s$t$i --causal true --head-dims 192 256 --seqlens 512 1024 --rounds 5
        ab $t p$t$i --mod packed --causal both --head-dims 128 --seqlens 4096 16384 --rounds 5
        ab $t w$t$i --mod window --causal both --head-dims 128 --seqlens 4096 --rounds 5
      done
    done
    table chead1 cskip1 chead2 cskip2 shead1 sskip1 shead2 sskip2 phead1 pskip1 phead2 pskip2 \
          whead1 wskip1 whead2 wskip2 ;;
  ab2)
    mkdir -p "$OUT"
    for i in 1 2; do
      for t in head nozig; do   # the shipped static causal configs
        ab $t z$t$i --causal true --head-dims 256 --seqlens 1024 2048 4096 --rounds 5
      done
      for t in head alibi; do
        ab $t a$t$i --mod alibi --head-dims 64 128 --seqlens 4096 16384 --causal both --rounds 5
      done
    done
    table zhead1 znozig1 zhead2 znozig2 ahead1 aalibi1 ahead2 aalibi2 ;;
  gpu)
    mkdir -p "$OUT"
    cd "$R/.ab/skip" && PYTHONPATH=. KERNELGEN_CACHE_DIR=/tmp/kc_skip timeout 540 \
      python3 -m pytest -q -m gpu -p no:cacheprovider -n 8 tests/ 2>&1 | tail -3 | tee "$OUT/gpu.log" ;;
  *) echo "usage: $0 prepare|ab|ab2|gpu"; exit 2 ;;
esac
