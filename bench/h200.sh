#!/usr/bin/env bash
# Run a tuner study on the GPU machine for at most SECONDS, then bring its results back in $OUT.
# The vLLM bundle must be installed first (../shared/gpu/README.md). The tuner's --time-limit starts
# no launch that its median launch says would end after SECONDS; a hard stop 60 s later is the
# backstop (SIGINT: the server is stopped, the unfinished trial is re-queued). Either way the study
# resumes on the next call.
#
#   bash bench/h200.sh STUDY SECONDS TRIALS     e.g. bash bench/h200.sh h200-full 520 10
# SPY_S=N: for the first N seconds, sample vLLM's engine-core stacks every 2 s with py-spy (its
# wheel carried in .whl/) into $OUT/engine-stacks.txt: where a launch spends its silent seconds.
# Name .whl in that call's `carry`: each call sends only what it carries (without it, no stacks).
set -u
study=$1 seconds=$2 trials=$3
. /tmp/vllm-env.sh
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
if [ -n "${SPY_S:-}" ] && ls .whl/py_spy*.whl >/dev/null 2>&1 \
        && python3 -m pip install -q --no-index --no-deps --target /tmp/spy .whl/py_spy*.whl; then
    ( end=$(( $(date +%s) + SPY_S ))
      while [ "$(date +%s)" -lt "$end" ]; do
          for p in $(pgrep -f EngineCore); do
              echo "== $(date +%T.%N) pid $p"; /tmp/spy/bin/py-spy dump --pid "$p" 2>&1 | head -40
          done
          sleep 2
      done > "$OUT/engine-stacks.txt" 2>&1 ) &
fi
python3 -m tuner doctor --study "studies/$study.toml" 2>&1 | tee -a "/tmp/$study.log"
minutes=$(python3 -c "print($seconds / 60)")
timeout -k 30 -s INT $(( seconds + 60 )) python3 -m tuner run --study "studies/$study.toml" \
    --trials "$trials" --time-limit "$minutes" \
    2>&1 | grep --line-buffered -v -E '^(warmup|single_stream|throughput): ' | tee -a "/tmp/$study.log"
python3 -m tuner report --study "studies/$study.toml" 2>&1 | tail -2
python3 -m tuner show --study "studies/$study.toml" 2>&1 | tail -30
cp "/tmp/$study.log" "results/$study/run.log"
tar czf "$OUT/$study.tgz" "results/$study" "studies/$study.db"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
