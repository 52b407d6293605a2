#!/bin/sh
# tuner study h200-24gb-mix, trial 7: single stream 201.9 tok/s, throughput 6,342.9 tok/s, TTFT p50 161.8 ms (1 run)
# written by `python -m tuner export --prefer balanced` (each export rewrites this file)
# --gpu-memory-utilization 0.94 is for a card of 24 GiB (the study's memory budget); the trial ran it as 0.1607 of the NVIDIA H200 (140.4 GiB)
# the trials served random weights of the llama-3.1-8b shape; this serves meta-llama/Llama-3.1-8B-Instruct (fetched from the hub; gated models need HF_TOKEN exported)
# serves on vLLM's default port 8000; add --port N to change it
exec vllm serve meta-llama/Llama-3.1-8B-Instruct --gpu-memory-utilization 0.94 --max-model-len 16384 --max-num-seqs 128 --kv-cache-dtype fp8 --host 127.0.0.1
