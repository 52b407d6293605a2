"""One short real workload against a real vLLM server (CPU build, tiny model)."""

from __future__ import annotations

import pytest

from tuner.load.client import Workload, run_load_test
from tuner.load.metrics import summarize

pytestmark = pytest.mark.vllm


def test_short_workload_on_real_vllm(tiny_vllm_server):
    base_url, model = tiny_vllm_server
    w = Workload(prompt_tokens=48, output_tokens=16, warmup_requests=1, single_stream_requests=3,
                 throughput_requests=12, request_timeout_s=120, metrics_poll_s=0.5,
                 levels=(8,), waves=1)
    phases = run_load_test(base_url, model, w, progress=False)
    assert [p.name for p in phases] == ["warmup", "single_stream", "c8"]
    for p in phases:
        for r in p.requests:
            assert r.ok, (p.name, r.error_kind, r.error)
            # exact lengths: prompts built through /tokenize, outputs fixed by ignore_eos + min/max_tokens
            assert (r.prompt_tokens, r.output_tokens) == (48, 16)
            assert r.latency_s - r.ttft_s == pytest.approx(sum(r.itl_s), abs=1e-9)
    thr = phases[-1]
    before, after = dict(thr.server_metrics_before), dict(thr.server_metrics_after)
    # the server saw exactly this phase's tokens, and distinct prompts gave the prefix cache nothing
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 12 * 16
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == 12 * 48
    assert after.get("vllm:prefix_cache_hits_total", 0) - before.get("vllm:prefix_cache_hits_total", 0) == 0
    m = summarize(phases, w)
    assert m.load_test_failed == "" and m.error_rate == 0.0
    assert m.concurrency == 8 and m.output_tokens_total == 12 * 16
    assert m.single_stream_tok_s > 0 and m.throughput_tok_s > 0 and m.ttft_ms > 0
    assert m.preemptions == 0
    assert m.server_ttft_ms_mean is not None and m.server_itl_ms_mean is not None
    # the server's own TTFT excludes HTTP and queueing in the API process, so it cannot exceed ours much
    assert m.server_ttft_ms_mean <= m.ttft_ms_mean * 1.5 + 5
