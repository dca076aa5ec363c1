#!/bin/bash
# The next device session's plan (tools/wip/README.md), one stage per device call, logs under
# $OUT; each stage prints a short table last.
#   bash tools/wip/next.sh suite   # ~9.5 min: the whole GPU suite on HEAD (-v: failures named)
#   bash tools/wip/next.sh confirm # ~3 min: session 30's merges (measured on an H100) on the H200
#   bash tools/wip/next.sh grid    # ~4 min: the forward grid against cuDNN (after a winner ships)
#   HD=256 bash tools/wip/next.sh retune  # <= 9 min: hd256 (then HD=192) causal 2k-16k tuned, grid_order searched
#   bash tools/wip/next.sh stalls  # ~3 min: PC sampling of short against long tiles (PERF_NOTES §73)
#   bash tools/wip/next.sh carry   # <= 7 min: memcheck of carry_qk and q_prefetch on ragged shapes
#   bash tools/wip/next.sh carryab # ~7 min: carry_qk's and q_prefetch's leads (PERF_NOTES §75, §77)
#   bash tools/wip/next.sh pvab    # ~8 min: pv_wait's leads (PERF_NOTES §79)
#   bash tools/wip/next.sh pvmods  # ~4 min: pv_wait on the mods at hd128 4k
#   bash tools/wip/next.sh pvrest  # ~9 min: pv_wait on the table's other entries (if pvab wins)
#   bash tools/wip/next.sh hd64c   # <= 9 min: hd64 causal 512/1k tuned (192 x 128 in the search)
#   bash tools/wip/next.sh wgskip  # ~3 min: wg_skip on the document mask (PERF_NOTES §81)
#   bash tools/wip/next.sh wgcheck # <= 4 min: memcheck of wg_skip's document kernels, ragged shapes
#   bash tools/wip/next.sh q3      # ~5 min: q_buffers 3 against the shipped configs (PERF_NOTES §82)
#   bash tools/wip/next.sh q3check # <= 6 min: memcheck of q_buffers 3, ragged shapes and many tiles
#   bash tools/wip/next.sh stalls256 # ~1 min: PC sampling of hd256 512 / causal 1k (where short tiles wait)
#   bash tools/wip/next.sh bwdab   # ~6 min: §87's backward against the tree before it (carry .ab/old:
#                                  #   git archive a0ac66e | tar -x -C .ab/old), kernel times, then the bench
#   bash tools/wip/next.sh bwdgpu  # ~6 min: the backward GPU tests and memcheck of the mask mods
#   bash tools/wip/next.sh bwdstalls # ~2 min: PC sampling of the plain and the packed backward (§87's lead)
#   bash tools/wip/next.sh dqtma   # ~9 min: §88's dQ by TMA reduce-adds: GPU tests, memcheck, kernel
#                                  #   times against the tree before (carry .ab/old: git archive 5a89f03), bench
#   bash tools/wip/next.sh s33check # ~7 min: §90's backward (stats read before the waits, hd64's
#                                  #   dS^T barrier arrive): backward GPU tests, memcheck of every head dim
#   bash tools/wip/next.sh s33ab   # ~7 min: §90 against the tree before (carry .ab/old: git archive
#                                  #   98f1086), main-kernel times hd64 / hd128, plain and masked
#   bash tools/wip/next.sh s33bench # ~4 min: the backward grid, then the modifier backward at 4k
#   bash tools/wip/next.sh s33stalls # ~2 min: PC sampling of the packed and varlen backward, SASS kept
#   TREES="old:.ab/old new:." bash tools/wip/next.sh s35ab # ~3.5 min a round: backward kernel times by tree
#   bash tools/wip/next.sh screen  # <= 9.5 min: the tuner's screening against the whole search (§95)
#   bash tools/wip/next.sh persab  # ~6 min: the persistent backward patch, persistent 1 against 0 (§96)
#   bash tools/wip/next.sh short   # <= 9.5 min: the forward's cells below 1.0 x cuDNN retuned (§98)
#   bash tools/wip/next.sh order   # ~2.5 min: the document backward's launch order, old against new (§100)
#   bash tools/wip/next.sh forder  # ~1.5 min: the document forward's launch order, old against new (§101)
#   bash tools/wip/next.sh varlen  # ~4 min: varlen's gradients by the document kernel (§102): GPU tests,
#                                  #   then the modifier bench's backward, old (carry .ab/head) against new
#   bash tools/wip/next.sh s40h    # <= 9.5 min: the whole GPU suite, then the modifier forward bench
#   bash tools/wip/next.sh s40g    # <= 9.5 min: the modifier backward bench, the forward grid vs cuDNN
#   bash tools/wip/next.sh s40s    # ~2.5 min: softcap's forward on pingpong tiles (config_ab --alts)
#   bash tools/wip/next.sh s41v    # ~3 min: varlen with a window's forward on narrower KV tiles
#   bash tools/wip/next.sh s43a    # <= 9.5 min: §112 (packed's `&`) against the tree before (carry
#                                  #   .ab/old: git archive caf2f5f~1), kernel times, mask mods' memcheck
#   bash tools/wip/next.sh s44     # <= 9.8 min: s43a's first round and memcheck, the whole GPU suite, det_probe
#   bash tools/wip/next.sh s43b    # <= 9.5 min: the whole GPU suite, s41v, the modifier backward bench
#   bash tools/wip/next.sh s41a    # <= 9.5 min: §109's GPU tests, then the kv-range backward on its
#                                  #   ranges against on a block mask (KERNELGEN_RANGE_BACKWARD), kernel times
set -o pipefail
R=$(cd "$(dirname "$0")/../.." && pwd)
export OUT=${OUT:-/tmp/out} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
cd "$R" || exit 1
# The backward main kernels' times (tools/wip/bwd_kernels.py) of the tree at $1, lines tagged $2.
kt() { (cd "$1" && PYTHONPATH=. timeout ${KT_T:-100} python3 "$R/tools/wip/bwd_kernels.py" "${@:3}" 2>&1 \
         | grep -E "^---|bwd_sm90" | sed "s|^|$2 |"); }
BWD_GPU_TESTS="tests/test_bwd_sm90_gpu.py tests/test_mods_bwd_gpu.py"
# prep_probe.py (the backward prep's time, D checked against float32) in .ab/old, then here.
prep_ab() { for tree in .ab/old .; do (cd $tree && PYTHONPATH=. timeout 40 python3 "$R/tools/wip/prep_probe.py" \
  2>&1 | tail -6 | sed "s|^|$tree |"); done | tee "$OUT/prep_ab.txt"; }
# host_probe.py (host, event and kernel times a call) in .ab/old, then here; $@: its options.
hp() { for tree in .ab/old .; do (cd $tree && PYTHONPATH=. timeout ${T_HOST:-50} python3 \
  "$R/tools/wip/host_probe.py" "$@" --mods varlen_window varlen packed 2>&1 \
  | grep -v -i "warn" | head -5 | sed "s|^|$tree $* |"); done; }
case $1 in
  suite) STEPS=all T_all=570 bash tools/h200_run.sh 2>&1 | tail -12 ;;
  confirm) LEADS=confirm LEAD_T=280 bash tools/wip/leads.sh 2>&1 | tee "$OUT/confirm.txt" | tail -30 ;;
  grid)  PYTHONPATH=. timeout 500 python3 -m kernelgen.cli bench --pass fwd --systems kernelgen sdpa_cudnn \
           --out "$OUT" 2>&1 | tee "$OUT/grid.txt" | tail -30 ;;
  retune) # HD=256 (80 configs a shape) or HD=192 (216): one call each, under 9 minutes
           STEPS=grid T_grid=540 PRESET=fwd-sm90-grid TOP=3 \
           GRID_ARGS="--head-dims ${HD:-256} --causal true --seqlens 2048 4096 8192 16384" \
           bash tools/h200_run.sh 2>&1 | tail -40 ;;
  hd64c) # one tune run a shape, so each exports its DB even if the next is cut short
         STEPS=grid T_grid=280 PRESET=fwd-sm90-grid TOP=3 \
           GRID_ARGS="--head-dims 64 --causal true --seqlens 512;--head-dims 64 --causal true --seqlens 1024" \
           bash tools/h200_run.sh 2>&1 | tail -20 ;;
  wgskip) LEADS=wgskip LEAD_T=240 bash tools/wip/leads.sh 2>&1 | tee "$OUT/wgskip.txt" | tail -30 ;;
  q3) LEADS=q3 LEAD_T=300 bash tools/wip/leads.sh 2>&1 | tee "$OUT/q3.txt" | tail -30 ;;
  q3check) STEPS=memcheck T_memcheck=360 RAGGED_ARGS=--q-buffers bash tools/h200_run.sh 2>&1 | tail -4 ;;
  wgcheck) STEPS=memcheck T_memcheck=300 RAGGED_ARGS=--wg-skip bash tools/h200_run.sh 2>&1 | tail -4 ;;
  stalls256) # where hd256's short tiles wait (the next Q after the epilogue? PERF_NOTES §83-§84)
         STEPS=ncusrc T_ncusrc=120 NCU_CASES="flash_attn_fwd_sm90@--head-dim 256 --seqlen 512;flash_attn_fwd_sm90@--head-dim 256 --seqlen 1024 --causal" \
           bash tools/h200_run.sh 2>&1 | tee "$OUT/stalls256.txt" | tail -80 ;;
  stalls) STEPS=ncusrc T_ncusrc=120 NCU_CASES="flash_attn_fwd_sm90@--head-dim 128 --seqlen 1024;flash_attn_fwd_sm90@--head-dim 128 --seqlen 8192;flash_attn_fwd_sm90@--head-dim 64 --seqlen 512 --causal" \
           bash tools/h200_run.sh 2>&1 | tee "$OUT/stalls.txt" | tail -120 ;;
  carry) # compute-sanitizer memcheck of session 26's keys on ragged shapes (their numerics and
         # the pooled counters' are in the suite: test_sm90_gpu)
         STEPS=memcheck T_memcheck=420 RAGGED_ARGS=--carry bash tools/h200_run.sh 2>&1 | tail -4 ;;
  carryab) # ~5 min: carry_qk against the shipped configs (config_ab, interleaved rounds)
         LEADS="carry carryc qpf" LEAD_T=150 bash tools/wip/leads.sh 2>&1 | tee "$OUT/carry.txt" | tail -50 ;;
  pvab) # the softmax beside the previous P V: hd128/256 (12 shapes), then hd64 (6, 5 configs each)
         LEADS="pv pv64" LEAD_T=290 bash tools/wip/leads.sh 2>&1 | tee "$OUT/pv.txt" | tail -50 ;;
  pvmods) LEADS=pvmods LEAD_T=60 bash tools/wip/leads.sh 2>&1 | tee "$OUT/pvmods.txt" | tail -40 ;;
  pvrest) LEADS=pvrest LEAD_T=280 bash tools/wip/leads.sh 2>&1 | tee "$OUT/pvrest.txt" | tail -60 ;;
  bwdab) # the main kernels' times per fwd+bwd (torch.profiler), old tree and HEAD interleaved
         [ -d .ab/old/kernelgen ] || { echo "carry .ab/old (git archive a0ac66e)"; exit 2; }
         for r in 1 2; do
           (cd .ab/old && PYTHONPATH=. timeout 100 python3 "$R/tools/wip/bwd_kernels.py" --mods document packed varlen window \
              2>&1 | grep -E "^---|bwd_sm90|bwd\b" | sed "s/^/old$r /")
           PYTHONPATH=. timeout 100 python3 tools/wip/bwd_kernels.py --mods document packed varlen window \
              2>&1 | grep -E "^---|bwd_sm90|bwd\b" | sed "s/^/new$r /"
         done 2>&1 | tee "$OUT/bwdab.txt"
         PYTHONPATH=. timeout 150 python3 tools/wip/bwd_kernels.py --causal --mods document packed window 2>&1 \
           | grep -E "^---|bwd_sm90|bwd\b" | tee "$OUT/bwdab_causal.txt"
         # window hd64 causal moved from flash_attn_bwd (mma.sync) to the Hopper backward
         for tree in .ab/old .; do (cd $tree && PYTHONPATH=. timeout 60 python3 "$R/tools/wip/bwd_kernels.py" \
           --head-dim 64 --causal --mods window 2>&1 | grep -E "^---|bwd" | sed "s|^|$tree |"); done \
           | tee "$OUT/bwdab_w64.txt"
         PYTHONPATH=. timeout 200 python3 -m kernelgen.cli bench --mods --pass bwd --seqlens 4096 \
           --out "$OUT" 2>&1 | tee "$OUT/modsbwd.txt" | tail -14 ;;
  bwdgpu) PYTEST_ARGS="$BWD_GPU_TESTS" \
           STEPS=pytest T_pytest=240 bash tools/h200_run.sh 2>&1 | tail -4
         STEPS=memcheck T_memcheck=200 RAGGED_ARGS="--mask-mods 64 128" bash tools/h200_run.sh 2>&1 | tail -4 ;;
  bwdstalls) # where the backward's consumers wait (§88: the atomics are gone at hd128; hd64 did not gain)
         STEPS=ncusrc T_ncusrc=150 NCU_CASES="flash_attn_bwd_sm90@--backward --seqlen 4096;flash_attn_bwd_sm90@--backward --seqlen 4096 --mod packed;flash_attn_bwd_sm90@--backward --seqlen 4096 --head-dim 64;flash_attn_bwd_sm90@--backward --seqlen 1024 --causal" \
           bash tools/h200_run.sh 2>&1 | tee "$OUT/bwdstalls.txt" | grep -E "^---|instructions|by opcode|RED|^ *[0-9.]+% +[0-9.]+% " | head -70 ;;
  dqtma) # dQ by TMA reduce-adds (PERF_NOTES §88): correctness first, then old (.ab/old) against new
         [ -d .ab/old/kernelgen ] || { echo "carry .ab/old (git archive 5a89f03)"; exit 2; }
         PYTEST_ARGS="$BWD_GPU_TESTS" \
           STEPS=pytest T_pytest=200 bash tools/h200_run.sh 2>&1 | tail -3
         STEPS=memcheck T_memcheck=150 RAGGED_ARGS="--mask-mods 64 128" bash tools/h200_run.sh 2>&1 | tail -3
         for r in 1 2; do kt .ab/old old$r --mods document packed window; kt . new$r --mods document packed window; done \
           | tee "$OUT/dqtma.txt"
         for tree in .ab/old .; do kt $tree "$tree c128" --causal --mods packed; kt $tree "$tree f64" --head-dim 64 --mods packed; done \
           | tee "$OUT/dqtma2.txt"
         PYTHONPATH=. timeout 150 python3 -m kernelgen.cli bench --pass bwd --head-dims 64 128 \
           --seqlens 1024 4096 16384 --systems kernelgen sdpa_cudnn sdpa_flash --out "$OUT" 2>&1 \
           | tee "$OUT/bwdgrid.txt" | tail -16 ;;
  s33check) PYTEST_ARGS="$BWD_GPU_TESTS tests/test_backward.py" \
           STEPS=pytest T_pytest=200 bash tools/h200_run.sh 2>&1 | tail -3
         STEPS=memcheck T_memcheck=220 bash tools/h200_run.sh 2>&1 | tail -3 ;;
  s34check) # s33check in under 7 minutes (a short device budget)
         PYTEST_ARGS="$BWD_GPU_TESTS tests/test_backward.py" \
           STEPS=pytest T_pytest=190 bash tools/h200_run.sh 2>&1 | tail -3
         STEPS=memcheck T_memcheck=180 bash tools/h200_run.sh 2>&1 | tail -3 ;;
  s34min) # ~5 min: the backward GPU tests, then the backward grid's 1k and 4k cells against cuDNN
         PYTEST_ARGS="$BWD_GPU_TESTS tests/test_backward.py" \
           STEPS=pytest T_pytest=180 bash tools/h200_run.sh 2>&1 | tail -3
         PYTHONPATH=. timeout 100 python3 -m kernelgen.cli bench --pass bwd --head-dims 64 128 \
           --seqlens 1024 4096 --systems kernelgen sdpa_cudnn --out "$OUT" 2>&1 \
           | tee "$OUT/bwdgrid.txt" | tail -10 ;;
  s34last) # ~3.5 min: the Hopper backward's GPU tests alone (the last minutes of a budget)
         PYTEST_ARGS="$BWD_GPU_TESTS" \
           STEPS=pytest T_pytest=200 bash tools/h200_run.sh 2>&1 | tail -3 ;;
  s34causal) # ~3 min: §91's peel, old (.ab/old = 98f1086: before §90 too) against new, causal 1k
         [ -d .ab/old/kernelgen ] || { echo "carry .ab/old (git archive 98f1086)"; exit 2; }
         { kt .ab/old old --causal --seqlen 1024 --mods softcap; kt . new --causal --seqlen 1024 --mods softcap
           kt .ab/old old --causal --seqlen 1024 --head-dim 64 --mods softcap
           kt . new --causal --seqlen 1024 --head-dim 64 --mods softcap; } | tee "$OUT/s34causal.txt" ;;
  s33ab) # §90: old (.ab/old = 98f1086) against new, interleaved: hd64 (the barrier), hd128 (the
         # stats before the waits; packed / varlen / window: the count and the verdicts)
         [ -d .ab/old/kernelgen ] || { echo "carry .ab/old (git archive 98f1086)"; exit 2; }
         for r in 1 2; do
           kt .ab/old old$r --head-dim 64 --mods document packed; kt . new$r --head-dim 64 --mods document packed
           kt .ab/old old$r --mods document packed varlen window; kt . new$r --mods document packed varlen window
         done | tee "$OUT/s33ab.txt"
         for tree in .ab/old .; do kt $tree "$tree c64" --head-dim 64 --causal --mods document; done \
           | tee "$OUT/s33ab_c64.txt" ;;
  s33bench) # ~4 min: the backward grid against cuDNN / flash, then the modifier backward at 4k
         PYTHONPATH=. timeout 150 python3 -m kernelgen.cli bench --pass bwd --head-dims 64 128 \
           --seqlens 1024 4096 16384 --systems kernelgen sdpa_cudnn sdpa_flash --out "$OUT" 2>&1 \
           | tee "$OUT/bwdgrid.txt" | tail -14
         mkdir -p "$OUT/mods" && PYTHONPATH=. timeout 150 python3 -m kernelgen.cli bench --mods --pass bwd \
           --seqlens 4096 --out "$OUT/mods" 2>&1 | tee "$OUT/modsbwd.txt" | tail -13 ;;
  s34) # ~8 min: s33ab cut to one round (hd64 document, hd128 packed / varlen), then s33bench
         [ -d .ab/old/kernelgen ] || { echo "carry .ab/old (git archive 98f1086)"; exit 2; }
         { kt .ab/old old --head-dim 64 --mods document; kt . new --head-dim 64 --mods document
           kt .ab/old old --mods packed varlen; kt . new --mods packed varlen; } | tee "$OUT/s34ab.txt"
         bash "$0" s33bench ;;
  s35ab) # ~3.5 min a round (PERF_NOTES §92): backward main-kernel times tree by tree, interleaved
         # per case. TREES: tag:path list (default old:.ab/old new:.; carry the .ab/ trees, e.g.
         # git archive 98f1086 | tar -x -C .ab/old); ROUNDS (default 1).
         for r in $(seq "${ROUNDS:-1}"); do
           for args in "--mods packed varlen" "--causal --mods window packed" \
                       "--causal --seqlen 1024 --mods softcap" "--causal --seqlen 1024 --head-dim 64 --mods softcap"; do
             echo "=== $args"
             for t in ${TREES:-old:.ab/old new:.}; do kt "${t#*:}" "${t%%:*}" $args; done
           done
         done 2>&1 | tee -a "$OUT/s35ab.txt" | grep -E "===|bwd_sm90" ;;
  screen) # <= 9.5 min (PERF_NOTES §95): one Hopper forward tune screened (default finalists), then
         # the whole search, each in a cache of its own (both compile everything): wall time, winner
         for f in "--finalists 96" "--finalists 100000"; do
           t0=$(date +%s)
           KERNELGEN_CACHE_DIR=$(mktemp -d) PYTHONPATH=. timeout 270 python3 -m kernelgen.cli tune \
             flash_attn_fwd_sm90 --set head_dim=64 --set causal=false --shape batch=4,seqlen=2048,heads=16 \
             --no-save --top 3 $f 2>&1 | grep -v '^\[' | tee -a "$OUT/screen.txt" | tail -6
           echo "$f: wall $(( $(date +%s) - t0 )) s" | tee -a "$OUT/screen.txt"
         done ;;
  short) # <= 9.5 min (PERF_NOTES §98): retune the grid's cells below 1.0 x cuDNN (512-1k) with the
         # current search (hd256's 512 entries predate six keys); every config's time in grid.log
         STEPS=grid T_grid=150 PRESET=fwd-sm90-grid TOP=100 FINALISTS=96 GRID_TAIL=4 \
           GRID_ARGS="--head-dims 256 --causal false --seqlens 512;--head-dims 256 --causal true --seqlens 512;--head-dims 128 --causal true --seqlens 512;--head-dims 256 --causal true --seqlens 1024;--head-dims 64 --causal false --seqlens 1024;--head-dims 64 --causal false --seqlens 512" \
           bash tools/h200_run.sh 2>&1 | tail -30 ;;
  order) # ~2.5 min (PERF_NOTES §100): the document backward's KV tiles in the mask's launch order
         # (shortest eighth last), old (.ab/old: git archive of the tree before) against new
         [ -d .ab/old/kernelgen ] || { echo "carry .ab/old"; exit 2; }
         for args in "--mods document" "--seqlen 1024 --mods document" "--head-dim 64 --mods document"; do
           echo "=== $args"; kt .ab/old old $args; kt . new $args
         done 2>&1 | tee "$OUT/order.txt" | grep -E "===|bwd_sm90" ;;
  forder) # ~1.5 min (PERF_NOTES §101): the document forward's launch order at hd64 full (persistent
         # 0), old (.ab/old: the tree before) against new: the modifier bench's forward, kernelgen only
         [ -d .ab/old/kernelgen ] || { echo "carry .ab/old"; exit 2; }
         for r in 1 2; do for tree in .ab/old .; do
           (cd $tree && PYTHONPATH=. timeout 100 python3 -m kernelgen.cli bench --mods document --pass fwd \
              --head-dims 64 --causal false --seqlens 4096 --systems kernelgen --out "$OUT/$r${tree//[.\/]/}" 2>&1 \
              | grep -E "document" | sed "s|^|$tree |")
         done; done | tee "$OUT/forder.txt" ;;
  varlen) # ~4 min (PERF_NOTES §102): varlen's gradients through flash_attn_document's backward
         # (packed._document_route): the varlen GPU tests, then bench --mods varlen document's
         # backward at 4k, the tree before (.ab/head: git archive of it) against this one
         [ -d .ab/head/kernelgen ] || { echo "carry .ab/head"; exit 2; }
         PYTHONPATH=. timeout 200 python3 -m pytest -q -x -m gpu -k "varlen" tests/test_mods_bwd_gpu.py \
           tests/test_mods_gpu.py 2>&1 | tail -3 | tee "$OUT/varlen_tests.txt"
         for r in 1 2; do for tree in .ab/head .; do
           (cd $tree && PYTHONPATH=. timeout 120 python3 -m kernelgen.cli bench --mods varlen document \
              --pass bwd --seqlens 4096 --systems kernelgen --out "$OUT/v$r${tree//[.\/]/}" 2>&1 \
              | grep -E "varlen|document" | sed "s|^|$tree |")
         done; done | tee "$OUT/varlen.txt" ;;
  persab) # ~6 min (PERF_NOTES §96): the persistent backward (carry .ab/pers: HEAD with
         # tools/wip/persistent_bwd.patch applied) against its own persistent 0, main-kernel times;
         # the mask cases spill with persistent 1 (measured anyway: the potential), ROUNDS (1)
         for r in $(seq "${ROUNDS:-1}"); do
           for args in "--mods packed document" "--causal --mods packed" "--causal --seqlen 1024 --mods softcap" \
                       "--causal --seqlen 1024 --head-dim 64 --mods softcap" "--seqlen 1024 --mods document"; do
             echo "=== $args"
             kt .ab/pers p0 $args
             kt .ab/pers p1 $args --config '{"persistent": 1}'
           done
         done 2>&1 | tee -a "$OUT/persab.txt" | grep -E "===|bwd_sm90" ;;
  s33stalls) # ~2 min: where the packed and varlen backward wait after §90 (hd128 4k), the SASS kept
         # (the .ncu-rep files are dropped so that the csv files come back)
         STEPS=ncusrc T_ncusrc=120 NCU_TOP=40 NCU_CASES="flash_attn_bwd_sm90@--backward --seqlen 4096 --mod packed;flash_attn_bwd_sm90@--backward --seqlen 4096 --mod varlen" \
           bash tools/h200_run.sh 2>&1 | tee "$OUT/s33stalls.txt" | grep -E "^---|instructions|by opcode|^ *[0-9.]+% +[0-9.]+% " | cut -c1-150 | head -60
         rm -f "$OUT"/*.ncu-rep ;;
  s40h) # <= 9.5 min, the H200's first call: the whole GPU suite, then the modifier forward bench
         STEPS=all T_all=330 bash tools/h200_run.sh 2>&1 | tail -8
         PYTHONPATH=. timeout 210 python3 -m kernelgen.cli bench --mods --pass fwd --seqlens 4096 \
           --out "$OUT/mods_fwd" > "$OUT/mods_fwd.txt" 2>&1; tail -16 "$OUT/mods_fwd.txt" ;;
  s40g) # <= 9.5 min: the modifier backward bench, then the forward grid against cuDNN
         nvidia-smi --query-gpu=name --format=csv,noheader
         PYTHONPATH=. timeout 200 python3 -m kernelgen.cli bench --mods --pass bwd --seqlens 4096 \
           --out "$OUT/mods_bwd" > "$OUT/mods_bwd.txt" 2>&1; tail -16 "$OUT/mods_bwd.txt"
         PYTHONPATH=. timeout 330 python3 -m kernelgen.cli bench --pass fwd --head-dims 128 64 256 \
           --systems kernelgen sdpa_cudnn --out "$OUT/grid" > "$OUT/grid.txt" 2>&1; tail -40 "$OUT/grid.txt" ;;
  s40s) # ~2.5 min: softcap's forward on pingpong tiles (its tuned entries at 4k are schedule 1)
         PYTHONPATH=. timeout 150 python3 tools/config_ab.py --mod softcap --head-dims 128 --seqlens 4096 \
           --causal both --rounds 3 --alts '{"schedule": 2, "block_n": 160}' '{"schedule": 2}' \
           '{"schedule": 2, "block_n": 176, "persistent": 0, "q_buffers": 1}' \
           --export "$OUT/softcap.json" > "$OUT/softcap.txt" 2>&1; tail -8 "$OUT/softcap.txt" ;;
  s41a) # <= 9.5 min: the packed / varlen gradient tests (both range backwards), then kernel times
         # of the bench's packed and varlen-with-a-window backward, on the ranges and on a block mask
         nvidia-smi --query-gpu=name --format=csv,noheader
         KERNELGEN_RANGE_BACKWARD=blockmask PYTHONPATH=. timeout ${TESTS_T:-150} python3 -m pytest -q -m gpu -p no:cacheprovider -n 8 \
           tests/test_mods_bwd_gpu.py tests/test_blockmask_gpu.py -k "packed or varlen or block" \
           > "$OUT/tests.txt" 2>&1; tail -4 "$OUT/tests.txt"
         for c in "" --causal; do for m in ranges blockmask; do
           KERNELGEN_RANGE_BACKWARD=$m kt . $m$c --mods packed varlen_window $c; done; done \
           | tee "$OUT/kt.txt" ;;
  s41v) # ~3 min: the bench's varlen call with a window (flash_attn_packed on its ranges, 513 /
         # 257 keys a row) on narrower KV tiles than the shipped configs' 128-144 (tile bounds:
         # PERF_NOTES §118, 0.763 / 0.662 of plain's at the shipped tiles, 0.858 / 0.782 at 64)
         nvidia-smi --query-gpu=name --format=csv,noheader
         PYTHONPATH=. timeout 170 python3 tools/config_ab.py --mod varlen_window --head-dims 128 \
           --seqlens 4096 --causal both --rounds 3 --alts '{"block_n": 64}' '{"block_n": 80}' \
           '{"block_n": 96}' '{"block_n": 112}' '{"block_n": 64, "schedule": 2}' \
           > "$OUT/vw.txt" 2>&1; tail -8 "$OUT/vw.txt" ;;
  s40p) # where packed's backward loses to document's on the same documents (0.73 / 0.79 of plain):
         # main-kernel times, PC-sampled stalls of both, then the modifier backward bench
         nvidia-smi --query-gpu=name --format=csv,noheader
         for c in "" --causal; do kt . k$c --mods document packed varlen $c; done | tee "$OUT/kt.txt"
         STEPS=ncusrc T_ncusrc=100 NCU_TOP=40 NCU_CASES="flash_attn_bwd_sm90@--backward --seqlen 4096 --mod packed;flash_attn_bwd_sm90@--backward --seqlen 4096 --mod document" \
           bash tools/h200_run.sh > "$OUT/stalls.txt" 2>&1
         grep -E "^---|instructions|by opcode|^ *[0-9.]+% +[0-9.]+% " "$OUT/stalls.txt" | head -60
         PYTHONPATH=. timeout 110 python3 -m kernelgen.cli bench --mods --pass bwd --seqlens 4096 \
           --out "$OUT/mods_bwd" > "$OUT/mods_bwd.txt" 2>&1; tail -16 "$OUT/mods_bwd.txt" ;;
  s40f) # ~6 min (PERF_NOTES §106): softcap's GPU tests on the folded cap, then its forward, the
         # tree before (.ab/old: git archive d71e4f5~1) against this one, interleaved, two rounds;
         # then the modifier forward bench (every modifier, 4k)
         [ -d .ab/old/kernelgen ] || { echo "carry .ab/old"; exit 2; }
         nvidia-smi --query-gpu=name --format=csv,noheader
         PYTHONPATH=. timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -k softcap \
           tests/test_mods_sm90_gpu.py tests/test_mods_gpu.py 2>&1 | tail -2
         for r in 1 2; do for tree in .ab/old .; do
           tag=$([ $tree = . ] && echo new || echo old)
           (cd $tree && PYTHONPATH=. timeout 100 python3 -m kernelgen.cli bench --mods softcap --pass fwd \
              --head-dims 128 256 --seqlens 4096 16384 --systems kernelgen --out "$OUT/sc_$tag$r" \
              > "$OUT/sc_$tag$r.txt" 2>&1)
         done; done
         python3 tools/ab_trees.py $OUT/sc_old1/mods.json $OUT/sc_new1/mods.json \
           $OUT/sc_old2/mods.json $OUT/sc_new2/mods.json 2>&1 | tee "$OUT/sc_ab.txt"
         PYTHONPATH=. timeout 120 python3 -m kernelgen.cli bench --mods --pass fwd --seqlens 4096 \
           --out "$OUT/mods_fwd" > "$OUT/mods_fwd.txt" 2>&1; tail -16 "$OUT/mods_fwd.txt" ;;
  s40v) # ~6.5 min (PERF_NOTES §107, §108): the backward GPU tests and the mask mods' memcheck on
         # this tree, then the main kernels of the tree before §107 (.ab/old: git archive
         # 5977732~1), §107's (12604aa: .ab/v107) and this one (§108), interleaved per case
         [ -d .ab/old/kernelgen ] && [ -d .ab/v107/kernelgen ] || { echo "carry .ab/old .ab/v107"; exit 2; }
         nvidia-smi --query-gpu=name --format=csv,noheader
         PYTEST_ARGS="$BWD_GPU_TESTS" STEPS=pytest T_pytest=200 bash tools/h200_run.sh 2>&1 | tail -3
         STEPS=memcheck T_memcheck=120 RAGGED_ARGS="--mask-mods 64 128" bash tools/h200_run.sh 2>&1 | tail -3
         for c in "" --causal; do
           kt .ab/old old$c --mods packed window varlen_window document $c
           kt .ab/v107 v107$c --mods packed window varlen_window document $c
           kt . new$c --mods packed window varlen_window document $c
         done | tee "$OUT/kt1.txt" ;;
  s40z) # ~4 min: the final tree's backward GPU tests, the mask mods' memcheck, the modifier
         # backward bench
         nvidia-smi --query-gpu=name --format=csv,noheader
         PYTEST_ARGS="$BWD_GPU_TESTS" STEPS=pytest T_pytest=120 bash tools/h200_run.sh 2>&1 | tail -2
         STEPS=memcheck T_memcheck=100 RAGGED_ARGS="--mask-mods 64 128" bash tools/h200_run.sh 2>&1 | tail -2
         PYTHONPATH=. timeout 100 python3 -m kernelgen.cli bench --mods --pass bwd --seqlens 4096 \
           --out "$OUT/mods_bwd" > "$OUT/mods_bwd.txt" 2>&1; tail -16 "$OUT/mods_bwd.txt" ;;
  s43a) # <= 9.5 min (PERF_NOTES §112): packed's mask_mod with `&`: main-kernel times of the tree
         # before (carry .ab/old: git archive caf2f5f~1) against this one, two rounds interleaved,
         # then the mask mods' memcheck on ragged shapes
         [ -d .ab/old/kernelgen ] || { echo "carry .ab/old"; exit 2; }
         nvidia-smi --query-gpu=name --format=csv,noheader
         for r in $(seq ${ROUNDS:-2}); do for c in "" --causal; do for tree in .ab/old .; do
           tag=$([ $tree = . ] && echo new || echo old)
           KT_T=${KT_T:-90} kt $tree $tag$r$c --mods ${KT_MODS:-packed varlen_window} $c
         done; done; done | tee "$OUT/kt.txt"
         [ "${MEMCHECK:-1}" = 1 ] || exit 0
         STEPS=memcheck T_memcheck=${T_memcheck:-120} RAGGED_ARGS="--mask-mods 64 128" bash tools/h200_run.sh 2>&1 | tail -2 ;;
  s43b) # <= 9.5 min: the whole GPU suite, varlen with a window on narrower KV tiles (s41v), then
         # the modifier backward bench
         nvidia-smi --query-gpu=name --format=csv,noheader
         STEPS=all T_all=300 bash tools/h200_run.sh 2>&1 | tail -6
         bash "$0" s41v
         PYTHONPATH=. timeout 110 python3 -m kernelgen.cli bench --mods --pass bwd --seqlens 4096 \
           --out "$OUT/mods_bwd" > "$OUT/mods_bwd.txt" 2>&1; tail -16 "$OUT/mods_bwd.txt" ;;
  s44) # <= 9.8 min, one call for all of it when machines are scarce: the mask mods' memcheck,
         # s43a's kernel times (one round), the whole GPU suite, then det_probe
         export KERNELGEN_CACHE_DIR=/tmp/kgcache   # one cache for the trees' shared kernels and the suite
         STEPS=memcheck T_memcheck=90 RAGGED_ARGS="--mask-mods 64 128" bash tools/h200_run.sh 2>&1 | tail -2
         ROUNDS=1 KT_T=70 MEMCHECK=0 bash "$0" s43a
         STEPS=all T_all=${T_all:-230} bash tools/h200_run.sh 2>&1 | tail -6
         PYTHONPATH=. timeout 60 python3 tools/wip/det_probe.py 2>&1 | tee "$OUT/det.txt" | tail -6 ;;
  s45) # <= 9.8 min (PERF_NOTES §114, §116): s43a's A/B of .ab/old (git archive 2e9b92b~1)
       # against this tree on packed and varlen with a window (one round), the kv-range backward
       # GPU tests, host_probe.py (is a modifier row's backward timed on the host?), then the
       # mask mods' memcheck (S45_MEMCHECK=0: none)
       [ -d .ab/old/kernelgen ] || { echo "carry .ab/old"; exit 2; }
       export KERNELGEN_CACHE_DIR=/tmp/kgcache
       ROUNDS=${ROUNDS:-1} KT_T=${KT_T:-65} MEMCHECK=0 bash "$0" s43a
       PYTHONPATH=. timeout ${T_TESTS:-120} python3 -m pytest -q -m gpu -p no:cacheprovider -n 8 $BWD_GPU_TESTS \
         -k "packed or varlen or window" > "$OUT/tests.txt" 2>&1; tail -3 "$OUT/tests.txt"
       PYTHONPATH=. timeout ${T_HOST:-75} python3 tools/wip/host_probe.py --causal > "$OUT/host.txt" 2>&1
       head -7 "$OUT/host.txt"
       [ "${S45_MEMCHECK:-1}" = 1 ] || exit 0
       STEPS=memcheck T_memcheck=80 RAGGED_ARGS="--mask-mods 64 128" bash tools/h200_run.sh 2>&1 | tail -2 ;;
  s45w) # ~6 min (PERF_NOTES §117): the window's forward on 64-key blocks, where each warpgroup
       # skips the block its rows do not see (causal (1024, 0) at 128 x 128: tile bound 0.917 of
       # plain's, at 128 x 64: 0.971), prep_probe.py (the backward's fixed costs), then s41v
       nvidia-smi --query-gpu=name --format=csv,noheader
       PYTHONPATH=. timeout 200 python3 tools/config_ab.py --mod window --head-dims 128 \
         --seqlens 4096 --causal both --rounds 3 --alts '{"block_n": 64}' '{"block_n": 64, "stages": 3}' \
         '{"block_n": 96}' '{"block_n": 64, "schedule": 1}' > "$OUT/window.txt" 2>&1; tail -8 "$OUT/window.txt"
       PYTHONPATH=. timeout 40 python3 tools/wip/prep_probe.py 2>&1 | tee "$OUT/prep.txt" | tail -6
       bash "$0" s41v ;;
  s45s) # <= 6 min, s45 cut down for a short budget: no memcheck, shorter limits
       KT_T=60 T_TESTS=110 T_HOST=70 S45_MEMCHECK=0 bash "$0" s45 ;;
  s46) # <= 9.8 min (PERF_NOTES §119-§121): .ab/old (git archive b9d5cf6, the tree before)
       # against this one: prep_probe.py (the prep's CTA order), host_probe.py causal (the host
       # path cuts), the whole GPU suite (every backward changed), then host_probe.py full and
       # host_prof.py (where the host time still goes); SHORT=1 stops after the suite
       [ -d .ab/old/kernelgen ] || { echo "carry .ab/old"; exit 2; }
       export KERNELGEN_CACHE_DIR=/tmp/kgcache
       nvidia-smi --query-gpu=name --format=csv,noheader
       prep_ab
       hp --causal | tee "$OUT/host_ab.txt"
       STEPS=all T_all=${T_all:-200} bash tools/h200_run.sh 2>&1 | tail -3
       [ -n "$SHORT" ] && exit 0
       hp --calls 30 | tee -a "$OUT/host_ab.txt"
       PYTHONPATH=. timeout ${T_PROF:-60} python3 tools/wip/host_prof.py --causal > "$OUT/prof.txt" 2>&1
       head -4 "$OUT/prof.txt" ;;
  s47) # <= 5.5 min, s46's essentials when device time is short: prep A/B, host A/B causal, the suite
       SHORT=1 T_all=${T_all:-170} T_HOST=40 bash "$0" s46 ;;
  s47p) # <= 2.2 min: s47's prep A/B (D checked against float32), then the backward GPU tests cut at T_BWD
       [ -d .ab/old/kernelgen ] || { echo "carry .ab/old"; exit 2; }
       prep_ab
       timeout ${T_BWD:-60} python3 -m pytest -q -m gpu -p no:cacheprovider -n 8 $BWD_GPU_TESTS 2>&1 \
         | tee "$OUT/bwd.log" | grep -E "FAILED|ERROR|passed|failed" | tail -8 ;;
  s47a) # <= 7.5 min: the modifier benches both ways at 4k (issue 6 is judged on them)
       nvidia-smi --query-gpu=name --format=csv,noheader
       for pass in fwd bwd; do PYTHONPATH=. timeout ${T_MODS:-210} python3 -m kernelgen.cli bench --mods \
         --pass $pass --seqlens 4096 --out "$OUT/mods_$pass" > "$OUT/mods_$pass.txt" 2>&1
         tail -16 "$OUT/mods_$pass.txt"; done ;;
  s47g) # <= 5.5 min: the forward grid against cuDNN (issue 5 is judged on it)
       nvidia-smi --query-gpu=name --format=csv,noheader
       PYTHONPATH=. timeout ${T_GRID:-330} python3 -m kernelgen.cli bench --pass fwd --head-dims ${HDS:-128 64 256} \
         --systems kernelgen sdpa_cudnn --out "$OUT/grid" > "$OUT/grid.txt" 2>&1; tail -40 "$OUT/grid.txt" ;;
  *) echo "usage: $0 suite|grid|retune|stalls|carry|carryab|pvab|pvmods|pvrest|hd64c|wgskip|wgcheck|q3|q3check|stalls256|confirm|bwdab|bwdgpu|bwdstalls|dqtma|s33check|s33ab|s33bench|s33stalls|s34|s34check|s34min|s34last|s34causal|s35ab|screen|persab|short|order|forder|varlen|s40h|s40g|s40p|s40f|s40v|s40z|s40s|s41v|s41a|s43a|s43b|s44|s45|s45w|s45s|s46|s47|s47p|s47a|s47g"; exit 2 ;;
esac
