"""Timing maths and objectives, pinned with scripted times and hand-built RequestResults."""

from __future__ import annotations

import pytest

from tuner.load.client import PhaseResult, RequestResult, Workload
from tuner.load.metrics import (LoadMetrics, decode_tok_s, failure_reason, iqr, meets_slos, percentile,
                           steady_window, summarize, timings_from_arrivals, tpot_s,
                           window_rate)


def req(ttft: float, itl: tuple[float, ...], out: int | None = None, start: float = 0.0,
        ok: bool = True, kind: str = "") -> RequestResult:
    """A request whose latency obeys the invariant latency - ttft == sum(itl)."""
    return RequestResult(ok=ok, status=200 if ok else 500, error_kind=kind, error="X: y" if kind else "",
                         prompt_tokens=10, output_tokens=len(itl) + 1 if out is None else out,
                         start_s=start, ttft_s=ttft, itl_s=itl, latency_s=ttft + sum(itl))


def test_timings_from_a_scripted_clock_keep_the_invariant():
    # binary fractions, so the arithmetic is exact
    start, arrivals = 10.0, [10.25, 10.5, 10.75, 11.5]
    ttft, itl, latency = timings_from_arrivals(start, arrivals)
    assert ttft == 0.25
    assert itl == (0.25, 0.25, 0.75)
    assert latency == 1.5
    assert latency - ttft == sum(itl)
    assert timings_from_arrivals(1.0, []) == (None, (), 0.0)
    assert timings_from_arrivals(1.0, [1.5]) == (0.5, (), 0.5)


def test_percentile_interpolates_like_numpy():
    v = [15.0, 20.0, 35.0, 40.0, 50.0]
    assert percentile(v, 50) == 35.0
    assert percentile(v, 0) == 15.0 and percentile(v, 100) == 50.0
    assert percentile(v, 40) == pytest.approx(29.0)        # numpy.percentile(v, 40)
    assert percentile(v, 90) == pytest.approx(46.0)
    assert percentile(list(range(1, 101)), 99) == pytest.approx(99.01)
    assert percentile([], 50) is None
    assert iqr([1.0, 2.0, 3.0, 4.0, 5.0]) == 2.0
    assert iqr([1.0]) is None


def test_tpot_and_decode_rate():
    r = req(0.5, (0.25, 0.25, 0.25, 0.25), out=5)
    assert tpot_s(r) == 0.25
    assert decode_tok_s(r) == 4.0
    assert tpot_s(req(0.5, (), out=1)) is None
    assert decode_tok_s(req(0.5, (), out=1)) is None
    assert tpot_s(req(0.5, (0.25,), ok=False, kind="timeout")) is None


def test_slos():
    w = Workload(slo_ttft_ms=300, slo_tpot_ms=100, slo_e2e_ms=1000)
    assert meets_slos(req(0.25, (0.0625,) * 4), w)
    assert not meets_slos(req(0.5, (0.0625,) * 4), w)               # TTFT over
    assert not meets_slos(req(0.25, (0.125,) * 4), w)               # TPOT over
    assert not meets_slos(req(0.25, (0.09375,) * 9), w)             # e2e 1.09 s over
    assert meets_slos(req(5.0, (1.0,)), Workload())                 # no SLO set: every success counts


def test_steady_window_runs_from_the_first_completion_to_the_last_send():
    # closed loop at concurrency 2, three waves of 4-token requests (0.25 s per token)
    waves = [req(0.25, (0.25,) * 3, out=4, start=s) for s in (0.0, 0.0, 1.0, 1.0, 2.0, 2.0)]
    assert steady_window(waves, 2) == (1.0, 2.0)
    assert window_rate(waves, 1.0, 2.0) == 8.0                      # 2 streams x 4 tok/s
    assert steady_window(waves[:3], 2) is None                      # under two waves: no steady state
    # chunks carry usage / chunks tokens each: a request whose 4 chunks hold 8 tokens counts double
    heavy = [req(0.25, (0.25,) * 3, out=8, start=s) for s in (0.0, 0.0, 1.0, 1.0, 2.0, 2.0)]
    assert window_rate(heavy, 1.0, 2.0) == 16.0


def test_ramp_up_and_drain_are_left_out_of_the_throughput():
    # a slow first token (prefill of the first wave) and a drain; the steady state is 2 x 4 tok/s
    first = [req(1.0, (0.25,) * 3, out=4, start=0.0) for _ in range(2)]      # done at 1.75
    rest = [req(0.25, (0.25,) * 3, out=4, start=s) for s in (1.75, 1.75, 2.75, 2.75, 3.75, 3.75)]
    thr = phase("c2", first + rest, 4.75, conc=2)
    m = summarize([thr], Workload())
    assert m.steady and (m.window_start_s, m.window_end_s) == (1.75, 3.75)
    assert m.throughput_tok_s == 8.0
    assert m.throughput_tok_s_wall == pytest.approx(32 / 4.75)      # ramp-up and drain included


def phase(name, requests, wall, conc=1, before=(), after=(), peak=()):
    return PhaseResult(name=name, concurrency=conc, wall_s=wall, requests=tuple(requests),
                       server_metrics_before=tuple(before), server_metrics_after=tuple(after),
                       server_metrics_peak=tuple(peak))


def test_summarize_objectives_and_cross_checks():
    w = Workload()
    warm = phase("warmup", [req(9.0, (9.0,), ok=False, kind="timeout")], 20.0)   # excluded entirely
    single = phase("single_stream", [req(0.125, (0.25,) * 4, out=5),           # 4 tok/s
                                     req(0.125, (0.125,) * 4, out=5),          # 8 tok/s
                                     req(0.125, (0.0625,) * 4, out=5)], 3.0)   # 16 tok/s
    thr_reqs = [req(0.1 * (i + 1), (0.05,) * 9, out=10, start=0.1 * i) for i in range(10)]
    before = [("vllm:num_preemptions_total", 2.0), ("vllm:kv_cache_usage_perc", 0.1),
              ("vllm:time_to_first_token_seconds_sum", 1.0), ("vllm:time_to_first_token_seconds_count", 10.0),
              ("vllm:inter_token_latency_seconds_sum", 0.0), ("vllm:inter_token_latency_seconds_count", 0.0)]
    after = [("vllm:num_preemptions_total", 5.0), ("vllm:kv_cache_usage_perc", 0.0),
             ("vllm:time_to_first_token_seconds_sum", 3.0), ("vllm:time_to_first_token_seconds_count", 20.0),
             ("vllm:inter_token_latency_seconds_sum", 4.5), ("vllm:inter_token_latency_seconds_count", 90.0)]
    peak = [("vllm:kv_cache_usage_perc", 0.875), ("vllm:num_requests_waiting", 3.0)]
    thr = phase("throughput", thr_reqs, 2.5, conc=4, before=before, after=after, peak=peak)
    m = summarize((warm, single, thr), w)
    assert isinstance(m, LoadMetrics)
    assert m.single_stream_tok_s == 8.0
    assert m.single_stream_tok_s_spread == 6.0                     # IQR of 4, 8, 16
    assert m.single_stream_ttft_ms == 125.0
    assert m.throughput_level == "throughput" and m.steady
    assert m.throughput_tok_s_wall == 100 / 2.5
    # TTFT in the steady state: the window opens at the first completion (0.55 s) and closes at
    # the last send (0.9 s), so the requests sent at 0.6-0.9 s count: TTFTs 700, 800, 900, 1000 ms
    assert (m.window_start_s, m.window_end_s) == pytest.approx((0.55, 0.9))
    assert m.ttft_ms == pytest.approx(850.0)
    assert m.ttft_ms_p90 == pytest.approx(970.0)
    assert m.ttft_ms_p99 == pytest.approx(997.0)
    assert m.ttft_ms_mean == pytest.approx(850.0)
    assert m.ttft_ms_spread == pytest.approx(150.0)
    assert m.ttft_ms_all == pytest.approx(550.0)                   # p50 of all ten, 100..1000 ms
    assert m.levels[1].ttft_requests == 4
    assert m.tpot_ms == pytest.approx(50.0) and m.itl_ms == pytest.approx(50.0)
    assert m.e2e_ms == pytest.approx(1000.0)
    assert m.requests_per_s == 4.0
    assert m.concurrency == 4 and m.output_tokens_total == 100 and m.throughput_wall_s == 2.5
    # with an SLO, throughput is taken at the highest level that meets it: here concurrency 1
    # (TTFT p90 125 ms), not the loaded level (p90 910 ms)
    g = summarize((warm, single, thr), Workload(slo_ttft_ms=150))
    assert g.throughput_level == "single_stream" and g.throughput_tok_s == 15 / 3.0
    assert g.levels[1].meets_slos is False
    assert g.levels[1].goodput_req_s == 1 / 2.5                     # only the 100 ms TTFT meets 150 ms
    assert m.preemptions == 3.0
    assert m.kv_cache_usage_max == 0.875 and m.num_requests_waiting_max == 3.0
    assert m.server_ttft_ms_mean == pytest.approx(200.0)
    assert m.server_itl_ms_mean == pytest.approx(50.0)
    assert [lv.name for lv in m.levels] == ["single_stream", "throughput"]
    assert m.error_rate == 0.0 and m.requests_sent == 13 and m.load_test_failed == ""
    assert m.error_kinds == "timeout:1"                            # warm-up failures still show as kinds


def test_failed_share_above_threshold_marks_the_trial_and_keeps_partial_results():
    w = Workload(max_failed_share=0.05)
    good = [req(0.1, (0.05,) * 9, out=10) for _ in range(18)]
    bad = [req(0.1, (), out=0, ok=False, kind="timeout"), RequestResult(ok=False, error_kind="http_error",
                                                                        error="HTTP 500: boom", status=500)]
    thr = phase("throughput", good + bad, 2.0, conc=8)
    assert failure_reason(thr, 0.05) == "throughput: 2/20 requests failed (first: timeout: X: y)"
    assert failure_reason(thr, 0.10) == ""                          # exactly at the share: still fine
    m = summarize((thr,), w)
    assert m.load_test_failed.startswith("throughput: 2/20")
    assert m.throughput_tok_s == 180 / 2.0                          # 20 requests < 2 waves of 8: whole phase
    assert m.steady is False
    assert m.error_rate == 0.1 and m.requests_failed == 2
    assert m.single_stream_tok_s is None and m.preemptions is None


def test_summarize_with_no_phases_is_empty_not_an_error():
    m = summarize((), Workload())
    assert m == LoadMetrics()


def test_single_stream_falls_back_to_the_server_itl_when_streams_arrive_in_one_read():
    # a starved client read each whole stream at once: latency == ttft, no decode rate per request
    whole = [RequestResult(ok=True, output_tokens=32, prompt_tokens=8, ttft_s=0.1, latency_s=0.1)
             for _ in range(4)]
    itl = "vllm:inter_token_latency_seconds"
    single = phase("single_stream", whole, 1.0, before=((itl + "_sum", 1.0), (itl + "_count", 100.0)),
                   after=((itl + "_sum", 1.0 + 124 * 0.004), (itl + "_count", 224.0)))
    m = summarize([single], Workload())
    assert m.single_stream_source == "server_itl"
    assert m.single_stream_tok_s == pytest.approx(250.0)
    timed = phase("single_stream", [req(0.1, (0.004,) * 31)], 1.0)
    assert summarize([timed], Workload()).single_stream_source == "client"


def test_a_stream_whose_chunks_arrived_together_is_not_timed_by_the_client():
    # seen on the 2-core box: the first chunk at 124 ms, then 30 more within 0.1 ms (the server's
    # own inter-token latency was 3.4 ms): 82,923 tok/s if timed by the client
    burst = req(0.124, (0.0032,) + (3e-6,) * 30)
    assert decode_tok_s(burst) is None
    assert decode_tok_s(req(0.011, (0.0034,) * 31)) == pytest.approx(31 / (31 * 0.0034))
    # a few chunks together (one read caught two) is still a timed stream
    assert decode_tok_s(req(0.011, (0.0034,) * 25 + (1e-6,) * 6)) is not None
    # a single stream with some requests buffered: the median of the timed ones
    itl = "vllm:inter_token_latency_seconds"
    mixed = phase("single_stream", [burst, burst, req(0.011, (0.004,) * 31), req(0.011, (0.004,) * 31)],
                  1.0, before=((itl + "_sum", 0.0), (itl + "_count", 0.0)),
                  after=((itl + "_sum", 124 * 0.0035), (itl + "_count", 124.0)))
    m = summarize([mixed], Workload())
    assert m.single_stream_source == "client" and m.single_stream_tok_s == pytest.approx(250.0)
    only_bursts = phase("single_stream", [burst] * 4, 1.0, before=((itl + "_sum", 0.0), (itl + "_count", 0.0)),
                        after=((itl + "_sum", 124 * 0.0035), (itl + "_count", 124.0)))
    m = summarize([only_bursts], Workload())
    assert m.single_stream_source == "server_itl" and m.single_stream_tok_s == pytest.approx(1 / 0.0035)


def test_llamacpp_single_stream_falls_back_to_its_decode_counters_when_streams_arrive_in_one_read():
    # llama.cpp has no ITL histogram; its /metrics counts decoded tokens and the seconds spent
    from tuner import engines

    whole = [RequestResult(ok=True, output_tokens=32, prompt_tokens=8, ttft_s=0.1, latency_s=0.1)
             for _ in range(4)]
    engines.use("llamacpp")
    try:
        single = phase("single_stream", whole, 1.0,
                       before=(("llamacpp:tokens_predicted_total", 10.0),
                               ("llamacpp:tokens_predicted_seconds_total", 0.5)),
                       after=(("llamacpp:tokens_predicted_total", 138.0),
                              ("llamacpp:tokens_predicted_seconds_total", 1.0)))
        m = summarize([single], Workload())
        assert m.single_stream_source == "server_decode"
        # 4 requests of 32 tokens: 31 timed intervals each (seen live: 20 tokens in 4.34 ms,
        # llama.cpp's own predicted_per_token_ms 0.228 = 4.34 / 19)
        assert m.single_stream_tok_s == pytest.approx((128 - 4) / 0.5)
        # no counters either: nothing stands in, and the metrics say why
        m = summarize([phase("single_stream", [req(0.1, (3e-6,) * 31)] * 4, 1.0)], Workload())
        assert m.single_stream_tok_s is None and m.single_stream_source == "untimed"
    finally:
        engines.use("vllm")


def test_lockstep_waves_have_no_steady_window_and_are_rated_over_the_wall_clock():
    # 4 slots, 4 users, 2 waves in lockstep: all sent together, all done together (1.0 s prefill,
    # then 8 tokens at 0.25 s), the second wave sent as the first completes (at 2.75-2.8 s)
    first = [req(1.0, (0.25,) * 7, out=8, start=0.0) for _ in range(3)]
    first.append(req(1.05, (0.25,) * 7, out=8, start=0.0))                   # done at 2.8
    second = [req(1.0, (0.25,) * 7, out=8, start=s) for s in (2.75, 2.75, 2.75, 2.8)]
    waves = first + second
    # the window between the first completion and the last send would be 0.05 s, the tail of
    # one wave, against 1.75 s of decode per request
    assert steady_window(waves, 4) is None
    m = summarize([phase("c4", waves, 5.55, conc=4)], Workload())
    assert not m.steady and m.window_start_s is None
    assert m.throughput_tok_s == pytest.approx(64 / 5.55)                     # the wall clock
    assert m.throughput_tok_s <= 4 * 4.0                                       # 4 streams at 4 tok/s
    # the same level staggered (each user one request behind the last) keeps its window
    staggered = [req(0.25, (0.25,) * 3, out=4, start=s) for s in (0.0, 0.5, 1.0, 1.5, 2.0, 2.5)]
    assert steady_window(staggered, 2) == (1.0, 2.5)
