"""Pure metric functions over RequestResults: percentiles, TTFT/TPOT/ITL/E2E, throughput, goodput."""

from __future__ import annotations

from dataclasses import dataclass

# SKELETON (owner: loadgen helper). Interfaces below are the contract used by study.py.


@dataclass(frozen=True)
class LoadMetrics:
    """Everything a trial's load test measured, flat, ready for Optuna user attrs and CSV columns.

    Spreads are the interquartile range over per-request values (same unit as the figure).
    """

    single_stream_tok_s: float | None = None
    single_stream_tok_s_spread: float | None = None
    throughput_tok_s: float | None = None
    throughput_tok_s_spread: float | None = None
    ttft_ms: float | None = None          # p50 in the throughput phase
    ttft_ms_spread: float | None = None
    ttft_ms_p90: float | None = None
    ttft_ms_p99: float | None = None
    ttft_ms_mean: float | None = None
    single_stream_ttft_ms: float | None = None
    tpot_ms: float | None = None          # p50
    tpot_ms_p90: float | None = None
    tpot_ms_p99: float | None = None
    itl_ms: float | None = None           # p50
    itl_ms_p90: float | None = None
    itl_ms_p99: float | None = None
    e2e_ms: float | None = None           # p50
    e2e_ms_mean: float | None = None
    e2e_ms_p90: float | None = None
    e2e_ms_p99: float | None = None
    requests_per_s: float | None = None
    goodput_req_s: float | None = None
    error_rate: float = 0.0
    concurrency: int | None = None
    preemptions: float | None = None      # vllm:num_preemptions_total delta over the throughput phase
    kv_cache_usage_max: float | None = None
    load_test_failed: str = ""            # "" or the reason a phase failed


def summarize(phases, workload) -> LoadMetrics:
    """LoadMetrics from the phases of one load test (warm-up excluded)."""
    raise NotImplementedError
