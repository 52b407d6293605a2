#!/usr/bin/env bash
# On the GPU machine (vLLM bundle installed): one vLLM server of the Llama-3.1-8B shape with vLLM's
# defaults (--load-format dummy), then bench/fidelity.py sweeping the concurrency levels, tuner's client
# and `vllm bench serve`'s alternating on it. Table and per-run rows in $OUT/fidelity.txt, every run
# in $OUT/runs.jsonl, vLLM's client printout in $OUT/vllm-client.log, the server log's tail in
# $OUT/server.log.
#   bash bench/h200_fidelity.sh [ROUNDS] [LEVELS] [DEADLINE] [WAVES]
# DEADLINE: seconds from this script's start after which no run starts (the server's start counts);
# the table is printed for what was measured by then. PRESET (default llama-3.1-8b), INPUT_LEN / OUTPUT_LEN / NUM_PROMPTS in the
# environment change the request shape (defaults 128 / 128 / 8); SERVER_ARGS are added to `vllm serve`.
# CLOSED_LOOP=1 runs bench/closed_loop_start.py instead (slots started together vs staggered, LEVEL_S
# seconds a level, default 10): $OUT/closed-loop-start.txt.
set -u
t0=$(date +%s)
rounds=${1:-3} levels=${2:-1,8,32,128,256} deadline=${3:-450} waves=${4:-8}
: "${OUT:=/tmp/fidelity-out}"
. /tmp/vllm-env.sh
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
model=$(python3 -c "from tuner.models.presets import preset_folder; print(preset_folder('${PRESET:-llama-3.1-8b}'))") || exit 1
port=$(python3 -c "from tuner.run.process import free_port; print(free_port())") || exit 1
log=/tmp/fidelity-server.log

# its own session and process group (this shell has no job control, so setsid execs in place and
# $! is the group's id); the whole group goes on exit, API server and engine core alike
setsid vllm serve "$model" --load-format dummy --host 127.0.0.1 --port "$port" ${SERVER_ARGS:-} > "$log" 2>&1 < /dev/null &
pgid=$!
stop() {
    kill -TERM -- -"$pgid" 2>/dev/null
    for _ in $(seq 40); do kill -0 -- -"$pgid" 2>/dev/null || break; sleep 0.5; done
    kill -KILL -- -"$pgid" 2>/dev/null
    tail -c 200000 "$log" > "$OUT/server.log"
}
trap stop EXIT
trap 'exit 130' INT TERM

until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
    if ! kill -0 "$pgid" 2>/dev/null; then echo "vLLM exited before it was ready:"; tail -30 "$log"; exit 1; fi
    if (( $(date +%s) - t0 > deadline / 2 )); then echo "vLLM not ready after $(( $(date +%s) - t0 )) s"; tail -30 "$log"; exit 1; fi
    sleep 1
done
ready=$(( $(date +%s) - t0 ))
echo "server ready after $ready s"
grep -E "max_num_seqs|max_num_batched_tokens|KV cache|Maximum concurrency|vLLM API server version" "$log" | head -6

if [ -n "${CLOSED_LOOP:-}" ]; then   # slots started together vs staggered (bench/closed_loop_start.py)
    python3 bench/closed_loop_start.py --base-url "http://127.0.0.1:$port" --model "$model" \
        --levels "$levels" --rounds "$rounds" --prompt-tokens "${INPUT_LEN:-128}" \
        --output-tokens "${OUTPUT_LEN:-128}" --seconds "${LEVEL_S:-10}" --deadline $(( deadline - ready )) \
        2> "$OUT/closed-loop-stderr.log" | tee "$OUT/closed-loop-start.txt"
    rc=${PIPESTATUS[0]}
    [ "$rc" = 0 ] || { echo "closed_loop_start.py exited with $rc:"; tail -30 "$OUT/closed-loop-stderr.log"; }
    echo "total $(( $(date +%s) - t0 )) s"
    exit "$rc"
fi
python3 bench/fidelity.py --base-url "http://127.0.0.1:$port" --model "$model" --levels "$levels" \
    --rounds "$rounds" --waves "$waves" --deadline $(( deadline - ready )) --out "$OUT" \
    --input-len "${INPUT_LEN:-128}" --output-len "${OUTPUT_LEN:-128}" --num-prompts "${NUM_PROMPTS:-8}" \
    2> "$OUT/fidelity-stderr.log" | tee "$OUT/fidelity.txt"
rc=${PIPESTATUS[0]}
[ "$rc" = 0 ] || { echo "fidelity.py exited with $rc:"; grep -v -e leaked -e nanobind "$OUT/fidelity-stderr.log" | tail -30; }
echo "total $(( $(date +%s) - t0 )) s"
exit "$rc"
