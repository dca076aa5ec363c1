#!/bin/bash
# Session 35 (PERF_NOTES §92): the backward main kernels' times, tree by tree, interleaved per
# case. TREES names them (tag:path; default: session 35's fix against the trees it came from):
#   old = 98f1086 (before §90), t3 = 9ec7764 (§90 without the stats warp's verdicts),
#   nopeel = the working tree with kBwdPeelDiagonal false, new = the working tree.
# carry the .ab/ trees named; ROUNDS rounds (default 1).
R=$(cd "$(dirname "$0")/../.." && pwd)
export OUT=${OUT:-/tmp/out} PYTHONUNBUFFERED=1
mkdir -p "$OUT"; cd "$R" || exit 1
kt() { (cd "$1" && PYTHONPATH=. timeout 100 python3 "$R/tools/wip/bwd_kernels.py" "${@:3}" 2>&1 \
         | grep -E "^---|bwd_sm90" | sed "s|^|$2 |"); }
T=${TREES:-"old:.ab/old t3:.ab/t3 nopeel:.ab/nopeel new:."}
for r in $(seq ${ROUNDS:-1}); do
  for args in "--mods packed varlen" "--causal --mods window packed" \
              "--causal --seqlen 1024 --mods softcap" "--causal --seqlen 1024 --head-dim 64 --mods softcap"; do
    echo "=== $args"
    for t in $T; do kt "${t#*:}" "${t%%:*}" $args; done
  done
done 2>&1 | tee -a "$OUT/bisect90.txt" | grep -E "===|bwd_sm90"
