#!/bin/sh
# tuner study h200-steady-8b, trial 0: single_stream_tok_s 154.8, throughput_tok_s 10097.8, ttft_ms 366.9
# --load-format dummy kept: this serves random weights (text is noise)
# serves on vLLM's default port 8000; add --port N to change it
exec vllm serve /root/.cache/tuner/presets/llama-3.1-8b --gpu-memory-utilization 0.92 --max-model-len 131072 --max-num-seqs 128 --load-format dummy --host 127.0.0.1
