"""Pure metric functions over RequestResults: percentiles, TTFT/TPOT/ITL/E2E, throughput, goodput."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from tuner.records import LevelMetrics, LoadMetrics  # noqa: F401  (moved; still importable here)


def _sample_name(role: str) -> str:
    """The engine's /metrics name of a quantity ("" when it exports none: the figure is None)."""
    from tuner import engines

    return engines.get().metric_names.get(role, "")


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


# Content chunks closer than this came out of one read: no engine streams one request's tokens
# 10,000 a second, so such a stream was buffered (a starved client on a busy CPU, a proxy) and
# its arrival times do not time decoding.
COALESCED_GAP_S = 1e-4


def coalesced(r) -> bool:
    """Whether most of a request's content chunks arrived together (its decode cannot be timed)."""
    gaps = r.itl_s
    return bool(gaps) and sum(1 for g in gaps if g < COALESCED_GAP_S) > len(gaps) / 2


def decode_tok_s(r) -> float | None:
    """One request's decode rate: (output_tokens - 1) / (latency - ttft); None for a stream whose
    chunks arrived together (`coalesced`)."""
    if not r.ok or r.ttft_s is None or r.output_tokens < 2 or r.latency_s <= r.ttft_s:
        return None
    if coalesced(r):
        return None
    return (r.output_tokens - 1) / (r.latency_s - r.ttft_s)


NO_LEVEL_MEETS = "none meets the SLOs"   # throughput_level when [slo] is set and no level meets it


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


def chunk_times(r) -> list[float]:
    """Arrival times of a request's content chunks, relative to its level's start."""
    if not r.ok or r.ttft_s is None:
        return []
    t = r.start_s - r.queued_s + r.ttft_s
    times = [t]
    for gap in r.itl_s:
        t += gap
        times.append(t)
    return times


def steady_window(requests: Sequence, concurrency: int) -> tuple[float, float] | None:
    """(start, end) of a level's steady state, or None when it has none.

    Closed loop keeps `concurrency` requests in flight from the first completion (the ramp-up is
    over: the first wave is decoding and the next request has been sent) until the last request is
    sent (after that the loop drains). A level shorter than two waves has no such window.

    Nor has a level whose window is shorter than half a request's decode (the median of latency
    minus TTFT): its requests ran in lockstep waves (as many slots as users, all sent together,
    all done together), and the window between the first completion and the last send is the
    tail of one wave, which times the slots' phase, not the load. One 32B c16 level at 16 slots
    read 179 tok/s over such a 0.17 s window, against 75 tok/s over its 13.6 s and at most 95
    (16 streams at their own 5.9 tok/s).
    """
    ok = [r for r in requests if r.ok and r.ttft_s is not None]
    if len(requests) < 2 * concurrency or not ok:
        return None
    start = min(r.start_s - r.queued_s + r.latency_s for r in ok)
    end = max(r.start_s for r in requests)
    decode = percentile([r.latency_s - r.ttft_s for r in ok], 50) or 0.0
    if end <= start or end - start < decode / 2:
        return None
    return start, end


def steady_ttfts(ok: Sequence, window: tuple[float, float] | None) -> list[float]:
    """The TTFTs of the requests sent (open loop: scheduled) inside a level's steady window: in
    closed loop the first wave, sent together at the level's start, queues behind its own burst of
    prefills, a transient of the loop's start rather than of the load. All of them without a window."""
    if window is None:
        return [r.ttft_s for r in ok]
    start, end = window
    return [r.ttft_s for r in ok if start <= r.start_s - r.queued_s <= end]


def window_rate(requests: Iterable, start: float, end: float) -> float:
    """Output tok/s from content chunks arriving in [start, end), each weighted by usage / chunks."""
    tokens = 0.0
    for r in requests:
        times = chunk_times(r)
        if not times:
            continue
        weight = r.output_tokens / len(times)
        tokens += weight * sum(1 for t in times if start <= t < end)
    return tokens / (end - start)


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


def level_metrics(phase, workload) -> LevelMetrics:
    """The figures of one level (a phase of the load test)."""
    ok = [r for r in phase.requests if r.ok and r.ttft_s is not None]
    ttft = [r.ttft_s for r in ok]
    tpot = [x for x in map(tpot_s, ok) if x is not None]
    itl = [g for r in ok for g in r.itl_s]
    e2e = [r.latency_s for r in ok]
    tokens = sum(r.output_tokens for r in ok)
    wall = phase.wall_s
    out: dict = {"name": phase.name, "concurrency": phase.concurrency,
                 "request_rate": phase.request_rate, "requests": len(phase.requests),
                 "failed": len(phase.requests) - len([r for r in phase.requests if r.ok]),
                 "output_tokens": tokens, "wall_s": wall,
                 "failure": failure_reason(phase, workload.max_failed_share)}
    window = None
    if wall > 0 and ok:
        out["throughput_tok_s_wall"] = tokens / wall
        out["requests_per_s"] = len(ok) / wall
        out["goodput_req_s"] = sum(1 for r in ok if meets_slos(r, workload)) / wall
        if sum(1 for r in ok if coalesced(r)) > len(ok) / 2:
            # most streams arrived in one read each (a client starved of CPU): their chunk times
            # and completions bunch into bursts, so a window between two of them times nothing
            # and the level is rated over its wall clock. One such c16 level of llama.cpp read
            # 80,894 tok/s over a 6 ms window against 3,018 tok/s over its wall clock, and went
            # to the front with it.
            window = None
        elif phase.request_rate is None and phase.concurrency > 1:
            window = steady_window(phase.requests, phase.concurrency)
        elif phase.request_rate is not None and len(ok) >= 4:
            # open loop: from the first completion to the last arrival
            end = max(r.start_s - r.queued_s for r in phase.requests)
            start = min(r.start_s - r.queued_s + r.latency_s for r in ok)
            window = (start, end) if end > start else None
        if window is not None:
            out.update(window_start_s=window[0], window_end_s=window[1], steady=True,
                       throughput_tok_s=window_rate(ok, *window))
        else:
            out["throughput_tok_s"] = tokens / wall
    rates = [x for x in map(decode_tok_s, ok) if x is not None]
    out["decode_tok_s"] = percentile(rates, 50)
    out["ttft_ms_all"] = _ms(percentile(ttft, 50))
    ttft = steady_ttfts(ok, window)
    out["ttft_requests"] = len(ttft)
    for name, vals in (("ttft_ms", ttft), ("tpot_ms", tpot), ("itl_ms", itl), ("e2e_ms", e2e)):
        out[name] = _ms(percentile(vals, 50))
        out[name + "_p90"] = _ms(percentile(vals, 90))
    out["ttft_ms_p99"] = _ms(percentile(ttft, 99))
    out["ttft_ms_mean"] = _ms(mean(ttft))
    if any(v is not None for v in (workload.slo_ttft_ms, workload.slo_tpot_ms, workload.slo_e2e_ms)):
        out["meets_slos"] = bool(ok) and not out["failure"] and all(
            slo is None or got is None or got <= slo
            for slo, got in ((workload.slo_ttft_ms, out["ttft_ms_p90"]),
                             (workload.slo_tpot_ms, out["tpot_ms_p90"]),
                             (workload.slo_e2e_ms, out["e2e_ms_p90"])))
    out["preemptions"] = _delta(phase, _sample_name("preemptions"))
    if phase.server_metrics_peak:  # only sampled while the level ran when polling is on
        out["kv_cache_usage_max"] = _peak(phase, _sample_name("kv_cache_usage"))
        out["num_requests_waiting_max"] = _peak(phase, _sample_name("requests_waiting"))
    out["server_ttft_ms_mean"] = _hist_mean_ms(phase, _sample_name("ttft_seconds"))
    return LevelMetrics(**out)


def summarize(phases, workload) -> LoadMetrics:
    """LoadMetrics from the phases of one load test (warm-up excluded)."""
    measured_phases = [p for p in phases if p.name != "warmup"]
    by_name = {p.name: p for p in measured_phases}
    single = by_name.get("single_stream")
    levels = tuple(level_metrics(p, workload) for p in measured_phases)
    out: dict = {"levels": levels}

    reasons = [lv.failure for lv in levels]
    out["load_test_failed"] = "; ".join(r for r in reasons if r)
    measured = [r for p in measured_phases for r in p.requests]
    failed = [r for r in measured if not r.ok]
    out["requests_sent"] = len(measured)
    out["requests_failed"] = len(failed)
    out["rejected_for_length"] = sum(1 for r in failed if r.error_kind == "rejected_for_length")
    out["error_rate"] = len(failed) / len(measured) if measured else 0.0
    kinds: dict[str, int] = {}
    messages: dict[str, int] = {}
    for r in (r for p in phases for r in p.requests if not r.ok):
        kinds[r.error_kind] = kinds.get(r.error_kind, 0) + 1
        key = f"{r.error_kind}: {r.error}"[:200]
        messages[key] = messages.get(key, 0) + 1
    out["error_kinds"] = ",".join(f"{k}:{v}" for k, v in sorted(kinds.items()))
    if messages:
        out["top_error"] = max(messages.items(), key=lambda kv: kv[1])[0]
    preempt = [lv.preemptions for lv in levels if lv.preemptions is not None]
    out["preemptions"] = sum(preempt) if preempt else None
    kv = [lv.kv_cache_usage_max for lv in levels if lv.kv_cache_usage_max is not None]
    out["kv_cache_usage_max"] = max(kv) if kv else None

    if single is not None:
        rates = [x for x in map(decode_tok_s, single.requests) if x is not None]
        out["single_stream_tok_s"] = percentile(rates, 50)
        out["single_stream_tok_s_spread"] = iqr(rates)
        out["single_stream_source"] = "client"
        if not rates:
            # Every stream arrived together (a starved client on a busy CPU sees this), so the
            # client cannot time decoding; the server's own inter-token histogram over the phase can.
            itl_ms = _hist_mean_ms(single, _sample_name("itl_seconds"))
            tokens = _delta(single, _sample_name("decode_tokens"))
            seconds = _delta(single, _sample_name("decode_seconds"))
            if itl_ms:
                out["single_stream_tok_s"] = 1e3 / itl_ms
                out["single_stream_source"] = "server_itl"
            elif tokens and seconds:
                # an engine without an ITL histogram (llama.cpp) counts decoded tokens and the
                # seconds spent decoding them, which time each request's tokens after its first
                # (llama.cpp's predicted_per_token_ms is predicted_ms / (n - 1)): at concurrency 1,
                # (tokens - requests) / seconds is the decode rate
                served = sum(1 for r in single.requests if r.ok)
                out["single_stream_tok_s"] = max(tokens - served, 0) / seconds
                out["single_stream_source"] = "server_decode"
            elif any(coalesced(r) for r in single.requests if r.ok):
                out["single_stream_source"] = "untimed"   # said in the trial's failure message
        out["single_stream_ttft_ms"] = _ms(percentile(
            [r.ttft_s for r in single.requests if r.ok and r.ttft_s is not None], 50))

    loaded = [lv for lv in levels if lv.name != "single_stream"] or list(levels)
    closed = [lv for lv in loaded if lv.request_rate is None] or loaded
    if not closed:
        return LoadMetrics(**out)
    top = max(closed, key=lambda lv: lv.concurrency)
    thr_level = top
    slo_set = any(v is not None for v in (workload.slo_ttft_ms, workload.slo_tpot_ms,
                                           workload.slo_e2e_ms))
    if slo_set:
        meeting = [lv for lv in levels if lv.request_rate is None and lv.meets_slos]
        thr_level = max(meeting, key=lambda lv: lv.concurrency) if meeting else None
    from tuner.load.plan import ttft_level_name

    wanted = ttft_level_name(workload)
    ttft_lv = next((lv for lv in levels if lv.name == wanted), top)
    out["ttft_level"] = ttft_lv.name
    out["ttft_ms"] = ttft_lv.ttft_ms
    out["ttft_ms_p90"] = ttft_lv.ttft_ms_p90
    out["ttft_ms_p99"] = ttft_lv.ttft_ms_p99
    out["ttft_ms_mean"] = ttft_lv.ttft_ms_mean
    out["ttft_ms_all"] = ttft_lv.ttft_ms_all
    tp = by_name[ttft_lv.name]
    tp_ok = [r for r in tp.requests if r.ok and r.ttft_s is not None]
    window = (ttft_lv.window_start_s, ttft_lv.window_end_s) if ttft_lv.window_start_s is not None else None
    out["ttft_ms_spread"] = _ms(iqr(steady_ttfts(tp_ok, window)))
    if thr_level is None:  # SLOs set and no level meets them: no goodput at all
        out["throughput_level"] = NO_LEVEL_MEETS
        out["throughput_tok_s"] = 0.0
        thr_level = top
    else:
        out["throughput_level"] = thr_level.name
        out["throughput_tok_s"] = thr_level.throughput_tok_s
    lv = thr_level
    out.update(throughput_tok_s_wall=lv.throughput_tok_s_wall, concurrency=lv.concurrency,
               steady=lv.steady, window_start_s=lv.window_start_s, window_end_s=lv.window_end_s,
               output_tokens_total=lv.output_tokens, throughput_wall_s=lv.wall_s,
               requests_per_s=lv.requests_per_s, goodput_req_s=lv.goodput_req_s,
               num_requests_waiting_max=lv.num_requests_waiting_max,
               server_ttft_ms_mean=lv.server_ttft_ms_mean)
    p = by_name[lv.name]
    ok = [r for r in p.requests if r.ok and r.ttft_s is not None]
    tpot = [x for x in map(tpot_s, ok) if x is not None]
    itl = [g for r in ok for g in r.itl_s]
    e2e = [r.latency_s for r in ok]
    for name, vals in (("tpot_ms", tpot), ("itl_ms", itl), ("e2e_ms", e2e)):
        out[name] = _ms(percentile(vals, 50))
        out[name + "_p90"] = _ms(percentile(vals, 90))
        out[name + "_p99"] = _ms(percentile(vals, 99))
        out[name + "_mean"] = _ms(mean(vals))
    out["server_itl_ms_mean"] = _hist_mean_ms(p, _sample_name("itl_seconds"))
    return LoadMetrics(**out)
