#!/bin/sh
# tuner study h200-full, trial 2: single_stream_tok_s 208.4, throughput_tok_s 2998.6, ttft_ms 57.4
# the trials served random weights of the llama-3.1-8b shape; this serves meta-llama/Llama-3.1-8B-Instruct (fetched from the hub; gated models need HF_TOKEN exported)
# serves on vLLM's default port 8000; add --port N to change it
exec vllm serve meta-llama/Llama-3.1-8B-Instruct --gpu-memory-utilization 0.75 --max-model-len 4096 --max-num-seqs 16 --host 127.0.0.1
