#!/bin/sh
# tuner study h200-full, trial 0: single_stream_tok_s 208.7, throughput_tok_s 11868.6, ttft_ms 254.0
exec vllm serve /root/.cache/tuner/presets/llama-3.1-8b --gpu-memory-utilization 0.9 --max-model-len 131072 --max-num-seqs 256 --load-format dummy
