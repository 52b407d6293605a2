#!/bin/sh
# tuner study h200-16gb-32b-awq, trial 8: single_stream_tok_s 5.7, throughput_tok_s 41.4, ttft_ms 7174.0
# --gpu-memory-utilization 0.93 is for a card of 15.77 GiB (the study's memory budget); the trial ran it as 0.1841 of the NVIDIA H100 80GB HBM3 (79.65 GiB)
# the trials served random weights of the qwen2.5-32b-awq shape; this serves Qwen/Qwen2.5-32B-Instruct-AWQ (fetched from the hub; gated models need HF_TOKEN exported)
# serves on vLLM's default port 8000; add --port N to change it
exec vllm serve Qwen/Qwen2.5-32B-Instruct-AWQ --gpu-memory-utilization 0.93 --max-model-len 2048 --max-num-seqs 8 --cpu-offload-gb 7 --dtype float16 --host 127.0.0.1
