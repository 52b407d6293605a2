#!/bin/sh
# tuner study h200-steady-8b, trial 0: single_stream_tok_s 154.8, throughput_tok_s 10097.8, ttft_ms 366.9
# the trials served random weights of the llama-3.1-8b shape; this serves meta-llama/Llama-3.1-8B-Instruct (fetched from the hub; gated models need HF_TOKEN exported)
# serves on vLLM's default port 8000; add --port N to change it
exec vllm serve meta-llama/Llama-3.1-8B-Instruct --gpu-memory-utilization 0.92 --max-model-len 131072 --max-num-seqs 128 --host 127.0.0.1
