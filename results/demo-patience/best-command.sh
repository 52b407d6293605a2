#!/bin/sh
# tuner study demo-patience, trial 0: single_stream_tok_s 520.0, throughput_tok_s 3511.6, ttft_ms 78.9
# MODEL: the study tuned the tiny preset, which stands for no real model: put the path (or HF id) of a real checkpoint there
# serves on vLLM's default port 8000; add --port N to change it
: "${MODEL:?set MODEL to the checkpoint to serve: the tiny preset stands for no real model}"
exec vllm serve "$MODEL" --gpu-memory-utilization 0.2 --max-model-len 32768 --max-num-seqs 32 --enforce-eager --host 127.0.0.1
