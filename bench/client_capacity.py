"""How many streamed tokens per second one client process handles on one core, and its CPU at 11,400 tok/s.

A local aiohttp server (its own process, pinned to another core when there is one) streams
vLLM-shaped completion chunks, one token each. The client is tuner.load.client's own request function,
recording every content chunk's arrival time, pinned to one core.

  .venv/bin/python bench/client_capacity.py            # about a minute

Prints the highest token rate (server unpaced, events batched per write so the server is not the
limit), the CPU share of one core at a paced 11,400 tok/s (256 streams at 44.5 tok/s each, one event
per write, as vLLM writes one chunk per request per step), each with a bare aiohttp read loop
(no parsing, no timing) for reference. A client CPU share under 100% means the server was the limit.
Targets: >= 100,000 tok/s and < 15% of a core at 11,400 tok/s.

At 11,400 tok/s over 256 streams nearly every chunk arrives in its own socket read, so the cost is
one event-loop wake-up per token; the bare read loop shows what aiohttp + uvloop alone cost per
wake-up, and the gap to it is what the client's parsing and timing add (about 1.5 us per token).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _net import wait_for_port  # noqa: E402

CHUNK = (b'data: {"id":"cmpl-b1e3a6f0c2d94f5a","object":"text_completion","created":1796232888,'
         b'"model":"meta-llama/Llama-3.1-8B-Instruct","choices":[{"index":0,"text":" token","logprobs":null,'
         b'"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":null}]}\n\n')


def usage_chunk(n: int) -> bytes:
    body = {"id": "cmpl-1", "object": "text_completion", "choices": [],
            "usage": {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": n + 8}}
    return b"data: " + json.dumps(body).encode() + b"\n\ndata: [DONE]\n\n"


# ---------------------------------------------------------------- server (own process)

def serve(port: int, default_interval: float = 0.0, first_delay: float = 0.0) -> None:
    """Stream chunks; `?batch=K&interval=S` per request, else the defaults (used by bench/fidelity.py)."""
    from aiohttp import web

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = body["max_tokens"]
        batch = int(request.query.get("batch", "1"))
        interval = float(request.query.get("interval", default_interval))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if first_delay:
            await asyncio.sleep(first_delay)
        block = CHUNK * batch
        loop = asyncio.get_running_loop()
        due = loop.time()
        sent = 0
        while sent < n:
            k = min(batch, n - sent)
            await resp.write(block if k == batch else CHUNK * k)
            sent += k
            if interval:
                due += interval * k
                delay = due - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
        await resp.write(usage_chunk(n))
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


# ---------------------------------------------------------------- client

async def bare_stream(session, url: str, payload: bytes, events: list[int]) -> None:
    """The reference client: a bare aiohttp read loop that only counts SSE events into events[0]."""
    async with session.post(url, data=payload, headers={"Content-Type": "application/json"}) as resp:
        while True:
            data = await resp.content.readany()
            if not data:
                break
            events[0] += data.count(b"\n\n")


async def drive(url: str, streams: int, tokens: int, duration_s: float, bare: bool = False) -> tuple[float, float, int]:
    """Closed loop of `streams` streaming requests for `duration_s`; (tok/s, cpu share, arrivals)."""
    import aiohttp

    from tuner.load.client import new_session, request_payload, stream_request

    payload = request_payload("m", "w1 w2 w3", tokens)
    stop_at = time.perf_counter() + duration_s
    total = arrivals = 0

    async with new_session(streams) as session:
        async def worker() -> None:
            nonlocal total, arrivals
            while time.perf_counter() < stop_at:
                if bare:
                    events = [0]
                    await bare_stream(session, url, payload, events)
                    total += events[0] - 2  # the usage chunk and [DONE] are events, not tokens
                    continue
                r = await stream_request(session, url, payload, timeout_s=120)
                if not r.ok:
                    raise SystemExit(f"request failed: {r.error_kind}: {r.error}")
                total += r.output_tokens
                arrivals += len(r.itl_s) + 1

        await asyncio.sleep(0.2)  # connections aside, nothing in flight yet
        c0, t0 = time.process_time(), time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(streams)))
        wall = time.perf_counter() - t0
        cpu = time.process_time() - c0
    return total / wall, cpu / wall, arrivals


async def paced(url: str, streams: int, duration_s: float, bare: bool = False) -> tuple[float, float]:
    """`streams` requests paced by the server, each spanning the whole run; CPU and token rate are
    taken over a middle window, so connection set-up and request turnover stay out of the figure."""
    from tuner.load.client import new_session, request_payload, stream_request

    ramp = 2.0
    payload = request_payload("m", "w1 w2 w3", int(11400 / streams * (duration_s + 2 * ramp + 1)))
    events = [0]   # SSE events read by all bare streams so far

    async with new_session(streams) as session:
        t0 = time.perf_counter()
        jobs = asyncio.gather(*(bare_stream(session, url, payload, events) if bare else
                                stream_request(session, url, payload, timeout_s=600, phase_start=t0)
                                for _ in range(streams)))
        await asyncio.sleep(ramp)
        c0, w0, e0 = time.process_time(), time.perf_counter() - t0, events[0]
        await asyncio.sleep(duration_s)
        c1, w1, e1 = time.process_time(), time.perf_counter() - t0, events[0]
        results = await jobs
    if bare:
        n = e1 - e0
    else:
        n = 0
        for r in results:
            if not r.ok:
                raise SystemExit(f"request failed: {r.error_kind}: {r.error}")
            t = r.start_s + r.ttft_s
            n += w0 <= t < w1
            for gap in r.itl_s:
                t += gap
                n += w0 <= t < w1
    return n / (w1 - w0), (c1 - c0) / (w1 - w0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--interval", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--first-delay", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--duration", type=float, default=6.0, help="seconds per measurement (above 0)")
    args = ap.parse_args()
    if args.duration <= 0:
        ap.error(f"--duration {args.duration:g}: seconds above 0")
    if args.serve:
        if hasattr(os, "sched_setaffinity") and os.cpu_count() and os.cpu_count() > 1:
            os.sched_setaffinity(0, {1})
        serve(args.serve, args.interval, args.first_delay)
        return

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port)], start_new_session=True)
    try:
        wait_for_port(port, server, "capacity server")
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, {0})
        from tuner.load.client import run_async

        url = f"http://127.0.0.1:{port}/v1/completions"
        print(f"client pinned to one core; server in pid {server.pid}; {args.duration:g} s per run", file=sys.stderr)

        print("max rate (server unpaced, one client process, one core):")
        best = 0.0
        for streams, batch in ((64, 1), (64, 16), (256, 16), (64, 64)):
            rate, cpu, arrivals = run_async(drive(f"{url}?batch={batch}", streams, 2000, args.duration))
            best = max(best, rate)
            print(f"  streams={streams:<4} events/write={batch:<3} {rate:>10,.0f} tok/s  "
                  f"client CPU {cpu:6.1%} of a core  ({arrivals:,} arrivals timed; "
                  f"{rate / cpu:,.0f} tok/s per CPU-second)")
        bare, bare_cpu, _ = run_async(drive(f"{url}?batch=16", 64, 2000, args.duration, bare=True))
        print(f"  reference: bare aiohttp read loop, streams=64 events/write=16: {bare:,.0f} tok/s "
              f"(CPU {bare_cpu:.1%})")

        print("paced 11,400 tok/s (256 streams x 44.53 tok/s, one event per write):")
        pace = f"{url}?batch=1&interval={256 / 11400:.6f}"
        rate, cpu = run_async(paced(pace, 256, max(args.duration, 8.0)))
        print(f"  measured {rate:,.0f} tok/s, client CPU {cpu:.1%} of a core "
              f"({cpu / rate * 11400:.1%} scaled to exactly 11,400 tok/s)")
        bare, bare_cpu = run_async(paced(pace, 256, max(args.duration, 8.0), bare=True))
        print(f"  reference: bare aiohttp read loop {bare:,.0f} tok/s, CPU {bare_cpu:.1%} "
              f"({bare_cpu / bare * 11400:.1%} scaled): the floor aiohttp itself costs")
        print(f"targets: max >= 100,000 tok/s -> {best:,.0f} ({'met' if best >= 100_000 else 'NOT met'}); "
              f"CPU at 11,400 tok/s < 15% -> {cpu / rate * 11400:.1%} "
              f"({'met' if cpu / rate * 11400 < 0.15 else 'NOT met'})")
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    main()
