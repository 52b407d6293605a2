#!/bin/sh
# tuner study h200-steady, trial 0: single_stream_tok_s 371.1, throughput_tok_s 19259.2, ttft_ms 221.8
# --load-format dummy kept: this serves random weights (text is noise)
# serves on vLLM's default port 8000; add --port N to change it
exec vllm serve /root/.cache/tuner/presets/llama-3.2-3b --gpu-memory-utilization 0.92 --max-model-len 131072 --max-num-seqs 128 --load-format dummy --host 127.0.0.1
