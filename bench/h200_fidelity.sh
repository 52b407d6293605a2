#!/usr/bin/env bash
# On the GPU machine (vLLM bundle installed): one vLLM server of the Llama-3.1-8B shape with vLLM's
# defaults, then bench/fidelity.py alternating tuner's client and `vllm bench serve` against it.
#   bash bench/h200_fidelity.sh [ROUNDS] [CONCURRENCY]
set -u
rounds=${1:-3} conc=${2:-16}
. /tmp/vllm-env.sh
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
model=$(python3 -c "from tuner.models.presets import preset_folder; print(preset_folder('llama-3.1-8b'))")
port=$(python3 -c "from tuner.run.process import free_port; print(free_port())")
vllm serve "$model" --load-format dummy --host 127.0.0.1 --port "$port" > /tmp/fidelity-server.log 2>&1 &
pid=$!
trap 'kill -INT $pid 2>/dev/null; sleep 5; kill -9 $pid 2>/dev/null' EXIT
until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
    kill -0 $pid 2>/dev/null || { tail -30 /tmp/fidelity-server.log; exit 1; }
    sleep 2
done
python3 bench/fidelity.py --base-url "http://127.0.0.1:$port" --model "$model" --input-len 128 \
    --output-len 256 --num-prompts 64 --concurrency "$conc" --rounds "$rounds" 2>&1 | tee "$OUT/fidelity.txt"
