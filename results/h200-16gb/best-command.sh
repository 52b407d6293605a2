#!/bin/sh
# tuner study h200-16gb, trial 1: single_stream_tok_s 371.0, throughput_tok_s 2667.2, ttft_ms 49.2
# --gpu-memory-utilization 0.92 is for a card of 15.77 GiB (the study's memory budget); the trial ran it as 0.1033 of the NVIDIA H200 (140.4 GiB)
# the trials served random weights of the llama-3.2-3b shape; this serves meta-llama/Llama-3.2-3B-Instruct (fetched from the hub; gated models need HF_TOKEN exported)
# serves on vLLM's default port 8000; add --port N to change it
exec vllm serve meta-llama/Llama-3.2-3B-Instruct --gpu-memory-utilization 0.92 --max-model-len 4096 --max-num-seqs 8 --host 127.0.0.1
