#!/usr/bin/env bash
# One device call after the bundle's last part: the vLLM-defaults baseline of bench/h200-noise.toml
# (16 waves per level) launched twice, to compare its launch-to-launch spread with the 4-wave
# h200-levels study's (issue 12, point 2: how long a phase must be).
#   bash bench/h200_noise.sh [LIMIT_S]
set -u
limit=${1:-380}
. /tmp/vllm-env.sh
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
t0=$(date +%s)
timeout -k 30 -s INT "$limit" python3 -m tuner run --study bench/h200-noise.toml --trials 1 \
    --quiet > "$OUT/run.log" 2>&1
echo "study: rc $? after $(( $(date +%s) - t0 )) s"; tail -12 "$OUT/run.log"
python3 -m tuner show --study bench/h200-noise.toml > "$OUT/show.txt" 2>&1; tail -6 "$OUT/show.txt"
db=$(ls bench/*.db studies/h200-noise.db 2>/dev/null)
tar czf "$OUT/h200-noise.tgz" results/h200-noise $db 2>/dev/null
echo "total $(( $(date +%s) - t0 )) s"
