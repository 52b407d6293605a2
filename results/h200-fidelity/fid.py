"""Fidelity sweep: tuner's client variants against vLLM's own benchmark client, one server, in one process.

Clients:
  vllm    vllm.benchmarks.serve.main_async (what `vllm bench serve` runs), random dataset, --ignore-eos,
          --temperature 0, standard asyncio loop (as `vllm bench serve`)
  base    committed tuner.loadgen: new_session(c), build_prompts, 1 warm-up request, run_phase with the
          tuner's default /metrics poller (2 s), uvloop (run_async), payload with min_tokens
  nopoll  same, metrics_poll_s=None (what bench/fidelity.py does)
  fix     the variant loadgen (.gpuwork/variant: no min_tokens, first /metrics poll one interval after t0),
          metrics_poll_s=2.0
Every run: unique prompts (own seed), server /metrics snapshot before/after (outside timing), client CPU,
event-loop lag probe, aiohttp trace (time to response headers, new connections) on every session.
Writes runs.jsonl (one summary per run) and reqs.jsonl (per request) to --out, prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import io
import json
import os
import statistics
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp

HERE = Path(__file__).resolve().parent


def load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    m = importlib.util.module_from_spec(spec)
    sys.modules[name] = m
    spec.loader.exec_module(m)
    return m


base_lg = load("base_loadgen", HERE / "base" / "tuner" / "loadgen.py")
fix_lg = load("fix_loadgen", HERE / "variant" / "tuner" / "loadgen.py")

# ---------------------------------------------------------------- tracing on every aiohttp session

TR = {"hdr": [], "conn": [], "reuse": 0, "on": False}


async def _rq_start(session, ctx, params):
    ctx.t0 = time.perf_counter()


async def _rq_end(session, ctx, params):
    if TR["on"] and params.url.path.startswith("/v1/"):
        TR["hdr"].append(time.perf_counter() - ctx.t0)


async def _cc_start(session, ctx, params):
    ctx.c0 = time.perf_counter()


async def _cc_end(session, ctx, params):
    if TR["on"]:
        TR["conn"].append(time.perf_counter() - ctx.c0)


async def _reuse(session, ctx, params):
    if TR["on"]:
        TR["reuse"] += 1


def _trace():
    t = aiohttp.TraceConfig()
    t.on_request_start.append(_rq_start)
    t.on_request_end.append(_rq_end)
    t.on_connection_create_start.append(_cc_start)
    t.on_connection_create_end.append(_cc_end)
    t.on_connection_reuseconn.append(_reuse)
    return t


_Orig = aiohttp.ClientSession


def _traced_session(*a, **k):
    k.setdefault("trace_configs", [_trace()])
    return _Orig(*a, **k)


aiohttp.ClientSession = _traced_session  # both loadgen modules and vLLM's serve look it up at call time


def trace_reset():
    TR["hdr"], TR["conn"], TR["reuse"], TR["on"] = [], [], 0, True


def trace_take():
    TR["on"] = False
    h, c = TR["hdr"], TR["conn"]
    return {"hdr_ms_mean": statistics.fmean(h) * 1e3 if h else None,
            "hdr_ms_p50": statistics.median(h) * 1e3 if h else None,
            "hdr_ms_max": max(h) * 1e3 if h else None,
            "new_conns": len(c), "conn_ms_mean": statistics.fmean(c) * 1e3 if c else None,
            "reused": TR["reuse"]}


# ---------------------------------------------------------------- loop lag probe

class Lag:
    def __init__(self):
        self.lags: list[float] = []
        self.stop = False

    async def run(self):
        while not self.stop:
            t = time.perf_counter()
            await asyncio.sleep(0.005)
            self.lags.append(time.perf_counter() - t - 0.005)

    def summary(self):
        s = sorted(self.lags)
        if not s:
            return {}
        return {"lag_ms_p50": s[len(s) // 2] * 1e3, "lag_ms_p99": s[int(len(s) * 0.99)] * 1e3,
                "lag_ms_max": s[-1] * 1e3}


# ---------------------------------------------------------------- server metrics

def server_metrics(base_url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    try:
        with urllib.request.urlopen(base_url + "/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return out
    for line in text.splitlines():
        if not line.startswith("vllm:") or "_bucket" in line:
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        try:
            v = float(line.rsplit(" ", 1)[1])
        except ValueError:
            continue
        out[name] = out.get(name, 0.0) + v
    return out


def server_delta(before, after):
    d = {k: after[k] - before.get(k, 0.0) for k in after}

    def hm(base):
        c = d.get(base + "_count")
        return d.get(base + "_sum", 0.0) / c * 1e3 if c else None
    return {"srv_ttft_ms_mean": hm("vllm:time_to_first_token_seconds"),
            "srv_queue_ms_mean": hm("vllm:request_queue_time_seconds"),
            "srv_prefill_ms_mean": hm("vllm:request_prefill_time_seconds"),
            "srv_itl_ms_mean": hm("vllm:inter_token_latency_seconds"),
            "srv_e2e_ms_mean": hm("vllm:e2e_request_latency_seconds"),
            "srv_gen_tokens": d.get("vllm:generation_tokens_total"),
            "srv_prompt_tokens": d.get("vllm:prompt_tokens_total"),
            "srv_prefix_hits": d.get("vllm:prefix_cache_hits_total"),
            "srv_prefix_queries": d.get("vllm:prefix_cache_queries_total"),
            "srv_preemptions": d.get("vllm:num_preemptions_total")}


# ---------------------------------------------------------------- figures

def pct(v, q):
    s = sorted(v)
    if not s:
        return None
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def figures(reqs, duration, c):
    """reqs: dicts with start (s, phase-relative), ttft, latency, out, prompt; vLLM's definitions."""
    ok = [r for r in reqs if r["ok"]]
    ttft = [r["ttft"] for r in ok]
    tpot = [(r["latency"] - r["ttft"]) / (r["out"] - 1) for r in ok if r["out"] > 1]
    by_start = sorted(ok, key=lambda r: r["start"])
    first, rest = by_start[:c], by_start[c:]
    return {"n": len(reqs), "failed": len(reqs) - len(ok), "duration_s": duration,
            "out_tok_s": sum(r["out"] for r in ok) / duration,
            "ttft_ms_p50": pct(ttft, 50) * 1e3, "ttft_ms_mean": statistics.fmean(ttft) * 1e3,
            "ttft_ms_p90": pct(ttft, 90) * 1e3,
            "ttft_ms_wave1_mean": statistics.fmean(r["ttft"] for r in first) * 1e3,
            "ttft_ms_rest_mean": statistics.fmean(r["ttft"] for r in rest) * 1e3 if rest else None,
            "tpot_ms_p50": pct(tpot, 50) * 1e3,
            "prompt_tokens_mean": statistics.fmean(r["prompt"] for r in ok),
            "out_tokens_mean": statistics.fmean(r["out"] for r in ok)}


# ---------------------------------------------------------------- clients

POLLS: list[float] = []


def _timed_fetch(orig):
    async def f(session, base_url):
        t = time.perf_counter()
        r = await orig(session, base_url)
        POLLS.append(time.perf_counter() - t)
        return r
    return f


base_lg.fetch_server_metrics = _timed_fetch(base_lg.fetch_server_metrics)
fix_lg.fetch_server_metrics = _timed_fetch(fix_lg.fetch_server_metrics)


async def ours(lg, base_url, model, c, n, seed, poll, in_len, out_len):
    async with lg.new_session(c) as s:
        prompts = await lg.build_prompts(s, base_url, model, n + 1, in_len, seed=seed)
        payloads = [lg.request_payload(model, p, out_len) for p in prompts]
        # one short request first (primes one connection, like vLLM's initial test prompt)
        await lg.run_phase(s, base_url, "warmup", [lg.request_payload(model, prompts[0], 8)], concurrency=1,
                           progress=False, metrics_poll_s=None)
        lag = Lag()
        lt = asyncio.create_task(lag.run())
        POLLS.clear()
        trace_reset()
        cpu0 = time.process_time()
        ph = await lg.run_phase(s, base_url, "throughput", payloads[1:], concurrency=c, progress=False,
                                metrics_poll_s=poll)
        cpu = time.process_time() - cpu0
        tr = trace_take()
        lag.stop = True
        await lt
    reqs = [{"ok": r.ok, "start": r.start_s, "ttft": r.ttft_s, "latency": r.latency_s, "out": r.output_tokens,
             "prompt": r.prompt_tokens, "err": r.error_kind} for r in ph.requests]
    extra = {"cpu_s": cpu, **lag.summary(), **tr,
             "polls": len(POLLS) - 2 if poll else 0,  # minus the before/after fetches
             "poll_ms_max": max(POLLS[1:-1]) * 1e3 if poll and len(POLLS) > 2 else None}
    return reqs, ph.wall_s, extra


VLLM = {}


def vllm_setup():
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:
        from vllm.utils import FlexibleArgumentParser
    import vllm.benchmarks.serve as serve
    VLLM["serve"] = serve
    VLLM["parser_cls"] = FlexibleArgumentParser
    orig = serve.benchmark

    async def wrapped(*a, **k):
        lag = Lag()
        lt = asyncio.create_task(lag.run())
        trace_reset()
        cpu0 = time.process_time()
        r = await orig(*a, **k)
        VLLM["cpu"] = time.process_time() - cpu0
        VLLM["trace"] = trace_take()
        lag.stop = True
        await lt
        VLLM["lag"] = lag.summary()
        return r
    serve.benchmark = wrapped


def theirs(base_url, model, c, n, seed, in_len, out_len, log):
    serve = VLLM["serve"]
    p = VLLM["parser_cls"]()
    serve.add_cli_args(p)
    args = p.parse_args(["--backend", "vllm", "--base-url", base_url, "--model", model,
                         "--dataset-name", "random", "--random-input-len", str(in_len),
                         "--random-output-len", str(out_len), "--num-prompts", str(n),
                         "--max-concurrency", str(c), "--ignore-eos", "--temperature", "0",
                         "--seed", str(seed), "--disable-tqdm", "--save-detailed"])
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        d = asyncio.run(serve.main_async(args))
    log.write(buf.getvalue()[-1500:])
    t0 = min(d["start_times"])
    reqs = []
    for st, tt, itl, ol, il, err in zip(d["start_times"], d["ttfts"], d["itls"], d["output_lens"],
                                        d["input_lens"], d["errors"]):
        reqs.append({"ok": not err, "start": st - t0, "ttft": tt, "latency": tt + sum(itl), "out": ol,
                     "prompt": il, "err": err[:40] if err else ""})
    # cpu includes the initial test prompt; the lag probe and trace too
    extra = {"cpu_s": VLLM["cpu"], **VLLM["lag"], **VLLM["trace"], "vllm_reported_tput": d["output_throughput"],
             "vllm_reported_ttft_p50": d["median_ttft_ms"], "vllm_reported_tpot_p50": d["median_tpot_ms"]}
    return reqs, d["duration"], extra


def run_one(who, base_url, model, c, n, seed, a, log):
    if who == "vllm":
        return theirs(base_url, model, c, n, seed, a.input_len, a.output_len, log)
    lg = fix_lg if who == "fix" else base_lg
    poll = None if who == "nopoll" else 2.0
    return base_lg.run_async(ours(lg, base_url, model, c, n, seed, poll, a.input_len, a.output_len))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--levels", default="1,16,64,128,256")
    ap.add_argument("--clients", default="vllm,base,nopoll,fix")
    ap.add_argument("--rounds", default="0,1", help="round indices (order alternates on odd rounds)")
    ap.add_argument("--per-conc", type=int, default=4, help="requests = per_conc x concurrency")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--deadline", type=float, default=1e9, help="seconds from start; no new run after")
    ap.add_argument("--warm", default="", help="discarded warm-up runs first: who:c:n,...")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/fid"))
    a = ap.parse_args()
    t_start = time.monotonic()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    levels = [int(x) for x in a.levels.split(",")]
    clients = a.clients.split(",")
    if "vllm" in clients:
        vllm_setup()
    runs_f = open(out / "runs.jsonl", "a")
    reqs_f = open(out / "reqs.jsonl", "a")
    log = open(out / "clients.log", "a")
    est = {}  # seconds a run at c took last time

    def do(who, c, n, seed, rnd, tag=""):
        left = a.deadline - (time.monotonic() - t_start)
        need = est.get((who, c), est.get(("any", c), 5 + 0.06 * n))
        if need > left:
            print(f"skip {who} c={c} round {rnd}: needs ~{need:.0f}s, {left:.0f}s left", flush=True)
            return None
        before = server_metrics(a.base_url)
        t = time.monotonic()
        try:
            reqs, dur, extra = run_one(who, a.base_url, a.model, c, n, seed, a, log)
        except Exception as e:  # keep the sweep going
            print(f"ERROR {who} c={c}: {type(e).__name__}: {e}", flush=True)
            return None
        took = time.monotonic() - t
        est[(who, c)] = took
        est[("any", c)] = took
        after = server_metrics(a.base_url)
        rec = {"who": who, "round": rnd, "c": c, "seed": seed, "tag": tag, "wall_total_s": took,
               **figures(reqs, dur, c), **extra, **server_delta(before, after)}
        rec["cpu_share"] = rec["cpu_s"] / dur
        if not tag:
            runs_f.write(json.dumps(rec) + "\n")
            runs_f.flush()
            reqs_f.write(json.dumps({"who": who, "round": rnd, "c": c, "reqs": reqs}) + "\n")
            reqs_f.flush()
        print(f"{tag or 'run'} r{rnd} {who:<6} c={c:<3} n={n:<4} out {rec['out_tok_s']:8.0f} tok/s  "
              f"TTFT p50 {rec['ttft_ms_p50']:7.1f} mean {rec['ttft_ms_mean']:7.1f} (srv {rec['srv_ttft_ms_mean'] or 0:6.1f}, "
              f"w1 {rec['ttft_ms_wave1_mean']:6.1f}, hdr {rec['hdr_ms_mean'] or 0:6.1f})  TPOT p50 {rec['tpot_ms_p50']:6.3f}  "
              f"in {rec['prompt_tokens_mean']:.1f}  cpu {rec['cpu_share']:.0%} lag99 {rec.get('lag_ms_p99', 0):.1f} "
              f"max {rec.get('lag_ms_max', 0):.1f}ms  conns {rec['new_conns']} hits {rec['srv_prefix_hits']} "
              f"polls {rec.get('polls')}/{rec.get('poll_ms_max')}  [{took:.0f}s]", flush=True)
        return rec

    seed = 1000
    for spec in filter(None, a.warm.split(",")):
        who, c, n = spec.split(":")
        seed += 1
        do(who, int(c), int(n), seed, -1, tag="warm")
    for rnd in [int(x) for x in a.rounds.split(",")]:
        for li, c in enumerate(levels):
            order = clients[li % len(clients):] + clients[:li % len(clients)]
            if rnd % 2:
                order = order[::-1]
            for who in order:
                seed += 1
                do(who, c, a.per_conc * c, seed + 100000 * (rnd + 1), rnd)
    runs_f.close()
    summarize(out / "runs.jsonl", levels, clients)


def summarize(path, levels=None, clients=None):
    recs = [json.loads(x) for x in open(path)]
    levels = levels or sorted({r["c"] for r in recs})
    clients = clients or sorted({r["who"] for r in recs})
    print("\nmedians over rounds; ratio = client / vllm  (target 0.97..1.03)")
    print(f"{'c':>4} {'client':<7} {'runs':>4} {'out tok/s':>10} {'ratio':>6} {'TTFT p50':>9} {'ratio':>6} "
          f"{'TPOT p50':>9} {'ratio':>6} {'TTFT mean':>9} {'srv TTFT':>8} {'hdr':>6} {'cpu':>5} {'lag99':>6}")
    for c in levels:
        ref = {}
        for who in ["vllm"] + [w for w in clients if w != "vllm"]:
            rs = [r for r in recs if r["c"] == c and r["who"] == who]
            if not rs:
                continue
            m = {k: statistics.median(r[k] for r in rs) for k in ("out_tok_s", "ttft_ms_p50", "tpot_ms_p50",
                                                                   "ttft_ms_mean", "cpu_share")}
            for k in ("srv_ttft_ms_mean", "hdr_ms_mean", "lag_ms_p99"):
                v = [r[k] for r in rs if r.get(k) is not None]
                m[k] = statistics.median(v) if v else float("nan")
            if who == "vllm":
                ref = m
            rt = lambda k: m[k] / ref[k] if ref else float("nan")  # noqa: E731
            print(f"{c:>4} {who:<7} {len(rs):>4} {m['out_tok_s']:>10.0f} {rt('out_tok_s'):>6.3f} "
                  f"{m['ttft_ms_p50']:>9.1f} {rt('ttft_ms_p50'):>6.3f} {m['tpot_ms_p50']:>9.3f} {rt('tpot_ms_p50'):>6.3f} "
                  f"{m['ttft_ms_mean']:>9.1f} {m['srv_ttft_ms_mean']:>8.1f} {m['hdr_ms_mean']:>6.1f} "
                  f"{m['cpu_share']:>5.0%} {m['lag_ms_p99']:>6.1f}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--summarize":
        summarize(Path(sys.argv[2]))
    else:
        main()
