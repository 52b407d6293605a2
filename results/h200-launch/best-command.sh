#!/bin/sh
# tuner study h200-launch, trial 2: single stream 161.5 tok/s, throughput 3,994.2 tok/s, TTFT p50 134.4 ms (1 run)
# written by `python -m tuner export --prefer balanced` (each export rewrites this file)
# the trials served random weights of the llama-3.1-8b shape; this serves meta-llama/Llama-3.1-8B-Instruct (fetched from the hub; gated models need HF_TOKEN exported)
# serves on vLLM's default port 8000; add --port N to change it
exec vllm serve meta-llama/Llama-3.1-8B-Instruct --gpu-memory-utilization 0.86 --max-model-len 4096 --max-num-seqs 256 --host 127.0.0.1
