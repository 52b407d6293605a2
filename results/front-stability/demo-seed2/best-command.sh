#!/bin/sh
# tuner study demo-seed2, trial 3: single_stream_tok_s 101.2, throughput_tok_s 196.2, ttft_ms 2682.9
# MODEL: the study tuned the tiny preset, which stands for no real model: put the path (or HF id) of a real checkpoint there
# serves on vLLM's default port 8000; add --port N to change it
: "${MODEL:?set MODEL to the checkpoint to serve: the tiny preset stands for no real model}"
exec vllm serve "$MODEL" --gpu-memory-utilization 0.12 --max-model-len 4096 --max-num-seqs 32 --enforce-eager --host 127.0.0.1
