#!/usr/bin/env bash
# One device call after the bundle's last part: the h200-levels study for at most STUDY_S seconds,
# its report, then the exported command relaunched and measured by `vllm bench serve`.
#   bash bench/h200_levels.sh [STUDY_S] [TRIALS] [REPLICATES] [VERIFY_S]
set -u
study_s=${1:-300} trials=${2:-3} replicates=${3:-1} verify_s=${4:-200}
. /tmp/vllm-env.sh
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
t0=$(date +%s)
timeout -k 60 -s INT "$study_s" python3 -m tuner run --study studies/h200-levels.toml \
    --trials "$trials" --replicates "$replicates" --quiet > "$OUT/run.log" 2>&1
echo "study: rc $? after $(( $(date +%s) - t0 )) s"; tail -25 "$OUT/run.log"
python3 -m tuner report --study studies/h200-levels.toml 2>&1 | tail -1
python3 -m tuner show --study studies/h200-levels.toml > "$OUT/show.txt" 2>&1; tail -8 "$OUT/show.txt"
timeout "$verify_s" bash bench/h200_verify.sh h200-levels
cp "$OUT/run.log" results/h200-levels/run.log 2>/dev/null
tar czf "$OUT/h200-levels.tgz" results/h200-levels studies/h200-levels.db
echo "total $(( $(date +%s) - t0 )) s"
