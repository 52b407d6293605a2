"""Async streaming load tests against an OpenAI-compatible vLLM server: one RequestResult per request."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp

from tuner import progress as run_progress
from tuner.progress import RequestProgress
from tuner.load.prompts import build_prompts, build_prompts_of_lengths  # noqa: F401 - re-exported: callers import it from here

try:  # a vLLM dependency; typed decoding skips unknown fields and is several times faster than json
    import msgspec
except ImportError:  # pragma: no cover - exercised only without vLLM installed
    msgspec = None
try:  # also a vLLM dependency; its event loop roughly halves the client's CPU per streamed chunk
    import uvloop
except ImportError:  # pragma: no cover
    uvloop = None

# the records and the load plan moved out (tuner.records, tuner.load.plan); importers still find them here
from tuner.load.plan import (closed_levels, default_levels, extra_lengths, level_lengths, load_plan,  # noqa: F401,E402
                             requests_to_prepare, ttft_level_name)
from tuner.records import Level, PhaseResult, RequestResult, Workload  # noqa: F401,E402


# /metrics samples kept per phase are the engine's names (gauges combined across label sets by
# max, counters by sum); vLLM's stay importable from here
from tuner import engines  # noqa: E402
from tuner.engines.vllm import SERVER_COUNTERS, SERVER_GAUGES  # noqa: E402,F401
_JSON = {"Content-Type": "application/json"}
# vLLM's answers (HTTP 400) to a request longer than the server's context: "This model's maximum
# context length is 4096 tokens. However, you requested ...", "The decoder prompt (length 5000) is
# longer than the maximum model length of 4096", "'max_tokens' ... is too large", and vLLM 0.32's
# "max_tokens must be at least 1, got 0" for a prompt that fills the whole context
TOO_LONG = re.compile(r"maximum context length|maximum model length|max_model_len|is too large|"
                      r"too long|exceeds the model|max_tokens must be at least 1", re.I)


# ---------------------------------------------------------------- SSE parsing (the hot path)

class _BadStream(Exception):
    pass


if msgspec is not None:
    class _Delta(msgspec.Struct):
        content: str | None = None

    class _Choice(msgspec.Struct):
        text: str | None = None
        delta: _Delta | None = None

    class _Usage(msgspec.Struct):
        prompt_tokens: int | None = 0
        completion_tokens: int | None = 0

    class _Chunk(msgspec.Struct):
        choices: list[_Choice] | None = None
        usage: _Usage | None = None
        error: Any = None
        kind: str | None = msgspec.field(default=None, name="object")
        message: str | None = None

    _decode_chunk = msgspec.json.Decoder(_Chunk).decode

    def _extract(payload: bytes, chat: bool):
        """(content text or None, (prompt, completion) tokens or None, server error or None)."""
        try:
            c = _decode_chunk(payload)
        except msgspec.DecodeError as e:
            raise _BadStream(f"{type(e).__name__}: {e}; line {payload[:80]!r}") from None
        text = None
        if c.choices:
            ch = c.choices[0]
            if chat:
                text = ch.delta.content if ch.delta is not None else None
            else:
                text = ch.text
        usage = (c.usage.prompt_tokens or 0, c.usage.completion_tokens or 0) if c.usage is not None else None
        err = None
        if c.error is not None or c.kind == "error":
            err = str(c.error if c.error is not None else c.message)[:200]
        return text, usage, err
else:  # pragma: no cover
    def _extract(payload: bytes, chat: bool):
        try:
            c = json.loads(payload)
            text = None
            if c.get("choices"):
                ch = c["choices"][0]
                text = (ch.get("delta") or {}).get("content") if chat else ch.get("text")
            u = c.get("usage")
            usage = (u.get("prompt_tokens") or 0, u.get("completion_tokens") or 0) if u else None
            err = c.get("error") or (c.get("message") if c.get("object") == "error" else None)
        except (ValueError, AttributeError, TypeError, IndexError) as e:
            raise _BadStream(f"{type(e).__name__}: {e}; line {payload[:80]!r}") from None
        return text, usage, (str(err)[:200] if err else None)


class SSEStream:
    """Incremental parser of an OpenAI streaming response: content arrival times, usage, [DONE].

    Every chunk of bytes read from the socket is stamped once with the time it arrived; each
    `data:` event completed by that chunk that carries non-empty content records that time.
    Only lines starting with `data:` are decoded; blank lines, comments and `event:` lines are skipped.
    """

    __slots__ = ("chat", "tail", "arrivals", "usage", "done", "server_error")

    def __init__(self, chat: bool = False):
        self.chat = chat
        self.tail = b""
        self.arrivals: list[float] = []
        self.usage: tuple[int, int] | None = None
        self.done = False
        self.server_error: str | None = None

    def feed(self, data: bytes, now: float) -> None:
        if self.tail:
            data = self.tail + data
        lines = data.split(b"\n")
        self.tail = lines.pop()
        for line in lines:
            if line[:5] != b"data:":
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.done = True
                continue
            text, usage, err = _extract(payload, self.chat)
            if text:
                self.arrivals.append(now)
            if usage is not None:
                self.usage = usage
            if err is not None:
                self.server_error = err

    def finish(self, now: float) -> None:
        """The connection ended: a last event without a trailing newline still counts."""
        if self.tail.strip():
            data, self.tail = self.tail + b"\n", b""
            self.feed(data, now)


def _short(e: BaseException, default: str = "") -> str:
    msg = str(e) or default
    return f"{type(e).__name__}: {msg}"[:300]


async def stream_request(session: aiohttp.ClientSession, url: str, payload: bytes, *, chat: bool = False,
                         timeout_s: float = 300.0, clock: Callable[[], float] = time.perf_counter,
                         phase_start: float | None = None, scheduled: float | None = None) -> RequestResult:
    """POST one streaming request and time it; never raises (the caller's cancellation aside).

    `scheduled` (open loop): the arrival time the Poisson process gave this request; TTFT and
    latency then count from it, so time spent waiting for the client is charged, not hidden.
    """
    sent = clock()
    start = sent if scheduled is None else min(scheduled, sent)
    t0 = sent if phase_start is None else phase_start
    sse = SSEStream(chat)
    status = None
    kind = err = ""
    try:
        async with session.post(url, data=payload, headers=_JSON,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            status = resp.status
            if status != 200:
                body = (await resp.read())[:400].decode("utf-8", "replace")
                kind = "rejected_for_length" if status == 400 and TOO_LONG.search(body) else "http_error"
                err = f"HTTP {status}: {body}"[:300]
            else:
                content = resp.content
                feed = sse.feed
                while True:
                    data = await content.readany()
                    if not data:
                        break
                    feed(data, clock())
                sse.finish(clock())
    except TimeoutError as e:  # asyncio.TimeoutError and aiohttp's ServerTimeoutError
        kind, err = "timeout", _short(e, f"no complete response in {timeout_s:g} s")
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, ConnectionResetError) as e:
        kind, err = "disconnected", _short(e)
    except (aiohttp.ClientError, OSError) as e:
        kind, err = "connection", _short(e)
    except _BadStream as e:
        kind, err = "bad_stream", str(e)[:300]
    except Exception as e:  # noqa: BLE001 - a request never raises; the class and message are kept
        kind, err = "other", _short(e)
    if not kind:
        if sse.server_error is not None:
            kind, err = "server_error", sse.server_error
        elif not sse.done:
            kind, err = "truncated", "stream ended without [DONE]"
        elif sse.usage is None:
            kind, err = "no_usage", "stream carried no usage chunk"
        elif not sse.arrivals:
            kind, err = "no_content", "stream carried no content"
    arrivals = sse.arrivals
    prompt_tokens, output_tokens = sse.usage or (0, 0)
    if arrivals:
        itl = tuple(b - a for a, b in zip(arrivals, arrivals[1:]))
        ttft, latency = arrivals[0] - start, arrivals[-1] - start
    else:
        itl, ttft, latency = (), None, clock() - start
    return RequestResult(ok=not kind, status=status, error_kind=kind, error=err,
                         prompt_tokens=prompt_tokens, output_tokens=output_tokens, start_s=sent - t0,
                         ttft_s=ttft, itl_s=itl, latency_s=latency, queued_s=sent - start)


# ---------------------------------------------------------------- server-side metrics

def parse_prometheus(text: str, engine: str | None = None) -> tuple[tuple[str, float], ...]:
    """The engine's server gauges (max over label sets) and counters (sum) found in Prometheus text."""
    eng = engines.get(engine)
    gauges, counters, prefix = set(eng.server_gauges), set(eng.server_counters), eng.metric_prefix
    found: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        brace, space = line.find("{"), line.find(" ")
        end = brace if 0 <= brace < space or (brace >= 0 and space < 0) else space
        name = line[:end]
        if name not in gauges and name not in counters:
            continue
        rest = line[line.rfind("}") + 1:] if brace >= 0 else line[end:]
        try:
            value = float(rest.split()[0])
        except (IndexError, ValueError):
            continue
        if name in gauges:
            found[name] = max(found.get(name, value), value)
        else:
            found[name] = found.get(name, 0.0) + value
    return tuple(sorted(found.items()))


async def fetch_server_metrics(session: aiohttp.ClientSession, base_url: str,
                               engine: str | None = None) -> tuple[tuple[str, float], ...]:
    """Selected /metrics samples; () when the endpoint is missing or fails (it is a cross-check only)."""
    try:
        async with session.get(base_url + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as r:
            if r.status != 200:
                return ()
            return parse_prometheus(await r.text(), engine)
    except (aiohttp.ClientError, OSError, TimeoutError):
        return ()


def request_payload(model: str, prompt: str, output_tokens: int, endpoint: str = "completions",
                    engine: str | None = None) -> bytes:
    """The JSON body of one streaming request whose output length is fixed at `output_tokens`
    (the engine says how: vLLM's min_tokens and ignore_eos)."""
    body: dict = {"model": model, "max_tokens": output_tokens,
                  **engines.get(engine).fixed_output(output_tokens),
                  "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return json.dumps(body).encode()


def endpoint_url(base_url: str, endpoint: str) -> str:
    return base_url.rstrip("/") + ("/v1/chat/completions" if endpoint == "chat" else "/v1/completions")


# ---------------------------------------------------------------- phases

async def run_phase(session: aiohttp.ClientSession, base_url: str, name: str, payloads: Sequence[bytes], *,
                    concurrency: int, chat: bool = False, timeout_s: float = 300.0,
                    request_rate: float | None = None, seed: int = 0, metrics_poll_s: float | None = None,
                    progress: bool = True, clock: Callable[[], float] = time.perf_counter,
                    endpoint: str = "completions", engine: str | None = None,
                    min_requests: int | None = None, min_seconds: float = 0.0,
                    stagger_s: float = 0.0) -> PhaseResult:
    """Send `payloads` closed-loop at `concurrency`, or open-loop Poisson at `request_rate` (in-flight
    capped at `concurrency`), reading /metrics before, during (gauge peaks) and after.

    Closed loop with `min_seconds`: the first `min_requests` payloads are always sent, the rest only
    while the phase has run less than `min_seconds` (a time floor; payloads not sent are dropped).
    Closed loop with `stagger_s`: worker k of c sends its first request k/c x `stagger_s` in, so the
    slots do not start (and, with fixed lengths, keep arriving) together.
    """
    url = endpoint_url(base_url, endpoint)
    gauges = set(engines.get(engine).server_gauges)
    before = await fetch_server_metrics(session, base_url, engine)
    peaks: dict[str, float] = {}
    stop = asyncio.Event()

    async def poll() -> None:
        # the first sample one interval in, not in the opening burst, where it would delay the
        # admission of every request of the first wave
        while True:
            try:
                await asyncio.wait_for(stop.wait(), metrics_poll_s)
                return
            except TimeoutError:
                pass
            for k, v in await fetch_server_metrics(session, base_url, engine):
                if k in gauges:
                    peaks[k] = max(peaks.get(k, v), v)

    floor = len(payloads) if min_requests is None else min(min_requests, len(payloads))
    timed = request_rate is None and min_seconds > 0 and min_requests is not None
    bar = RequestProgress(name, floor if timed else len(payloads), progress,
                          seconds=min_seconds if timed else 0.0)
    results: list[RequestResult | None] = [None] * len(payloads)
    poller = asyncio.create_task(poll()) if metrics_poll_s and payloads else None
    t0 = clock()

    async def send(i: int, scheduled: float | None = None) -> None:
        r = await stream_request(session, url, payloads[i], chat=chat, timeout_s=timeout_s,
                                 clock=clock, phase_start=t0, scheduled=scheduled)
        results[i] = r
        bar.add(r)

    if request_rate is None:
        it = iter(range(len(payloads)))

        workers = min(concurrency, len(payloads))

        async def worker(k: int) -> None:
            if stagger_s > 0 and k:
                await asyncio.sleep(k * stagger_s / workers)
            for i in it:  # a shared iterator: each worker takes the next request when it is free
                if i >= floor and clock() - t0 >= min_seconds:
                    return    # the floors are met: the level drains from here
                await send(i)

        await asyncio.gather(*(worker(k) for k in range(workers)))
    else:
        rng = random.Random(seed)
        gate = asyncio.Semaphore(concurrency)

        async def gated(i: int, scheduled: float) -> None:
            async with gate:  # a client-side cap only; time waited here counts in TTFT
                await send(i, scheduled)

        tasks, due = [], t0
        for i in range(len(payloads)):
            delay = due - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(gated(i, due)))
            due += rng.expovariate(request_rate)
        await asyncio.gather(*tasks)
    wall = clock() - t0
    bar.close()
    if poller is not None:
        stop.set()
        await poller
    after = await fetch_server_metrics(session, base_url, engine)
    return PhaseResult(name=name, concurrency=concurrency, wall_s=wall,
                       requests=tuple(r for r in results if r is not None),
                       server_metrics_before=before, server_metrics_after=after,
                       server_metrics_peak=tuple(sorted(peaks.items())), request_rate=request_rate)


def new_session(concurrency: int, trust_env: bool = False, engine: str | None = None) -> aiohttp.ClientSession:
    """One client session with room for every stream plus the /metrics poller (call inside a loop).

    trust_env stays off: with it aiohttp looks up proxies and .netrc on every request, which adds
    about 2 ms to each TTFT on this machine (vLLM's benchmark client turns it on).
    """
    # vLLM started with VLLM_API_KEY in its environment refuses /v1/* without the key; the key
    # comes from the tuner's environment only (study files may not hold it) and is never logged
    eng = engines.get(engine)
    key = os.environ.get(eng.api_key_env)
    # a server that closes a connection after a streamed response (llama.cpp's) must get a new
    # one per request: a reused one fails with "Can not write request body"
    connector = aiohttp.TCPConnector(limit=concurrency + 4, force_close=not eng.keep_alive)
    return aiohttp.ClientSession(connector=connector, trust_env=trust_env,
                                 timeout=aiohttp.ClientTimeout(total=None),
                                 headers={"Authorization": f"Bearer {key}"} if key else None)


def stagger_seconds(w: Workload, lv: Level, typical_latency_s: float | None) -> float:
    """Over how long a closed-loop level's slots start: a request's time (the previous level's
    median latency) when the workload staggers them, else 0 (all at once)."""
    if w.closed_loop_start != "staggered" or lv.request_rate is not None or lv.concurrency < 2:
        return 0.0
    return typical_latency_s or 0.0


async def run_load_test_async(base_url: str, model: str, workload: Workload,
                              progress: bool = True, engine: str | None = None,
                              alive: Callable[[], bool] | None = None) -> tuple[PhaseResult, ...]:
    """Warm-up, then every level of the workload's plan; one session per level, prompts built first.

    The plan depends on the workload alone, never on the config under test, so every config meets
    the same offered load. Prompts are distinct across all levels (prefix caching cannot help).
    `alive()` false before a level (the server exited) skips that level and the rest.
    """
    base_url = base_url.rstrip("/")
    chat = workload.endpoint == "chat"
    w = workload
    plan = load_plan(w)
    if w.warmup_requests > 0:
        top = max((lv.concurrency for lv in plan if lv.request_rate is None), default=1)
        plan = (Level("warmup", max(1, min(top, w.warmup_requests)), w.warmup_requests),) + plan
    lengths = level_lengths(w, plan)
    run_progress.phase("building prompts")
    async with new_session(16, engine=engine) as session:
        if w.length_mix == "fixed":
            prompts = await build_prompts(session, base_url, model, sum(lv.requests for lv in plan),
                                          w.prompt_tokens, w.endpoint, seed=w.seed, engine=engine)
        else:
            prompts = await build_prompts_of_lengths(
                session, base_url, model, [p for level in lengths for p, _ in level], w.endpoint,
                seed=w.seed, engine=engine)
    phases = []
    used = 0
    for lv, sizes in zip(plan, lengths):
        mine, used = prompts[used:used + lv.requests], used + lv.requests
        if alive is not None and not alive():
            break   # the server died: the remaining levels would only count connection errors
        latencies = [r.latency_s for r in phases[-1].requests if r.ok] if phases else []
        typical = statistics.median_high(latencies) if latencies else None
        more = requests_to_prepare(lv, typical) - lv.requests
        if more > 0:   # a time floor: prompts for the requests beyond the floor, built before it starts
            run_progress.phase(f"building prompts for {lv.name}")
            extra = extra_lengths(w, lv, more)
            async with new_session(16, engine=engine) as session:
                mine = mine + await build_prompts_of_lengths(
                    session, base_url, model, [p for p, _ in extra], w.endpoint,
                    seed=w.seed * 7919 + lv.concurrency + 1, engine=engine)
            sizes = sizes + extra
        payloads = [request_payload(model, p, out, w.endpoint, engine) for p, (_, out) in zip(mine, sizes)]
        async with new_session(lv.concurrency, engine=engine) as session:
            phases.append(await run_phase(session, base_url, lv.name, payloads,
                                          concurrency=lv.concurrency, chat=chat,
                                          timeout_s=w.request_timeout_s, request_rate=lv.request_rate,
                                          seed=w.seed, metrics_poll_s=w.metrics_poll_s,
                                          progress=progress, endpoint=w.endpoint, engine=engine,
                                          min_requests=lv.requests, min_seconds=lv.seconds,
                                          stagger_s=stagger_seconds(w, lv, typical)))
    run_progress.phase("stopping")   # the caller stops the server next
    return tuple(phases)


def run_load_test(base_url: str, model: str, workload: Workload, progress: bool = True,
                  engine: str | None = None,
                  alive: Callable[[], bool] | None = None) -> tuple[PhaseResult, ...]:
    """Warm-up and every level of the workload against a ready server (synchronous wrapper)."""
    return run_async(run_load_test_async(base_url, model, workload, progress, engine, alive))


# The signals the command line turns into KeyboardInterrupt besides SIGINT (which asyncio.Runner
# already turns into a cancellation of the running coroutine).
INTERRUPT_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


def run_async(coro):
    """asyncio.run on uvloop's event loop when it is installed (the client's CPU share matters).

    A KeyboardInterrupt raised by a signal handler inside an event-loop callback is lost: uvloop
    reports an exception from a protocol's data_received and reads on (a SIGTERM during a load test
    let the trial finish and the tuner exit 0). So while the loop runs, the signals the tuner turns
    into KeyboardInterrupt cancel the coroutine instead, and KeyboardInterrupt is raised once the
    loop has let go. SIGINT gets the same from asyncio.Runner itself.
    """
    interrupted: list[int] = []

    async def guarded():
        task, loop = asyncio.current_task(), asyncio.get_running_loop()
        installed = {}
        if threading.current_thread() is threading.main_thread():
            for sig in INTERRUPT_SIGNALS:
                previous = signal.getsignal(sig)
                if callable(previous):     # a handler of the tuner's (not SIG_DFL / SIG_IGN)
                    loop.add_signal_handler(sig, lambda s=sig: (interrupted.append(s), task.cancel()))
                    installed[sig] = previous
        try:
            return await coro
        finally:
            for sig, previous in installed.items():
                loop.remove_signal_handler(sig)
                signal.signal(sig, previous)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop if uvloop is not None else None) as runner:
        try:
            return runner.run(guarded())
        except asyncio.CancelledError:
            if interrupted:
                raise KeyboardInterrupt from None
            raise
