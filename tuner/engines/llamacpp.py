"""llama.cpp's server as an engine: its flag table, argv, readiness, failure texts, capacity facts and metric names."""

from __future__ import annotations

import functools
import importlib.metadata
import os
import re
import sys
from pathlib import Path

from tuner.engines.base import Flag, TokenizerApi, flag_argv, line_at, log_tail, root_cause
from tuner.records import Capacity, LaunchFailure

# The searchable flags, in command-line order, in llama-server's words. Their vLLM counterparts:
#   ctx_size ~ max_model_len, but for all slots together: without --kv-unified each of the
#     `parallel` slots gets ctx_size / parallel tokens, so that is the longest request;
#   parallel ~ max_num_seqs (requests decoded at once; the rest wait);
#   batch_size ~ max_num_batched_tokens (tokens per decode call);
#   gpu_memory_utilization has no counterpart: llama.cpp allocates the KV cache ctx_size asks for
#     and fails if it does not fit; it never sizes the cache from a memory share.
_CPU_FLAGS: tuple[Flag, ...] = (
    Flag("ctx_size", "int", "-c", default=None, memory="demand", speed="size", low=1, required=True,
         hand_tuned=4096, help="KV cache size in tokens, shared by all slots (0 = the model's context)",
         aliases=("--ctx-size",)),
    Flag("parallel", "int", "-np", default=1, speed="slots", low=1, required=True, hand_tuned=4,
         help="slots: requests decoded at once; each gets ctx_size / parallel tokens unless kv_unified",
         aliases=("--parallel",)),
    Flag("kv_unified", "bool", "--kv-unified", default=False, memory="equal", hand_tuned=False,
         help="one KV cache shared by all slots, so one request may use all of ctx_size",
         aliases=("-kvu",)),
    Flag("batch_size", "int", "-b", default=2048, memory="equal", low=1, hand_tuned=2048,
         help="most tokens in one decode call (prompt processing)", aliases=("--batch-size",)),
)
_GPU_FLAGS: tuple[Flag, ...] = (
    Flag("n_gpu_layers", "int", "-ngl", default=None, memory="supply", low=0, hand_tuned=None,
         help="layers offloaded to the GPU (-1: all); only in a GPU build",
         aliases=("--n-gpu-layers", "--gpu-layers")),
)

# llama-server's /metrics (with --metrics); a gauge per server, counters since start.
SERVER_GAUGES = ("llamacpp:requests_processing", "llamacpp:requests_deferred",
                 "llamacpp:n_busy_slots_per_decode")
SERVER_COUNTERS = ("llamacpp:prompt_tokens_total", "llamacpp:tokens_predicted_total",
                   "llamacpp:n_decode_total", "llamacpp:prompt_seconds_total",
                   "llamacpp:tokens_predicted_seconds_total")

# /tokenize takes `content` and `add_special` and answers `tokens` only; /detokenize answers `content`.
TOKENIZER_API = TokenizerApi(text_key="content", special_key="add_special", count_key="",
                             detokenized_key="content", chat_messages=False,
                             special_by_default=False, out_of_range_5xx=True)

# Failure texts, first match wins. Written against llama.cpp's own messages (src/llama-*.cpp,
# tools/server/server.cpp, ggml-backend.cpp) as the xllamacpp build prints them.
_FAILURES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("kv_cache_too_small", re.compile(r"failed to allocate buffer for kv cache|"
                                      r"llama_kv_cache\w*: failed to allocate|"
                                      r"failed to initialize the context: .*kv", re.I)),
    ("oom", re.compile(r"cudaMalloc failed: out of memory|out of memory|"
                       r"failed to allocate \w+ buffer of size|"
                       r"ggml_backend_\w+_buffer_type_alloc_buffer: failed to allocate|"
                       r"std::bad_alloc|Cannot allocate memory")),
    ("model_load", re.compile(r"llama_model_load: error loading model.*|error loading model|"
                              r"failed to load model|exiting due to model loading error|"
                              r"gguf_init_from_\w+: failed|unknown model architecture")),
    ("port_in_use", re.compile(r"couldn't bind HTTP server socket|Address already in use|"
                               r"exiting due to HTTP server error|\[Errno 98\]")),
    ("crashed", re.compile(r"^error: .*$|failed to start the server", re.M)),
)
_BUFFER = re.compile(r"of size\s*(\d+)")
_KV_BUFFER = re.compile(r"KV buffer size\s*=\s*([\d.]+)\s*MiB")
_MODEL_BUFFER = re.compile(r"model buffer size\s*=\s*([\d.]+)\s*MiB")
# "load_model: initializing, n_slots = 2, n_ctx_slot = 1024, kv_unified = 'false'"
_SLOTS = re.compile(r"n_slots\s*=\s*(\d+),\s*n_ctx_slot\s*=\s*(\d+),\s*kv_unified\s*=\s*'?(\w+)")


def classify(log_text: str) -> LaunchFailure | None:
    """The failure a llama-server log shows, or None."""
    for kind, regex in _FAILURES:
        found = regex.search(log_text)
        if found is None:
            continue
        needed = None
        line = line_at(log_text, found.start())
        if (size := _BUFFER.search(line)) is not None:
            needed = int(size[1]) / 2**30
        return LaunchFailure(kind=kind, message=root_cause(log_text) if kind == "crashed" and root_cause(log_text)
                             else line, needed_gib=needed, log_tail=log_tail(log_text))
    return None


def parse_capacity(log_text: str, metrics_text: str = "", ready_s: float = 0.0) -> Capacity:
    """Capacity facts from llama.cpp's load log: KV and weight buffers, cells, slots."""
    def total_mib(regex) -> float | None:
        sizes = [float(x) for x in regex.findall(log_text)]
        return sum(sizes) / 1024 if sizes else None

    slots = _SLOTS.findall(log_text)
    n_slots, n_ctx_slot, unified = (int(slots[-1][0]), int(slots[-1][1]), slots[-1][2]) if slots else (None, None, "")
    # unified: one pool of n_ctx_slot cells shared by the slots; else one pool per slot
    kv_tokens = n_ctx_slot if unified == "true" else (n_slots * n_ctx_slot if slots else None)
    return Capacity(weights_gib=total_mib(_MODEL_BUFFER), kv_cache_gib=total_mib(_KV_BUFFER),
                    kv_cache_tokens=kv_tokens, max_concurrency=float(n_slots) if n_slots else None,
                    ready_s=ready_s,
                    cache_config=(("kv_unified", unified), ("n_ctx_slot", str(n_ctx_slot)),
                                  ("n_slots", str(n_slots))) if slots else ())


@functools.lru_cache(maxsize=1)
def has_gpu_build() -> bool:
    """Whether the installed llama.cpp build sees a GPU (only then is -ngl searchable)."""
    try:
        import xllamacpp
    except ImportError:
        return False
    try:
        return any(str(d.get("type", "")).endswith("GPU") for d in xllamacpp.get_device_info())
    except Exception:  # noqa: BLE001 - a build that cannot list devices offloads nothing
        return False


class LlamaCpp:
    """llama.cpp's `llama-server` (OpenAI-compatible /v1/completions, /health, /tokenize, /metrics)."""

    name = "llamacpp"
    label = "llama.cpp"
    # /health is 503 while the model loads and 200 once slots are idle
    readiness_paths = ("/health", "/v1/models")
    server_gauges = SERVER_GAUGES
    server_counters = SERVER_COUNTERS
    metric_prefix = "llamacpp:"
    # no preemption, KV usage or latency histograms on its /metrics: those figures stay None
    metric_names = {"requests_waiting": "llamacpp:requests_deferred",
                    # counters of decoded tokens and of the seconds spent decoding them
                    "decode_tokens": "llamacpp:tokens_predicted_total",
                    "decode_seconds": "llamacpp:tokens_predicted_seconds_total"}
    tokenizer_api = TOKENIZER_API
    keep_alive = False   # a connection serves more than one streamed request
    api_key_env = "LLAMA_API_KEY"

    @property
    def flags(self) -> tuple[Flag, ...]:
        return _CPU_FLAGS + (_GPU_FLAGS if has_gpu_build() else ())

    def default_cmd(self) -> tuple[str, ...]:
        """`llama-server` when one is on PATH, else the one the xllamacpp wheel embeds."""
        import shutil

        found = shutil.which("llama-server")
        if found and not os.environ.get("TUNER_LLAMACPP_EMBEDDED"):
            return (found,)
        return (sys.executable, "-m", "tuner.engines.llamacpp_server")

    def served_model(self, model: str) -> str:
        """A .gguf as it is; a model folder's own .gguf; else a GGUF with random weights written for it."""
        path = Path(model)
        if path.suffix == ".gguf" or not path.is_dir():
            return model
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs:
            return str(ggufs[0])
        from tuner.engines.llamacpp_gguf import gguf_for

        return str(gguf_for(path))

    def argv(self, engine_cmd, model, flag_values, extra_args, host, port) -> list[str]:
        return [*engine_cmd, "-m", self.served_model(model), *flag_argv(self.flags, flag_values),
                *extra_args, "--metrics", "--host", host, "--port", str(port)]

    request_context_name = "ctx_size per slot"
    export_cmd = ("llama-server", "-m")   # the model follows: argv[2], as in `vllm serve MODEL`
    default_port = 8080

    def split_command(self, tokens: list[str]) -> tuple[str, list[str]] | None:
        """(model, the flags after it) of a trial's argv: `... -m MODEL FLAGS`; None without -m."""
        if "-m" not in tokens[:-1]:
            return None
        i = len(tokens) - 1 - tokens[::-1].index("-m")   # the last: `python -m MODULE -m MODEL`
        return tokens[i + 1], [t for t in tokens[i + 2:] if t != "--metrics"]

    def exported_model(self, model: str) -> tuple[str, str]:
        """The model for an exported command and a note: a GGUF of random weights the tuner wrote
        stands for no real model (MODEL), a real GGUF is itself."""
        from tuner.engines.llamacpp_gguf import cache_dir

        if Path(model).parent == cache_dir():
            return "MODEL", ("MODEL: the trials served a GGUF of random weights written for the "
                             f"model's shape ({Path(model).name}); put the path of a real GGUF there")
        return model, ""

    def request_context(self, values: dict) -> int | None:
        """A slot's context: ctx_size / parallel, or all of ctx_size with --kv-unified. llama.cpp
        refuses a longer prompt (HTTP 400, exceed_context_size_error) and cuts a longer output."""
        ctx = values.get("ctx_size")
        if not ctx:
            return None
        if values.get("kv_unified"):
            return ctx
        # llama.cpp rounds a slot up to at least 256 cells (-c 256 -np 2 serves 2 x 256)
        return max(ctx // (values.get("parallel") or 1), min(ctx, 256))

    def fixed_output(self, output_tokens: int) -> dict:
        """llama.cpp stops at max_tokens (its n_predict) and, with ignore_eos, nowhere before."""
        return {"ignore_eos": True}

    def env(self) -> dict[str, str]:
        return {}

    def version(self) -> str:
        try:
            return "xllamacpp " + importlib.metadata.version("xllamacpp")
        except importlib.metadata.PackageNotFoundError:
            return ""

    def classify(self, log_text: str):
        return classify(log_text)

    def parse_capacity(self, log_text: str, metrics_text: str = "", ready_s: float = 0.0):
        return parse_capacity(log_text, metrics_text, ready_s)

    def launch_phases(self, log_text: str) -> dict[str, float]:
        return {}   # no parser of llama-server's load timings yet

    def read_defaults(self, engine_cmd, model, extra_args, env=None) -> dict | None:
        return None   # each flag's `default` is llama-server's own (ctx_size: the model's)

    def budget_batch_defaults(self, budget_gib: float, platform) -> dict:
        return {}   # llama-server's batch defaults do not depend on the device's memory

    def memory_model(self, model_dir: str, device_memory_bytes: int, platform: str,
                     extra_args=(), device_name: str = ""):
        return None


ENGINE = LlamaCpp()
