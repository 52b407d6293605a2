#!/bin/sh
# tuner study h200-16gb, trial 1: single_stream_tok_s 371.0, throughput_tok_s 2667.2, ttft_ms 49.2
exec vllm serve /root/.cache/tuner/presets/llama-3.2-3b --gpu-memory-utilization 0.1033 --max-model-len 4096 --max-num-seqs 8 --load-format dummy
