#!/usr/bin/env bash
# One device call after the bundle's last part: the h200-levels study for at most STUDY_S seconds,
# its report, then the exported command relaunched and measured by `vllm bench serve`.
#   [STUDY=h200-levels] [VERIFY_REPEAT=N] bash bench/h200_levels.sh [STUDY_S] [TRIALS] [REPLICATES] [VERIFY_S]
# (VERIFY_REPEAT: vLLM's client runs the levels N times on the verify server, its own run-to-run spread)
set -u
study=${STUDY:-h200-levels}
study_s=${1:-300} trials=${2:-3} replicates=${3:-1} verify_s=${4:-200}
. /tmp/vllm-env.sh
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
t0=$(date +%s)
timeout -k 60 -s INT "$study_s" python3 -m tuner run --study studies/$study.toml \
    --trials "$trials" --replicates "$replicates" --quiet > "$OUT/run.log" 2>&1
echo "study: rc $? after $(( $(date +%s) - t0 )) s"; tail -25 "$OUT/run.log"
python3 -m tuner report --study studies/$study.toml 2>&1 | tail -1
python3 -m tuner show --study studies/$study.toml > "$OUT/show.txt" 2>&1; tail -8 "$OUT/show.txt"
timeout "$verify_s" bash bench/h200_verify.sh $study "" 1 "${VERIFY_REPEAT:-1}"
cp "$OUT/run.log" results/$study/run.log 2>/dev/null
tar czf "$OUT/$study.tgz" results/$study studies/$study.db
echo "total $(( $(date +%s) - t0 )) s"
