"""SGLang's log: the failure texts that classify a launch, the capacity and launch phases of a ready server.

Every pattern quotes a message of SGLang 0.5.x's own source (sgl-project/sglang, python/sglang/srt/):
    managers/scheduler.py         "max_total_num_tokens=N, chunked_prefill_size=N, max_prefill_tokens=N,
                                   max_running_requests=N, context_len=N, available_gpu_mem=X GB"
                                  "Scheduler hit an exception: <traceback>"
    model_executor/model_runner.py (the pool check moved into the memory-pool config in later 0.5.x)
                                  "Load weight end. elapsed=X s, type=..., avail mem=X GB, mem usage=X GB."
                                  "Not enough memory. Please try to increase --mem-fraction-static."
                                  "Capture cuda graph end. Time elapsed: X s. mem usage=X GB. avail mem=X GB."
    mem_cache/memory_pool.py      "KV Cache is allocated. #tokens: N, K size: X GB, V size: X GB"
    configs/model_config.py       "User-specified context_length (N) is greater than the derived context_length
                                   (N). ... To allow overriding this maximum, set the env var
                                   SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1"
    model_loader/weight_utils.py  "Cannot find any model weights with `PATH`"
    entrypoints/engine.py         "Received sigquit from a child process. It usually means the child failed."
SGLang's "GB" is 2**30 bytes (its `GB = 1 << 30`), so the figures are GiB. Tested on logs assembled from
these texts (tests/data/sglang/), not on a run: there is no SGLang install here.
"""

from __future__ import annotations

import re

from tuner.engines.base import line_at, log_tail, root_cause
from tuner.records import Capacity, LaunchFailure

# Failure texts, first match wins (the specific cause before the wrappers that follow it).
_FAILURES: tuple[tuple[str, re.Pattern[str]], ...] = (
    # the KV pool got <= 0 tokens: the weights (and activations) took all of mem_fraction_static;
    # vLLM's "No available memory for the cache blocks"
    ("no_cache_blocks", re.compile(r"Not enough memory\. Please try to increase --mem-fraction-static\.?"
                                   r"(?: Current value: mem_fraction_static=(?P<mfs>[\d.]+))?")),
    ("oom", re.compile(r"(?:CUDA|HIP) out of memory|OutOfMemoryError\b|CUDA error: out of memory")),
    # only the raised form: the same sentence as a WARNING (override allowed) is a server that serves
    ("context_too_long", re.compile(
        r"context_length \((?P<asked>\d+)\) is greater than the derived context_length \((?P<derived>\d+)\)"
        r".*To allow overriding this maximum")),
    ("model_load", re.compile(r"Cannot find any model weights with|"
                              r"does not appear to have a file named config\.json|"
                              r"Can't load the configuration of|"
                              r"Model architectures \[[^\]]*\] are not supported")),
    ("port_in_use", re.compile(r"Address already in use|\[Errno 98\]|"
                               r"error while attempting to bind on address")),
)
# Lines after which SGLang will not become ready though no pattern above names the cause.
_FATAL_MARKERS = re.compile(r"Scheduler hit an exception|Received sigquit from a child process|"
                            r"Initialization failed\. Please see the error messages above")
_TORCH_OOM_NEEDED = re.compile(r"Tried to allocate\s*([\d.,]+)\s*(GiB|MiB)")
_TORCH_OOM_FREE = re.compile(r"of which\s*([\d.,]+)\s*(GiB|MiB)\s*is free")


def _gib(value: str, unit: str) -> float:
    return float(value.replace(",", "")) / (1024.0 if unit == "MiB" else 1.0)


def classify(log_text: str) -> LaunchFailure | None:
    """The failure an SGLang log shows, or None."""
    for kind, regex in _FAILURES:
        found = regex.search(log_text)
        if found is None:
            continue
        needed = available = estimated = None
        if kind == "oom":
            after = log_text[found.start():found.start() + 2000]   # torch's message spans lines
            if (m := _TORCH_OOM_NEEDED.search(after)) is not None:
                needed = _gib(m[1], m[2])
            if (m := _TORCH_OOM_FREE.search(after)) is not None:
                available = _gib(m[1], m[2])
        elif kind == "context_too_long":
            estimated = int(found["derived"])   # the longest context the model's config allows
        return LaunchFailure(kind=kind, message=line_at(log_text, found.start()), needed_gib=needed,
                             available_gib=available, estimated_max_model_len=estimated,
                             log_tail=log_tail(log_text))
    marker = _FATAL_MARKERS.search(log_text)
    if marker is not None:
        return LaunchFailure(kind="crashed", message=root_cause(log_text) or line_at(log_text, marker.start()),
                             log_tail=log_tail(log_text))
    return None


# ---------------------------------------------------------------- capacity

_SCHEDULER = re.compile(r"max_total_num_tokens=(?P<tokens>\d+), (?:chunked_prefill_size=(?P<chunk>-?\w+), )?"
                        r"max_prefill_tokens=(?P<prefill>\d+), max_running_requests=(?P<running>\d+), "
                        r"context_len=(?P<context>\d+)"
                        r"(?:, available_(?:gpu|cpu)_mem=(?P<avail>[\d.]+) GB)?")
_WEIGHTS = re.compile(r"Load weight end\..*?mem usage=([\d.]+) GB")
# older pools log K and V apart, MLA pools one "KV size"; newer ones add "dtype: ..., " first
_KV = re.compile(r"KV Cache is allocated\.(?: dtype: [^,]+,)? #tokens: (?P<tokens>\d+), "
                 r"(?:K size: (?P<k>[\d.]+) GB, V size: (?P<v>[\d.]+) GB|KV size: (?P<kv>[\d.]+) GB)")


def parse_capacity(log_text: str, metrics_text: str = "", ready_s: float = 0.0) -> Capacity:
    """Capacity facts from SGLang's load log: weights, KV pool size in GiB and tokens, request slots."""
    weights = _WEIGHTS.findall(log_text)
    kv = list(_KV.finditer(log_text))
    sched = list(_SCHEDULER.finditer(log_text))
    kv_gib = None
    if kv:
        m = kv[-1]
        kv_gib = float(m["kv"]) if m["kv"] else float(m["k"]) + float(m["v"])
    tokens = int(sched[-1]["tokens"]) if sched else (int(kv[-1]["tokens"]) if kv else None)
    cache_config: tuple[tuple[str, str], ...] = ()
    concurrency = None
    if sched:
        s = sched[-1]
        # as vLLM's "Maximum concurrency for N tokens per request": pool tokens over the context
        concurrency = round(int(s["tokens"]) / int(s["context"]), 2)
        cache_config = tuple((k, v) for k, v in (
            ("available_gpu_mem_gib", s["avail"] or ""), ("chunked_prefill_size", s["chunk"] or ""),
            ("context_len", s["context"]), ("max_prefill_tokens", s["prefill"]),
            ("max_running_requests", s["running"]), ("max_total_num_tokens", s["tokens"])) if v)
    return Capacity(weights_gib=float(weights[-1]) if weights else None, kv_cache_gib=kv_gib,
                    kv_cache_tokens=tokens, max_concurrency=concurrency, ready_s=ready_s,
                    cache_config=cache_config)


# ---------------------------------------------------------------- launch phases

_PHASE_WEIGHTS = re.compile(r"Load weight end\. elapsed=([\d.]+) s")
_PHASE_GRAPHS = re.compile(r"Capture (?:cuda|npu) graph end\. Time elapsed: ([\d.]+) s")


def launch_phases(log_text: str) -> dict[str, float]:
    """Seconds of the launch phases SGLang's log names: weights, graphs (no compile or profile line)."""
    out = {}
    for key, regex in (("weights", _PHASE_WEIGHTS), ("graphs", _PHASE_GRAPHS)):
        if (m := regex.search(log_text)) is not None:
            out[key] = round(float(m[1]), 3)
    return out
