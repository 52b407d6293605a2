"""SGLang's server as an engine: its flag table, argv, readiness, failure texts, capacity and metric names.

Written from SGLang 0.5.x's source (sgl-project/sglang: srt/server_args.py, srt/entrypoints/http_server.py,
srt/managers/scheduler.py, srt/model_executor/model_runner.py, srt/metrics/collector.py) and tested on
logs assembled from its messages (tests/data/sglang/). There is no install path here: SGLang needs a
CUDA (or ROCm/NPU) machine, and its CPU build is not on PyPI; a study that runs it on a machine without
it stops with one line (SGLangNotInstalled).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from pathlib import Path

from tuner.engines.base import Flag, LogsInModule, TokenizerApi, flag_argv
from tuner.errors import TunerError

# The searchable flags, in command-line order, in SGLang's words. Their vLLM counterparts:
#   mem_fraction_static ~ gpu_memory_utilization, but a share for the *static* pool only (weights +
#     KV cache); activations and CUDA graph buffers live in the 1 - mem_fraction_static left over,
#     where vLLM's share includes them. The same number therefore leaves SGLang a smaller KV cache,
#     and SGLang's default is computed from the device's memory (no fixed 0.9).
#   context_length ~ max_model_len (longest prompt + output); it does not size the KV pool, which
#     is what the memory share leaves, but it sizes the request-to-token table and so the memory.
#   max_running_requests ~ max_num_seqs (requests decoded at once; the rest queue). Absent, SGLang
#     takes min(clamp(pool tokens / context_length * 512, 2048, 4096), pool tokens // 2); it sizes the
#     request-to-token table ((n + 1) x (context_length + 4) int32), so it is memory-relevant too.
#   chunked_prefill_size ~ max_num_batched_tokens (prompt tokens per step); disable_cuda_graph ~
#     enforce_eager. SGLang has no counterpart of cpu_offload_gb in this table (its --cpu-offload-gb
#     exists but is not searched here).
FLAGS: tuple[Flag, ...] = (
    Flag("mem_fraction_static", "float", "--mem-fraction-static", default=None, memory="supply",
         low=0.0, high=1.0, low_open=True, required=True, hand_tuned=0.85,
         help="share of the device's memory for the static pool: weights and KV cache "
              "(activations and CUDA graphs use the rest)"),
    Flag("context_length", "int", "--context-length", default=None, memory="demand", speed="size", low=1,
         required=True, hand_tuned=4096,
         help="longest request (prompt + output tokens); absent: the model's config.json"),
    Flag("max_running_requests", "int", "--max-running-requests", default=None, memory="demand",
         speed="slots", low=1, required=True, hand_tuned=8,
         help="most requests decoded at once; absent: derived from the KV pool size"),
    Flag("chunked_prefill_size", "int", "--chunked-prefill-size", default=None, memory="equal",
         low=1, help="most prompt tokens prefilled in one step (absent: chosen from the device memory)"),
    Flag("disable_cuda_graph", "bool", "--disable-cuda-graph", default=False, memory="equal",
         hand_tuned=False, help="no CUDA graphs: faster start, slower decode"),
)

# srt/metrics/collector.py, exported with --enable-metrics. token_usage is the share of the KV
# pool's tokens in use (0-1, as vllm:kv_cache_usage_perc); SGLang retracts rather than preempts and
# exports the retractions as a gauge, not a counter, so "preemptions" has no sample here.
SERVER_GAUGES = ("sglang:token_usage", "sglang:num_queue_reqs", "sglang:num_running_reqs")
SERVER_COUNTERS = (
    "sglang:prompt_tokens_total", "sglang:generation_tokens_total",
    "sglang:time_to_first_token_seconds_sum", "sglang:time_to_first_token_seconds_count",
    "sglang:inter_token_latency_seconds_sum", "sglang:inter_token_latency_seconds_count",
    "sglang:e2e_request_latency_seconds_sum", "sglang:e2e_request_latency_seconds_count",
)

# srt/entrypoints/openai/serving_tokenize.py: /v1/tokenize takes `prompt` and `add_special_tokens`
# and answers `tokens`, `count`, `max_model_len`; /v1/detokenize takes `tokens` and answers `text`.
# No chat `messages`; add_special_tokens is always sent (its default was not checked in the source).
TOKENIZER_API = TokenizerApi(text_key="prompt", special_key="add_special_tokens", count_key="count",
                             detokenized_key="text", chat_messages=False, special_by_default=False,
                             tokenize_path="/v1/tokenize", detokenize_path="/v1/detokenize")

_WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth")
_DUMMY = ("--load-format", "dummy")


class SGLangNotInstalled(TunerError):
    """A study asks for SGLang and this Python cannot import it."""

    def __init__(self, python: str):
        self.python = python
        super().__init__(f"SGLang is not installed in {python} (no module sglang): install it on a "
                         "CUDA machine (pip install sglang) or set [server] command to a Python that has it")


def has_weights(model: str) -> bool:
    """Whether a model folder holds weight files (else SGLang is given --load-format dummy)."""
    path = Path(model)
    if not path.is_dir():
        return True   # a hub id or a file: SGLang resolves it
    return any(next(path.glob(p), None) is not None for p in _WEIGHT_FILES)


class SGLang(LogsInModule):
    """SGLang's OpenAI-compatible server (`python -m sglang.launch_server`)."""

    logs_module = "tuner.engines.sglang_logs"

    name = "sglang"
    label = "SGLang"
    # Before the scheduler has loaded the model, nothing listens; then uvicorn starts and /health
    # answers 503 while the server status is Starting (the warm-up request has not finished) and
    # 200 after "The server is fired up and ready to roll!". /v1/models answers as soon as uvicorn does.
    readiness_paths = ("/health", "/v1/models")
    server_gauges = SERVER_GAUGES
    server_counters = SERVER_COUNTERS
    metric_prefix = "sglang:"
    metric_names = {"kv_cache_usage": "sglang:token_usage",
                    "requests_waiting": "sglang:num_queue_reqs",
                    "ttft_seconds": "sglang:time_to_first_token_seconds",
                    "itl_seconds": "sglang:inter_token_latency_seconds"}
    tokenizer_api = TOKENIZER_API
    keep_alive = True   # uvicorn, as vLLM: a connection serves more than one streamed request
    # SGLang itself reads a key only from --api-key; this is where the tuner's client finds one
    api_key_env = "SGLANG_API_KEY"

    request_context_name = "context_length"
    export_cmd = ("python", "-m", "sglang.launch_server", "--model-path")   # the model follows
    default_port = 30000

    @property
    def flags(self) -> tuple[Flag, ...]:
        return FLAGS

    def default_cmd(self) -> tuple[str, ...]:
        """This Python's `-m sglang.launch_server`; SGLangNotInstalled when it has no sglang."""
        if importlib.util.find_spec("sglang") is None:
            raise SGLangNotInstalled(sys.executable)
        return (sys.executable, "-m", "sglang.launch_server")

    def served_model(self, model: str) -> str:
        return model   # SGLang reads the folder (or hub id) itself

    def argv(self, engine_cmd, model, flag_values, extra_args, host, port) -> list[str]:
        """`... --model-path MODEL FLAGS`, with random weights for a folder that holds none and
        the Prometheus /metrics the load test reads."""
        dummy = [] if has_weights(model) or "--load-format" in extra_args else list(_DUMMY)
        metrics = [] if "--enable-metrics" in extra_args else ["--enable-metrics"]
        return [*engine_cmd, "--model-path", model, *flag_argv(self.flags, flag_values), *extra_args,
                *dummy, *metrics, "--host", host, "--port", str(port)]

    def split_command(self, tokens: list[str]) -> tuple[str, list[str]] | None:
        """(model, the flags around it) of a trial's argv; None without --model-path (or --model).
        The --load-format dummy the engine added for a weightless folder is not a flag of the config."""
        for key in ("--model-path", "--model"):
            if key in tokens[:-1]:
                i = tokens.index(key)
                start = next((j + 1 for j, t in enumerate(tokens) if t.endswith("sglang.launch_server")), 0)
                model, flags = tokens[i + 1], tokens[start:i] + tokens[i + 2:]
                if not has_weights(model):
                    flags = _drop_pair(flags, *_DUMMY)
                return model, flags
        return None

    def exported_model(self, model: str) -> tuple[str, str]:
        """A preset's random weights become its published checkpoint (the tiny one stands for no
        model: MODEL); any other folder without weights is MODEL too; a real model is itself."""
        from tuner.models import presets

        path = Path(model)
        name = model.split(":", 1)[1] if model.startswith("preset:") else (
            path.name if path.parent == presets.cache_dir() or path == presets.TINY_MODEL else None)
        if name in presets.HF_IDS:
            return presets.HF_IDS[name], (f"the trials served random weights of the {name} shape; "
                                          f"this serves {presets.HF_IDS[name]} (fetched from the hub)")
        if name is not None or not has_weights(model):
            return "MODEL", (f"MODEL: the trials served random weights (--load-format dummy) of {model}; "
                             "put the path (or HF id) of a real checkpoint there")
        return model, ""

    def request_context(self, values: dict) -> int | None:
        """context_length; None = the model's. SGLang refuses a longer request with HTTP 400
        ("The input (N tokens) is longer than the model's context length (M tokens)." or
        "Requested token count exceeds the model's maximum context length of M tokens. ...")."""
        return values.get("context_length")

    def fixed_output(self, output_tokens: int) -> dict:
        """SGLang's sampling extensions of CompletionRequest (entrypoints/openai/protocol.py):
        min_tokens and ignore_eos."""
        return {"min_tokens": output_tokens, "ignore_eos": True}

    def env(self) -> dict[str, str]:
        return {}

    def version(self) -> str:
        try:
            return importlib.metadata.version("sglang")
        except importlib.metadata.PackageNotFoundError:
            return ""

    def read_defaults(self, engine_cmd, model, extra_args, env=None) -> dict | None:
        return None   # SGLang's defaults come from the device's memory at launch; not read here

    def budget_batch_defaults(self, budget_gib: float, platform) -> dict:
        # its chunked_prefill_size also follows the device's memory; not modelled for a budget yet
        return {}

    def memory_model(self, model_dir: str, device_memory_bytes: int, platform: str,
                     extra_args=(), device_name: str = ""):
        return None


def _drop_pair(tokens: list[str], flag: str, value: str) -> list[str]:
    out, i = [], 0
    while i < len(tokens):
        if tokens[i] == flag and i + 1 < len(tokens) and tokens[i + 1] == value:
            i += 2
            continue
        out.append(tokens[i])
        i += 1
    return out


ENGINE = SGLang()
