"""The streaming client against a real in-process aiohttp server: SSE edge cases, failures, phases."""

from __future__ import annotations

import asyncio
from dataclasses import replace
import json
import socket
import statistics
import threading

import aiohttp
import pytest
from aiohttp import web

from tuner.load import client
from tuner.load.client import (Level, PhaseResult, SSEStream, Workload, build_prompts, default_levels,
                           load_plan, parse_prometheus, run_load_test, stream_request,
                           ttft_level_name)
from tuner.load.metrics import summarize
from tuner.load.plan import requests_to_prepare

MODEL = "fake-model"
BOS = 1


def _chunk(text=None, *, chat=False, usage=None, choices=True) -> bytes:
    body: dict = {"id": "cmpl-1", "object": "text_completion", "model": MODEL}
    if choices:
        body["choices"] = [{"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}]
    else:
        body["choices"] = []
    if usage is not None:
        body["usage"] = {"prompt_tokens": usage[0], "completion_tokens": usage[1],
                         "total_tokens": sum(usage)}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


class FakeVLLM:
    """An aiohttp server in its own thread and loop, speaking just enough of vLLM's HTTP API.

    /v1/completions streams `max_tokens` words with `delay` between them; prompts are counted with the
    word-level scheme (one token per word, plus a BOS), like the embedded tiny model.
    """

    def __init__(self, delay: float = 0.0, fail_every: int = 0):
        self.delay, self.fail_every = delay, fail_every
        self.requests = 0
        self.prompts: list[str] = []
        self.routes: dict[str, object] = {}
        self.preemptions = 0.0
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        self.ready.wait(10)

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.completions)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_route("*", "/case/{name}", self.case)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        site = web.SockSite(self.runner, sock)
        self.loop.run_until_complete(site.start())
        self.ready.set()
        self.loop.run_forever()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    @staticmethod
    def _count(text: str) -> list[int]:
        return [int(w[1:]) for w in text.split()]

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        if "messages" in body:
            ids = [3, 6] + self._count(body["messages"][0]["content"]) + [4, 6]  # "user :" ... "assistant :"
        else:
            ids = self._count(body["prompt"])
            if body.get("add_special_tokens", True):
                ids = [BOS] + ids
        return web.json_response({"count": len(ids), "tokens": ids, "max_model_len": 4096})

    async def detokenize(self, request: web.Request) -> web.Response:
        ids = (await request.json())["tokens"]
        return web.json_response({"prompt": " ".join(f"w{i}" for i in ids if i < 4096)})

    async def metrics(self, request: web.Request) -> web.Response:
        self.preemptions += 1
        text = ("# HELP vllm:num_preemptions_total x\n# TYPE vllm:num_preemptions_total counter\n"
                f'vllm:num_preemptions_total{{engine="0",model_name="m"}} {self.preemptions}\n'
                f'vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {0.25 * self.fail_every}\n'
                'vllm:num_requests_waiting{engine="0",model_name="m"} 0.0\n')
        return web.Response(text=text)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests += 1
        if self.fail_every and self.requests % self.fail_every == 0:
            return web.Response(status=500, text="boom")
        chat = "messages" in body
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        self.prompts.append(prompt)
        n = body["max_tokens"]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if chat:
            await resp.write(_chunk("", chat=True))  # role-only first chunk: not a token
        for i in range(n):
            await resp.write(_chunk(f" w{i + 10}", chat=chat))
            if self.delay:
                await asyncio.sleep(self.delay)
        await resp.write(_chunk(usage=(len(self._count(prompt)) + (0 if chat else 1), n), choices=False))
        await resp.write(DONE)
        await resp.write_eof()
        return resp

    async def case(self, request: web.Request) -> web.StreamResponse:
        """Hand-written streams, each an edge case of SSE or of the connection."""
        name = request.match_info["name"]
        if name == "http500":
            return web.Response(status=500, text="Internal Server Error: engine dead")
        if name == "slow":
            await asyncio.sleep(5)
            return web.Response(text="late")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if name == "split":
            # one event split across writes, mid-key; a comment, an event: line, CRLF endings,
            # an empty-choices chunk, an empty-text chunk, then usage only and [DONE]
            raw = _chunk(" w10")
            await resp.write(raw[:9])
            await asyncio.sleep(0.02)
            await resp.write(raw[9:30])
            await asyncio.sleep(0.02)
            await resp.write(raw[30:])
            await resp.write(b": keep-alive\n\nevent: message\n")
            await resp.write(_chunk(" w11").replace(b"\n", b"\r\n"))
            await resp.write(_chunk(None, choices=False))
            await resp.write(_chunk(""))
            two = _chunk(" w12") + _chunk(" w13")
            await resp.write(two[:-1])
            await asyncio.sleep(0.02)
            await resp.write(two[-1:])
            await resp.write(_chunk(usage=(5, 4), choices=False))
            await resp.write(DONE)
        elif name == "drop":
            await resp.write(_chunk(" w10"))
            await resp.write(_chunk(" w11"))
            await asyncio.sleep(0.02)
            request.transport.abort()
            return resp
        elif name == "garbage":
            await resp.write(_chunk(" w10"))
            await resp.write(b"data: {not json at all\n\n")
            await resp.write(DONE)
        elif name == "truncated":
            await resp.write(_chunk(" w10"))
            await resp.write(_chunk(" w11"))
        elif name == "no_newline_end":
            await resp.write(_chunk(" w10") + _chunk(usage=(3, 1), choices=False) + b"data: [DONE]")
        elif name == "nousage":
            await resp.write(_chunk(" w10"))
            await resp.write(DONE)
        elif name == "server_error":
            await resp.write(_chunk(" w10"))
            await resp.write(b'data: {"error": {"object": "error", "message": "engine died", "code": 500}}\n\n')
            await resp.write(DONE)
        elif name == "timing":
            for i in range(4):
                await resp.write(_chunk(f" w{i}"))
                await asyncio.sleep(0.05)
            await resp.write(_chunk(usage=(3, 4), choices=False) + DONE)
        await resp.write_eof()
        return resp


@pytest.fixture
def fake():
    server = FakeVLLM()
    yield server
    server.close()


def _request(url: str, payload: bytes = b"{}", **kw) -> client.RequestResult:
    async def go():
        async with aiohttp.ClientSession() as s:
            return await stream_request(s, url, payload, **kw)
    return asyncio.run(go())


def test_split_lines_comments_crlf_empty_choices_usage_and_done(fake):
    r = _request(fake.base_url + "/case/split")
    assert r.ok, r.error
    assert (r.status, r.prompt_tokens, r.output_tokens) == (200, 5, 4)
    assert len(r.itl_s) == 3                      # four content chunks; empty text and no-choices skipped
    assert r.ttft_s > 0.03                        # the first event completed only after its third piece
    assert r.latency_s - r.ttft_s == pytest.approx(sum(r.itl_s), abs=1e-9)


def test_chat_role_only_first_chunk_is_not_the_first_token(fake):
    payload = client.request_payload(MODEL, "w10 w11 w12", 3, "chat")
    fake.delay = 0.03
    r = _request(fake.base_url + "/v1/chat/completions", payload, chat=True)
    assert r.ok, r.error
    assert r.output_tokens == 3 and len(r.itl_s) == 2
    assert r.prompt_tokens == 3


@pytest.mark.parametrize("case, kind, status", [
    ("http500", "http_error", 500),
    ("drop", "disconnected", 200),
    ("garbage", "bad_stream", 200),
    ("truncated", "truncated", 200),
    ("nousage", "no_usage", 200),
    ("server_error", "server_error", 200),
])
def test_failures_are_classified_results_not_exceptions(fake, case, kind, status):
    r = _request(fake.base_url + f"/case/{case}")
    assert not r.ok
    assert (r.error_kind, r.status) == (kind, status), r.error
    assert r.error and len(r.error) <= 300
    if case == "http500":
        assert "engine dead" in r.error
    if case in ("drop", "truncated"):
        assert r.ttft_s is not None              # what was measured before the failure is kept


def test_last_event_without_trailing_newline_still_counts(fake):
    r = _request(fake.base_url + "/case/no_newline_end")
    assert r.ok, r.error
    assert r.output_tokens == 1


def test_timeout_and_refused_connection(fake):
    r = _request(fake.base_url + "/case/slow", timeout_s=0.2)
    assert (r.ok, r.error_kind) == (False, "timeout")
    assert r.error.startswith("TimeoutError") and "0.2" in r.error
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = _request(f"http://127.0.0.1:{port}/v1/completions")
    assert (r.ok, r.error_kind, r.status) == (False, "connection", None)
    assert r.error.startswith("ClientConnectorError")


def test_scripted_clock_through_the_real_client(fake):
    """One clock tick per read: start=0, then each event arrives in its own read (50 ms apart)."""
    ticks = iter(range(100))
    r = _request(fake.base_url + "/case/timing", clock=lambda: float(next(ticks)), phase_start=-10.0)
    assert r.ok, r.error
    assert r.start_s == 10.0
    assert r.ttft_s == 1.0
    assert r.itl_s == (1.0, 1.0, 1.0)
    assert r.latency_s == 4.0 == r.ttft_s + sum(r.itl_s)


def test_sse_parser_direct():
    s = SSEStream()
    s.feed(b'data: {"choices":[{"text":"a"}]}\n\ndata: {"choi', 1.0)
    s.feed(b'ces":[{"text":"b"}]}\n\ndata: {"choices":[],"usage":{"prompt_tokens":2,"completion_tokens":2}}\n', 2.0)
    s.feed(b"\ndata: [DONE]\n\n", 3.0)
    assert (s.arrivals, s.usage, s.done) == ([1.0, 2.0], (2, 2), True)


def test_parse_prometheus_sums_counters_and_takes_max_of_gauges():
    text = """# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="m"} 3.0
vllm:num_preemptions_total{engine="1",model_name="m"} 2.0
vllm:num_preemptions_created{engine="0",model_name="m"} 1.7e9
vllm:kv_cache_usage_perc{engine="0",model_name="a b"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="a b"} 0.75
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 1.5
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="m"} 0.0
vllm:num_requests_waiting 4
"""
    got = dict(parse_prometheus(text))
    assert got == {"vllm:num_preemptions_total": 5.0, "vllm:kv_cache_usage_perc": 0.75,
                   "vllm:time_to_first_token_seconds_sum": 1.5, "vllm:num_requests_waiting": 4.0}


@pytest.mark.parametrize("endpoint, overhead", [("completions", 1), ("chat", 4)])
def test_prompts_have_exact_length_and_distinct_prefixes(fake, endpoint, overhead):
    async def go():
        async with aiohttp.ClientSession() as s:
            return await build_prompts(s, fake.base_url, MODEL, 20, 40, endpoint, seed=3)
    prompts = asyncio.run(go())
    assert len(prompts) == 20
    assert all(len(p.split()) == 40 - overhead for p in prompts)
    assert len({tuple(p.split()[:4]) for p in prompts}) == 20


def test_every_config_meets_the_same_levels():
    assert default_levels(32) == (4, 16, 32)
    assert default_levels(64) == (4, 16, 64)
    assert default_levels(256) == (4, 16, 64, 256)
    assert default_levels(1) == ()
    w = Workload(single_stream_requests=4, max_concurrency=32, waves=4, throughput_requests=32)
    assert load_plan(w) == (Level("single_stream", 1, 4), Level("c4", 4, 32), Level("c16", 16, 64),
                            Level("c32", 32, 128))
    assert ttft_level_name(w) == "c32"
    assert ttft_level_name(Workload(levels=(8, 64), ttft_level=8)) == "c8"
    assert [lv.name for lv in load_plan(Workload(concurrency=5))][1:] == ["c5"]   # the old spelling
    rates = load_plan(Workload(levels=(8,), request_rates=(2.0, 0.5), throughput_requests=10))
    assert [(lv.name, lv.request_rate, lv.requests) for lv in rates[2:]] == [("r0.5", 0.5, 10),
                                                                              ("r2", 2.0, 10)]


def test_run_load_test_phases_against_fake_server(fake, capsys):
    fake.delay = 0.002
    w = Workload(prompt_tokens=16, output_tokens=8, warmup_requests=2, single_stream_requests=3,
                 throughput_requests=12, levels=(4,), metrics_poll_s=0.01)
    phases = run_load_test(fake.base_url, MODEL, w)
    assert [p.name for p in phases] == ["warmup", "single_stream", "c4"]
    assert [p.concurrency for p in phases] == [2, 1, 4]
    assert all(isinstance(p, PhaseResult) and p.wall_s > 0 for p in phases)
    thr = phases[-1]
    assert len(thr.requests) == 16 and all(r.ok for r in thr.requests)   # 4 waves of 4
    assert {(r.prompt_tokens, r.output_tokens) for r in thr.requests} == {(16, 8)}
    assert len(set(fake.prompts)) == len(fake.prompts) == 21
    assert dict(thr.server_metrics_after)["vllm:num_preemptions_total"] > \
        dict(thr.server_metrics_before)["vllm:num_preemptions_total"]
    assert "vllm:kv_cache_usage_perc" in dict(thr.server_metrics_peak)
    m = summarize(phases, w)
    assert m.load_test_failed == "" and m.error_rate == 0.0
    assert m.throughput_tok_s_wall == pytest.approx(16 * 8 / thr.wall_s)
    assert m.steady and m.throughput_tok_s > 0 and m.throughput_level == "c4"
    assert m.single_stream_tok_s > 0 and m.ttft_ms > 0 and m.concurrency == 4
    err = capsys.readouterr().err
    assert "c4: 16/16 requests" in err and "tok/s" in err


def test_time_floor_keeps_a_level_sending_until_it_has_run_long_enough(fake):
    # 8 tokens at 10 ms each: a request takes about 80 ms, so 4 waves of 4 last about 0.3 s; a
    # floor of 1 s keeps the level sending for a second (about 12 waves), within the 32-wave cap
    fake.delay = 0.01
    w = Workload(prompt_tokens=16, output_tokens=8, warmup_requests=0, single_stream_requests=2,
                 throughput_requests=4, levels=(4,), level_seconds=1.0, max_waves=32)
    plan = load_plan(w)
    assert plan[-1] == Level("c4", 4, 16, seconds=1.0, max_requests=128)
    # prompts to prepare: a second of 4 streams at the latency measured one level down, plus a
    # wave to drain, never above the cap nor below the floor; the cap without a latency to go by
    assert requests_to_prepare(plan[-1], 0.1) == 44
    assert requests_to_prepare(plan[-1], 0.001) == 128
    assert requests_to_prepare(plan[-1], 10.0) == 16
    assert requests_to_prepare(plan[-1], None) == 128
    assert requests_to_prepare(Level("c4", 4, 16), 0.1) == 16      # no floor: the count is fixed
    phases = run_load_test(fake.base_url, MODEL, w, progress=False)
    level = phases[-1]
    assert level.name == "c4"
    assert level.wall_s >= 1.0                                     # it ran at least its floor
    assert 16 < len(level.requests) < 128 and all(r.ok for r in level.requests)
    assert max(r.start_s for r in level.requests) >= 1.0 - 0.2     # still sending near the floor
    assert len(set(fake.prompts)) == len(fake.prompts)             # the extra prompts are new ones
    m = summarize(phases, w)
    lv = m.levels[-1]
    assert lv.steady and lv.window_end_s >= 0.8 and lv.requests == len(level.requests)
    # TTFT counts the requests sent in the steady window only (the first wave is left out)
    assert 0 < lv.ttft_requests <= len(level.requests) - 4
    # a rate level sends rate x the floor when that is more than throughput_requests
    assert load_plan(replace(w, levels=(), request_rates=(50.0,), max_concurrency=1))[-1].requests == 50


def test_staggered_closed_loop_spreads_the_slots_over_a_request_time(fake):
    # 8 tokens at 10 ms: a request takes ~80 ms. Together, the 4 slots' first requests start within
    # a few ms and the waves stay in step; staggered, slot k starts k/4 of the single-stream
    # latency in, and with fixed lengths the slots keep that spacing.
    fake.delay = 0.01
    base = Workload(prompt_tokens=16, output_tokens=8, warmup_requests=0, single_stream_requests=2,
                    throughput_requests=16, levels=(4,))
    spreads = {}
    for start in ("together", "staggered"):
        phases = run_load_test(fake.base_url, MODEL, replace(base, closed_loop_start=start),
                               progress=False)
        level = phases[-1]
        assert len(level.requests) == 16 and all(r.ok for r in level.requests)
        firsts = sorted(r.start_s for r in level.requests)[:4]
        spreads[start] = firsts[-1] - firsts[0]
        latency = statistics.median_high([r.latency_s for r in phases[-2].requests])
        assert client.stagger_seconds(replace(base, closed_loop_start=start), load_plan(base)[-1],
                                      latency) == (latency if start == "staggered" else 0.0)
    assert spreads["together"] < 0.02
    assert spreads["staggered"] >= 0.75 * 3 / 4 * 0.08      # 3/4 of a ~80 ms request
    # single stream and rate levels never stagger
    assert client.stagger_seconds(replace(base, closed_loop_start="staggered"),
                                  Level("single_stream", 1, 2), 0.1) == 0.0
    assert client.stagger_seconds(replace(base, closed_loop_start="staggered"),
                                  Level("r2", 4, 8, request_rate=2.0), 0.1) == 0.0


def test_open_loop_and_failed_share_marks_the_trial():
    server = FakeVLLM(fail_every=3)
    try:
        w = Workload(prompt_tokens=8, output_tokens=4, warmup_requests=0, single_stream_requests=0,
                     throughput_requests=9, request_rate=200.0, max_concurrency=1, metrics_poll_s=None)
        phases = run_load_test(server.base_url, MODEL, w, progress=False)
    finally:
        server.close()
    assert [p.name for p in phases] == ["r200"]
    assert phases[0].request_rate == 200.0
    starts = sorted(r.start_s for r in phases[0].requests)
    assert starts[-1] > starts[0]                     # arrivals spread out, not all at t=0
    failed = [r for r in phases[0].requests if not r.ok]
    assert len(failed) == 3 and {r.error_kind for r in failed} == {"http_error"}
    m = summarize(phases, w)
    assert m.load_test_failed.startswith("r200: 3/9 requests failed (first: http_error: HTTP 500")
    assert m.output_tokens_total == 6 * 4             # partial results kept
    assert m.error_kinds == "http_error:3"
