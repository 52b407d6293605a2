#!/bin/sh
# tuner study demo-seed8, trial 0: single_stream_tok_s 163.2, throughput_tok_s 1768.8, ttft_ms 142.6
# MODEL: the study tuned the tiny preset, which stands for no real model: put the path (or HF id) of a real checkpoint there
# serves on vLLM's default port 8000; add --port N to change it
: "${MODEL:?set MODEL to the checkpoint to serve: the tiny preset stands for no real model}"
exec vllm serve "$MODEL" --gpu-memory-utilization 0.2 --max-model-len 32768 --max-num-seqs 32 --enforce-eager --host 127.0.0.1
