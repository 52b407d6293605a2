#!/bin/sh
# tuner study h200-16gb-32b-awq, trial 17: single stream 5.9 ± 0.0 tok/s, throughput 75.2 ± 0.0 tok/s, TTFT p50 1,559.4 ± 2.5 ms (1 run)
# written by `python -m tuner export --prefer balanced` (each export rewrites this file)
# the balanced pick, trial 16, ties within the noise on every objective with trial 17; trial 17, exported instead, changes as many flags from the defaults baseline (3), to values nearer it
# --gpu-memory-utilization 0.93 is for a card of 15.77 GiB (the study's memory budget); the trial ran it as 0.1841 of the NVIDIA H100 80GB HBM3 (79.65 GiB)
# the trials served random weights of the qwen2.5-32b-awq shape; this serves Qwen/Qwen2.5-32B-Instruct-AWQ (fetched from the hub; gated models need HF_TOKEN exported)
# serves on vLLM's default port 8000; add --port N to change it
exec vllm serve Qwen/Qwen2.5-32B-Instruct-AWQ --gpu-memory-utilization 0.93 --max-model-len 2048 --max-num-seqs 16 --cpu-offload-gb 7 --dtype float16 --host 127.0.0.1
