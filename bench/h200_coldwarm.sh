#!/usr/bin/env bash
# One device call on a fresh machine (bundle just installed, vLLM's compile cache empty): is the
# first launch slower than later ones of the same config, with vLLM's own client? Then the study
# resumed. Issue 12, 7c: in the first call the study's first launch (compiled from scratch) measured
# 6-13 % less throughput than its replicate and the verify launch (both loaded from the cache).
#   bash bench/h200_coldwarm.sh [STUDY_S] [TRIALS]
set -u
study_s=${1:-300} trials=${2:-4}
mkdir -p "$OUT"
t0=$(date +%s)
for tag in cold warm; do
    timeout 200 bash bench/h200_verify.sh h200-levels "$tag" > /dev/null 2>&1
    echo "== verify $tag (after $(( $(date +%s) - t0 )) s)"; cat "$OUT/verify-$tag.txt"
done
left=$(( 590 - ($(date +%s) - t0) - 40 ))
[ "$left" -lt "$study_s" ] && study_s=$left
bash bench/h200_levels.sh "$study_s" "$trials" 1 1
