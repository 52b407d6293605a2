#!/bin/sh
# tuner study h200-16gb-32b-awq, trial 4: single_stream_tok_s 4.3, throughput_tok_s 16.1, ttft_ms 24777.3
# --gpu-memory-utilization 0.89 is for a card of 15.77 GiB (the study's memory budget); the trial ran it as 0.1762 of the NVIDIA H100 80GB HBM3 (79.65 GiB)
# the trials served random weights of the qwen2.5-32b-awq shape; this serves Qwen/Qwen2.5-32B-Instruct-AWQ (fetched from the hub; gated models need HF_TOKEN exported)
# serves on vLLM's default port 8000; add --port N to change it
exec vllm serve Qwen/Qwen2.5-32B-Instruct-AWQ --gpu-memory-utilization 0.89 --max-model-len 2048 --max-num-seqs 4 --cpu-offload-gb 10 --dtype float16 --host 127.0.0.1
