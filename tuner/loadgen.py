"""Async streaming load tests against an OpenAI-compatible vLLM server: one RequestResult per request."""

from __future__ import annotations

from dataclasses import dataclass

# SKELETON (owner: loadgen helper). Interfaces below are the contract used by study.py.


@dataclass(frozen=True)
class Workload:
    """What the load test sends; read from the study file's [workload] table."""

    prompt_tokens: int = 128
    output_tokens: int = 128
    warmup_requests: int = 2
    single_stream_requests: int = 8
    throughput_requests: int = 64
    concurrency: int | None = None       # None: follow the config's max-num-seqs ...
    max_concurrency: int = 64            # ... capped by this
    request_rate: float | None = None    # requests/s for an open-loop Poisson phase; None = closed loop
    request_timeout_s: float = 300.0
    endpoint: str = "completions"        # "completions" | "chat"
    max_failed_share: float = 0.05       # above this a phase marks the trial load_test_failed
    # SLOs for goodput (ms); None = no SLO on that metric
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    slo_e2e_ms: float | None = None


@dataclass(frozen=True)
class RequestResult:
    """One request's outcome. Never an exception: failures are ok=False with a classified error."""

    ok: bool
    status: int | None = None         # HTTP status, None if no response
    error_kind: str = ""              # "" | http_error | connection | timeout | bad_stream | ...
    error: str = ""                   # exception class and message, short
    prompt_tokens: int = 0            # from usage
    output_tokens: int = 0            # from usage
    start_s: float = 0.0              # request start, relative to the phase start
    ttft_s: float | None = None       # request start to first content
    itl_s: tuple[float, ...] = ()     # gaps between content chunks
    latency_s: float = 0.0            # request start to end of stream


@dataclass(frozen=True)
class PhaseResult:
    name: str                         # "warmup" | "single_stream" | "throughput"
    concurrency: int
    wall_s: float
    requests: tuple[RequestResult, ...]
    server_metrics_before: tuple[tuple[str, float], ...] = ()   # selected /metrics samples
    server_metrics_after: tuple[tuple[str, float], ...] = ()


def run_load_test(base_url: str, model: str, workload: Workload, max_num_seqs: int | None,
                  progress: bool = True) -> tuple[PhaseResult, ...]:
    """Warm-up, single-stream and throughput phases against a ready server (synchronous wrapper)."""
    raise NotImplementedError
