#!/usr/bin/env bash
# On the GPU machine (vLLM bundle installed): relaunch a study's exported command with plain
# `vllm serve` and measure it with `vllm bench serve` at the study's load levels (issue 12, 7c).
#   bash bench/h200_verify.sh STUDY [TAG [SCALE [REPEAT]]]  (SCALE x each level's requests, REPEAT runs) e.g. bash bench/h200_verify.sh h200-levels; writes $OUT/verify[-TAG].txt
set -u
study=$1 out="$OUT/verify${2:+-$2}.txt" scale=${3:-1} repeat=${4:-1}
. /tmp/vllm-env.sh
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
# a preset model's folder (config.json, tokenizer) is written by the tuner: make it on a fresh machine
python3 -c "from tuner.cli import resolve_study_file; from tuner.config import load_study; from tuner.models.checkpoint import resolve_model; resolve_model(load_study(resolve_study_file('studies/$study.toml')))" >/dev/null 2>&1
cmd=$(python3 -m tuner export --study "studies/$study.toml" --keep-dummy 2>/dev/null)
echo "exported: $cmd" | tee "$out"
port=8123
# the server in its own process group, stopped as a group: a killed shell must not leave it serving
# the port to the next launch (that happened: a second launch measured the first one's server)
curl -sf "http://127.0.0.1:$port/health" >/dev/null && { echo "port $port already serves" | tee -a "$out"; exit 1; }
setsid bash -c "exec $cmd --port $port" > /tmp/verify-server.log 2>&1 &
pid=$!
t0=$(date +%s)
trap 'kill -INT -- -$pid 2>/dev/null; for _ in $(seq 20); do kill -0 -- -$pid 2>/dev/null || break; sleep 1; done; kill -9 -- -$pid 2>/dev/null' EXIT
until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
    kill -0 $pid 2>/dev/null || { tail -30 /tmp/verify-server.log; exit 1; }
    sleep 2
done
echo "ready after $(( $(date +%s) - t0 )) s" | tee -a "$out"
model=$(python3 -c "import shlex,sys; a=shlex.split(sys.argv[1]); print(a[a.index('serve')+1])" "$cmd")
for r in $(seq "$repeat"); do   # repeats on the same server: the client's own run-to-run spread
    echo "-- run $r on this server" | tee -a "$out"
    python3 bench/verify_export.py --study "studies/$study.toml" --base-url "http://127.0.0.1:$port" \
        --model "$model" --scale "$scale" --seed $(( 1000 * r )) 2>&1 | tee -a "$out"
done
grep -E "torch.compile took|Compiling a graph|Directly load|init engine" /tmp/verify-server.log | cut -c1-200 >> "$out"
grep -v 'POST /v1' /tmp/verify-server.log > "$OUT/server${2:+-$2}.log"
