#!/bin/sh
# tuner study h200-16gb, trial 4: single_stream_tok_s 370.4, throughput_tok_s 5206.5, ttft_ms 53.3
# --gpu-memory-utilization 0.78 is for a card of 15.77 GiB (the study's memory budget); the trial ran it as 0.0876 of the NVIDIA H200 (140.4 GiB)
# the trials served random weights of the llama-3.2-3b shape; this serves meta-llama/Llama-3.2-3B-Instruct (fetched from the hub; gated models need HF_TOKEN exported)
# serves on vLLM's default port 8000; add --port N to change it
exec vllm serve meta-llama/Llama-3.2-3B-Instruct --gpu-memory-utilization 0.78 --max-model-len 8192 --max-num-seqs 16 --host 127.0.0.1
