#!/usr/bin/env bash
# On the GPU machine after the bundle is installed: one vLLM server (8B shape, defaults; kept alive
# across calls with setsid), then the fidelity sweep. usage: bash .gpuwork/dev.sh LIMIT_S ROUNDS LEVELS [WARM]
set -u
limit=$1 rounds=$2 levels=$3 warm=${4:-}
t0=$(date +%s)
. /tmp/vllm-env.sh
export PYTHONUNBUFFERED=1
model=$(PYTHONPATH=$PWD/.gpuwork/base python3 -c "from tuner.presets import preset_folder; print(preset_folder('llama-3.1-8b'))")
port=8011 url=http://127.0.0.1:8011
if ! curl -sf $url/health >/dev/null; then
  setsid nohup vllm serve "$model" --load-format dummy --host 127.0.0.1 --port $port > /tmp/server.log 2>&1 < /dev/null &
  echo "server starting"
fi
until curl -sf $url/health >/dev/null; do
  if ! pgrep -f "bin/vllm serve" >/dev/null; then tail -40 /tmp/server.log; exit 1; fi
  sleep 2
done
echo "server ready after $(( $(date +%s) - t0 )) s"
grep -E "max_num_seqs|max_num_batched|KV cache|Maximum concurrency|version" /tmp/server.log | head -8
left=$(( limit - ($(date +%s) - t0) - 25 ))
python3 .gpuwork/fid.py --base-url $url --model "$model" --levels "$levels" --rounds "$rounds" \
   --deadline $left --warm "$warm" --out $OUT 2>$OUT/stderr.log
tail -c 200000 /tmp/server.log > $OUT/server.log
nvidia-smi --query-gpu=name,memory.used,clocks.sm,clocks.mem --format=csv
echo "total $(( $(date +%s) - t0 )) s"
