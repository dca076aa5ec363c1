#!/bin/bash
# config_ab leads on the main tree, one device call (LEADS="..." picks; logs under $OUT).
# Sessions 24 (sched rescale bn pers align alignbn base: PERF_NOTES §64, §65) and 25's (below).
export PYTHONPATH=.:tools PYTHONUNBUFFERED=1 KERNELGEN_CACHE_DIR=/tmp/kc_main
L=${LEAD_T:-100}
# Each lead also writes its winners (>= 1.5% over the shipped config, checks passed) to
# $OUT/win_<lead>.json, for tools/merge_defaults.py.
run() { local tag=$1; shift; timeout $L python3 tools/config_ab.py "$@" --export "$OUT/win_$tag.json" > "$OUT/lead_$tag.log" 2>&1
        echo "== $tag rc=$? wrong=$(grep -c WRONG "$OUT/lead_$tag.log")"
        tail -7 "$OUT/lead_$tag.log"; }
for lead in ${LEADS:-sched rescale bn pers}; do case $lead in
  sched)   run sched --causal true --head-dims 256 --seqlens 8192 16384 --key schedule --values 1 2 ;;
  rescale) run rescale --causal true --head-dims 256 --seqlens 8192 16384 --key rescale --values 1 0 --config '{"schedule": 2}' ;;
  bn)      run bn --causal true --head-dims 64 128 --seqlens 512 1024 --key block_n --values 128 64 96 ;;
  pers)    run pers --causal false --head-dims 64 --seqlens 512 1024 --key persistent --values 1 2 ;;
  align)   run align --mod packed --causal both --head-dims 64 128 --seqlens 4096 16384 --key kv_align --values 0 1 --rounds 5 ;;
  alignbn) run alignbn --mod packed --causal false --head-dims 128 --seqlens 4096 16384 --key block_n --values 144 128 160 --config '{"kv_align": 1}' ;;
  base)    (cd .ab/base && KERNELGEN_CACHE_DIR=/tmp/kc_base run base --mod packed --causal both --head-dims 64 128 --seqlens 4096 16384 --rounds 5) ;;
  rescale8k) run rescale8k --causal true --head-dims 256 --seqlens 8192 --key rescale --values 1 0 --config '{"schedule": 2}' --rounds 5 ;;
  docbn)   run docbn --mod document --causal false --head-dims 128 --seqlens 4096 --key block_n --values 128 144 160 --rounds 5 ;;
  docsched) run docsched --mod document --causal both --head-dims 128 --seqlens 4096 --key schedule --values 1 2 --rounds 5 ;;
  winbn)   run winbn --mod window --causal both --head-dims 128 --seqlens 4096 --key block_n --values 128 160 176 --config '{"kv_align": 1}' --rounds 5 ;;
  pcausal) run pcausal --mod packed --causal true --head-dims 128 --seqlens 4096 16384 --key block_n --values 128 112 144 --rounds 5 ;;
  order)   run order --causal true --head-dims 64 128 192 256 --seqlens 2048 4096 8192 16384 --key grid_order --values 0 1 --rounds 5 ;;
  pers8k)  run pers8k --causal true --head-dims 192 256 --seqlens 4096 8192 --key persistent --values 0 2 --rounds 5 ;;
  half)    run half --causal true --head-dims 64 128 --seqlens 512 1024 2048 4096 --key half_diag --values 0 1 --rounds 5 ;;
  halfmods) for m in window packed softcap; do run half_$m --mod $m --causal true --head-dims 128 --seqlens 4096 --key half_diag --values 0 1 --rounds 5; done ;;
  # Session 25 (PERF_NOTES §71): whole-config alternatives (--alts) and half_diag at the wide
  # head dims' short causal shapes.
  alibifull) run alibifull --mod alibi --causal false --head-dims 128 --seqlens 4096 --rounds 5 \
               --alts '{"block_n": 128}' \
                      '{"block_n": 176, "persistent": 0, "q_buffers": 1, "cluster": 2}' \
                      '{"persistent": 0, "q_buffers": 1}' ;;
  docfull) run docfull --mod document --causal false --head-dims 128 --seqlens 4096 --rounds 5 \
               --alts '{"schedule": 2}' '{"persistent": 1}' '{"persistent": 0, "q_buffers": 1}' \
                      '{"schedule": 2, "block_n": 112}' ;;
  halfwide) run halfwide --causal true --head-dims 192 256 --seqlens 512 1024 2048 --key half_diag --values 0 1 --rounds 5 ;;
  short64) run short64 --causal true --head-dims 64 --seqlens 512 1024 --rounds 5 \
               --alts '{"half_diag": 1}' '{"half_diag": 1, "schedule": 2}' '{"half_diag": 1, "persistent": 2}' ;;
  orderwide) run orderwide --causal true --head-dims 128 256 --seqlens 2048 4096 8192 --rounds 5 \
               --alts '{"persistent": 0, "q_buffers": 1, "grid_order": 1}' ;;
  # Session 26 (PERF_NOTES §75): each tile's first QK^T in the previous tile's last turn,
  # where the shipped config can take it (persistent, two Q buffers), and at causal 512/1k with
  # and without half_diag.
  carry)   run carry --causal false --head-dims 64 128 192 --seqlens 512 1024 2048 --key carry_qk --values 0 1 --rounds 5 ;;
  carryc)  run carryc --causal true --head-dims 64 128 --seqlens 512 1024 --rounds 5 \
               --alts '{"carry_qk": 1}' '{"half_diag": 0, "carry_qk": 1}' ;;
  # If carry_qk wins at hd64 full 512/1k: with the other schedule or the dynamic tile order.
  carryalt) run carryalt --causal false --head-dims 64 --seqlens 512 1024 --rounds 5 \
               --alts '{"carry_qk": 1}' '{"carry_qk": 1, "schedule": 2}' '{"carry_qk": 1, "persistent": 2}' ;;
  # ... and the next tile's Q prefetched into L2 where the shipped config has one Q buffer.
  qpf)     run qpf --causal both --head-dims 256 --seqlens 512 1024 2048 --key q_prefetch --values 0 1 --rounds 5 ;;
  # Session 27 (PERF_NOTES §79): the softmax beside the previous block's P V (pv_wait), alone
  # and with FA3's rescale in the next QK^T's shadow (whose tail after the wait is then P's
  # packing only); at hd64 also pingpong where the shipped config has the plain schedule or
  # none (192 x 144 is then over the register budget; 192 x 112, and 192 x 128 without sum_mma,
  # FA3's hd64 tile, not).
  pv)      run pv --causal both --head-dims 128 256 --seqlens 1024 4096 16384 --rounds 5 \
               --alts '{"pv_wait": 1}' '{"pv_wait": 1, "rescale": 1}' ;;
  pv64)    run pv64 --causal both --head-dims 64 --seqlens 1024 4096 16384 --rounds 5 \
               --alts '{"pv_wait": 1}' '{"pv_wait": 1, "rescale": 1}' \
                      '{"pv_wait": 1, "schedule": 2}' '{"pv_wait": 1, "schedule": 2, "block_n": 112}' \
                      '{"pv_wait": 1, "schedule": 2, "block_n": 128, "sum_mma": 0}' ;;
  # ... the table's other entries (after pv and pv64, if pv_wait wins there) ...
  pvrest)  run pvrest --causal both --head-dims 64 128 256 --seqlens 512 2048 8192 --rounds 5 \
               --alts '{"pv_wait": 1}' '{"pv_wait": 1, "rescale": 1}'
           run pv192 --causal both --head-dims 192 --seqlens 512 1024 2048 4096 8192 16384 --rounds 5 \
               --alts '{"pv_wait": 1}' '{"pv_wait": 1, "rescale": 1}' ;;
  # ... and the mods at hd128 4k, whose softmax is longer (softcap: a MUFU.TANH per score).
  pvmods)  for m in softcap alibi window document packed; do
             run pv_$m --mod $m --causal both --head-dims 128 --seqlens 4096 --rounds 5 \
               --alts '{"pv_wait": 1}' '{"pv_wait": 1, "rescale": 1}'; done ;;
  # wg_skip (PERF_NOTES §81): each warpgroup skips the document blocks its 64 rows do not see
  wgskip)  run wgskip --mod document --causal both --head-dims 64 128 --seqlens 2048 4096 8192 --rounds 5 \
             --alts '{"wg_skip": 1}' '{"wg_skip": 1, "block_n": 64}' ;;
  # q_buffers 3 (PERF_NOTES §82): the next tile's Q no longer waits for the buffer whose O the
  # previous tile's store still reads; short tiles (causal 512-1k), with 3 stages for the first K
  q3)      run q3 --causal both --head-dims 64 128 --seqlens 512 1024 2048 --rounds 5 \
             --alts '{"q_buffers": 3}' '{"q_buffers": 3, "stages": 3}' ;;
  # Session 30's merges (§84), measured on an H100, on the H200: each shipped entry against
  # itself without the key (a loss > 1.5% where the key is the base's confirms it)
  confirm) run cwgskip --mod document --causal both --head-dims 64 128 --seqlens 2048 4096 8192 --rounds 5 \
             --alts '{"wg_skip": 0}'
           run cq3 --causal true --head-dims 64 --seqlens 512 1024 2048 --rounds 5 \
             --alts '{"q_buffers": 2, "stages": 2}' '{"q_buffers": 3, "stages": 2}' ;;
esac; done
