#!/bin/sh
# tuner study h200-steady, trial 0: single_stream_tok_s 371.1, throughput_tok_s 19259.2, ttft_ms 221.8
# the trials served random weights of the llama-3.2-3b shape; this serves meta-llama/Llama-3.2-3B-Instruct (fetched from the hub; gated models need HF_TOKEN exported)
# serves on vLLM's default port 8000; add --port N to change it
exec vllm serve meta-llama/Llama-3.2-3B-Instruct --gpu-memory-utilization 0.92 --max-model-len 131072 --max-num-seqs 128 --host 127.0.0.1
