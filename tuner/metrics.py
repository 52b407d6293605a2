"""Pure metric functions over RequestResults: percentiles, TTFT/TPOT/ITL/E2E, throughput, goodput."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# Windows the throughput phase is cut into for its spread (see LoadMetrics).
THROUGHPUT_WINDOWS = 8


@dataclass(frozen=True)
class LoadMetrics:
    """Everything a trial's load test measured, flat, ready for Optuna user attrs and CSV columns.

    Definitions (all from the client's clock; warm-up excluded):

    - `single_stream_tok_s`: median over the single-stream requests of the decode rate
      (output_tokens - 1) / (latency - ttft). Spread: IQR of those per-request rates.
    - `throughput_tok_s`: output tokens (from `usage`) of the throughput phase's successful requests /
      the phase's wall time (first request sent to last stream ended). Spread: the phase's wall time
      is cut into 8 equal windows, each window's rate is its content chunks x (usage tokens / content
      chunks); the spread is the IQR of the 8 window rates (ramp-up and drain included, so a phase
      whose rate swings shows it).
    - `ttft_ms`: p50 TTFT of the throughput phase (p90, p99, mean too). Spread: IQR of per-request TTFT.
    - `tpot_ms`: per-request (latency - ttft) / (output_tokens - 1), percentiles over requests.
    - `itl_ms`: every gap between content chunks of every request, percentiles over gaps.
    - `e2e_ms`: request start to its last content chunk.
    - `goodput_req_s`: successful requests meeting every SLO set in the workload / wall time.
    - `error_rate`: failed / sent over single-stream and throughput phases.
    - `preemptions`: increase of vllm:num_preemptions_total over the throughput phase (the KV cache
      ran out at runtime); `kv_cache_usage_max`: the highest vllm:kv_cache_usage_perc seen while it ran.
    - `server_ttft_ms_mean`, `server_itl_ms_mean`: vLLM's own histogram mean over the throughput
      phase (sum delta / count delta), a cross-check of the client's figures.
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
    single_stream_source: str = ""        # "client" | "server_itl" (streams came in one read)
    tpot_ms: float | None = None          # p50
    tpot_ms_p90: float | None = None
    tpot_ms_p99: float | None = None
    tpot_ms_mean: float | None = None
    itl_ms: float | None = None           # p50
    itl_ms_p90: float | None = None
    itl_ms_p99: float | None = None
    itl_ms_mean: float | None = None
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
    # Added beyond the first contract: counts and the server-side cross-check.
    requests_sent: int = 0                # single-stream + throughput phases
    requests_failed: int = 0
    output_tokens_total: int = 0          # throughput phase, from usage
    throughput_wall_s: float | None = None
    num_requests_waiting_max: float | None = None
    server_ttft_ms_mean: float | None = None
    server_itl_ms_mean: float | None = None
    error_kinds: str = ""                 # e.g. "timeout:3,http_error:1" over all phases


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation between order statistics (numpy's default)."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def iqr(values: Sequence[float]) -> float | None:
    """Interquartile range (p75 - p25); None for fewer than two values."""
    if len(values) < 2:
        return None
    return percentile(values, 75) - percentile(values, 25)


def mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def timings_from_arrivals(start: float, arrivals: Sequence[float]) -> tuple[float | None, tuple[float, ...], float]:
    """(ttft, itls, latency) from the request start and each content chunk's arrival time.

    latency ends at the last content chunk, so latency - ttft == sum(itl) holds by construction
    (the same convention as vLLM's benchmark client, which keeps TPOT comparable).
    """
    if not arrivals:
        return None, (), 0.0
    itl = tuple(b - a for a, b in zip(arrivals, arrivals[1:]))
    return arrivals[0] - start, itl, arrivals[-1] - start


def tpot_s(r) -> float | None:
    """Time per output token after the first: (latency - ttft) / (output_tokens - 1)."""
    if not r.ok or r.ttft_s is None or r.output_tokens < 2:
        return None
    return (r.latency_s - r.ttft_s) / (r.output_tokens - 1)


def decode_tok_s(r) -> float | None:
    """One request's decode rate: (output_tokens - 1) / (latency - ttft)."""
    if not r.ok or r.ttft_s is None or r.output_tokens < 2 or r.latency_s <= r.ttft_s:
        return None
    return (r.output_tokens - 1) / (r.latency_s - r.ttft_s)


def meets_slos(r, workload) -> bool:
    """Whether a successful request meets every SLO the workload sets (ms); unset SLOs always pass."""
    if not r.ok or r.ttft_s is None:
        return False
    if workload.slo_ttft_ms is not None and r.ttft_s * 1e3 > workload.slo_ttft_ms:
        return False
    if workload.slo_tpot_ms is not None:
        t = tpot_s(r)
        if t is not None and t * 1e3 > workload.slo_tpot_ms:
            return False
    if workload.slo_e2e_ms is not None and r.latency_s * 1e3 > workload.slo_e2e_ms:
        return False
    return True


def window_rates(requests: Iterable, wall_s: float, windows: int = THROUGHPUT_WINDOWS) -> list[float]:
    """Output tok/s in each of `windows` equal slices of the phase, from content-chunk arrival times.

    Each request's chunks are weighted by usage tokens / chunks, so the rates add up to the usage total.
    """
    if wall_s <= 0 or windows < 1:
        return []
    counts = [0.0] * windows
    width = wall_s / windows
    for r in requests:
        if not r.ok or r.ttft_s is None:
            continue
        weight = r.output_tokens / (len(r.itl_s) + 1)
        t = r.start_s + r.ttft_s
        times = [t]
        for gap in r.itl_s:
            t += gap
            times.append(t)
        for t in times:
            counts[min(max(int(t / width), 0), windows - 1)] += weight
    return [c / width for c in counts]


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1e3


def _metric(samples: Sequence[tuple[str, float]], name: str) -> float | None:
    for k, v in samples:
        if k == name:
            return v
    return None


def _delta(phase, name: str) -> float | None:
    before, after = _metric(phase.server_metrics_before, name), _metric(phase.server_metrics_after, name)
    if before is None or after is None:
        return None
    return after - before


def _hist_mean_ms(phase, base: str) -> float | None:
    s, c = _delta(phase, base + "_sum"), _delta(phase, base + "_count")
    if s is None or not c:
        return None
    return s / c * 1e3


def _peak(phase, name: str) -> float | None:
    values = [v for v in (_metric(getattr(phase, "server_metrics_peak", ()), name),
                          _metric(phase.server_metrics_before, name),
                          _metric(phase.server_metrics_after, name)) if v is not None]
    return max(values) if values else None


def failure_reason(phase, max_failed_share: float) -> str:
    """"" when the phase's failed share is within bounds, else a one-line reason with the first error."""
    n = len(phase.requests)
    failed = [r for r in phase.requests if not r.ok]
    if n == 0 or len(failed) / n <= max_failed_share:
        return ""
    first = failed[0]
    return (f"{phase.name}: {len(failed)}/{n} requests failed "
            f"(first: {first.error_kind}: {first.error})")[:300]


def summarize(phases, workload) -> LoadMetrics:
    """LoadMetrics from the phases of one load test (warm-up excluded)."""
    by_name = {p.name: p for p in phases}
    single = by_name.get("single_stream")
    thr = by_name.get("throughput")
    out: dict = {}

    reasons = [failure_reason(p, workload.max_failed_share) for p in phases if p.name != "warmup"]
    out["load_test_failed"] = "; ".join(r for r in reasons if r)
    measured = [r for p in phases if p.name != "warmup" for r in p.requests]
    failed = [r for r in measured if not r.ok]
    out["requests_sent"] = len(measured)
    out["requests_failed"] = len(failed)
    out["error_rate"] = len(failed) / len(measured) if measured else 0.0
    kinds: dict[str, int] = {}
    for r in (r for p in phases for r in p.requests if not r.ok):
        kinds[r.error_kind] = kinds.get(r.error_kind, 0) + 1
    out["error_kinds"] = ",".join(f"{k}:{v}" for k, v in sorted(kinds.items()))

    if single is not None:
        rates = [x for x in map(decode_tok_s, single.requests) if x is not None]
        out["single_stream_tok_s"] = percentile(rates, 50)
        out["single_stream_tok_s_spread"] = iqr(rates)
        out["single_stream_source"] = "client"
        if not rates:
            # Every stream arrived in one read (a starved client on a busy CPU sees this), so the
            # client cannot time decoding; the server's own inter-token histogram over the phase can.
            itl_ms = _hist_mean_ms(single, "vllm:inter_token_latency_seconds")
            if itl_ms:
                out["single_stream_tok_s"] = 1e3 / itl_ms
                out["single_stream_source"] = "server_itl"
        out["single_stream_ttft_ms"] = _ms(percentile(
            [r.ttft_s for r in single.requests if r.ok and r.ttft_s is not None], 50))

    if thr is not None:
        ok = [r for r in thr.requests if r.ok and r.ttft_s is not None]
        ttft = [r.ttft_s for r in ok]
        tpot = [x for x in map(tpot_s, ok) if x is not None]
        itl = [g for r in ok for g in r.itl_s]
        e2e = [r.latency_s for r in ok]
        tokens = sum(r.output_tokens for r in ok)
        wall = thr.wall_s
        out["concurrency"] = thr.concurrency
        out["output_tokens_total"] = tokens
        out["throughput_wall_s"] = wall
        if wall > 0 and ok:
            out["throughput_tok_s"] = tokens / wall
            out["throughput_tok_s_spread"] = iqr(window_rates(ok, wall))
            out["requests_per_s"] = len(ok) / wall
            out["goodput_req_s"] = sum(1 for r in ok if meets_slos(r, workload)) / wall
        for name, vals in (("ttft_ms", ttft), ("tpot_ms", tpot), ("itl_ms", itl), ("e2e_ms", e2e)):
            out[name] = _ms(percentile(vals, 50))
            out[name + "_p90"] = _ms(percentile(vals, 90))
            out[name + "_p99"] = _ms(percentile(vals, 99))
            out[name + "_mean"] = _ms(mean(vals))
        out["ttft_ms_spread"] = _ms(iqr(ttft))
        out["preemptions"] = _delta(thr, "vllm:num_preemptions_total")
        out["kv_cache_usage_max"] = _peak(thr, "vllm:kv_cache_usage_perc")
        out["num_requests_waiting_max"] = _peak(thr, "vllm:num_requests_waiting")
        out["server_ttft_ms_mean"] = _hist_mean_ms(thr, "vllm:time_to_first_token_seconds")
        out["server_itl_ms_mean"] = _hist_mean_ms(thr, "vllm:inter_token_latency_seconds")
    return LoadMetrics(**out)
