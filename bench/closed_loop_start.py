"""Closed-loop slots started together or staggered: how much does each move TTFT from run to run?

With fixed lengths a closed loop whose slots start together runs in waves, each reaching the server
as a burst, and TTFT p50 is a burst's prefill queue: which side of a scheduler step boundary the
median request falls on decides it (results/h200-steady-8b/README.md). `[workload]
closed_loop_start = "staggered"` starts slot k of c at k/c of a request's time instead. This bench
runs both on one server, alternating which goes first, a fresh seed (new prompts) per run, and
prints per level and start: TTFT p50 (the level's steady window), throughput and the server's own
mean TTFT, each as mean and coefficient of variation over the rounds.

  .venv/bin/python bench/closed_loop_start.py --levels 8,16 --rounds 5      # starts a CPU vLLM (tiny model)
  python3 bench/closed_loop_start.py --base-url URL --model NAME --levels 8,32,128 --rounds 4 \\
      --prompt-tokens 128 --output-tokens 128 --seconds 10 --deadline 400   # on a GPU server
  CLOSED_LOOP=1 LEVEL_S=10 bash bench/h200_fidelity.sh 4 8,32,128 480      # the GPU machine, one call

--deadline S: no run starts after S seconds; the table covers what was measured by then.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tuner.load.client import run_load_test  # noqa: E402
from tuner.load.metrics import summarize  # noqa: E402
from tuner.records import Workload  # noqa: E402

STARTS = ("together", "staggered")


def one_run(base_url: str, model: str, w: Workload) -> dict:
    phases = run_load_test(base_url, model, w, progress=False)
    lv = summarize(phases, w).levels[-1]
    return {"ttft_ms": lv.ttft_ms, "throughput_tok_s": lv.throughput_tok_s,
            "server_ttft_ms_mean": lv.server_ttft_ms_mean, "requests": lv.requests}


def cv(values: list[float]) -> str:
    if len(values) < 2 or not statistics.fmean(values):
        return "-"
    return f"{100 * statistics.stdev(values) / statistics.fmean(values):.1f} %"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", help="a running server (default: start a CPU vLLM of the tiny model)")
    ap.add_argument("--model", help="the served model name (with --base-url)")
    ap.add_argument("--levels", default="8,16", help="closed-loop concurrencies, comma-separated")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=8.0, help="each level's time floor")
    ap.add_argument("--max-num-seqs", type=int, default=16, help="the CPU server's (without --base-url)")
    ap.add_argument("--deadline", type=float, default=None, help="no run starts after this many seconds")
    a = ap.parse_args()
    try:
        levels = [int(x) for x in a.levels.split(",")]
    except ValueError:
        ap.error(f"--levels: expected comma-separated integers, got {a.levels!r}")
    if any(c < 2 for c in levels) or a.rounds < 1:
        ap.error("--levels above 1 and --rounds of at least 1")
    if bool(a.base_url) != bool(a.model):
        ap.error("--base-url and --model go together")
    if a.base_url:
        import urllib.request

        try:
            urllib.request.urlopen(a.base_url.rstrip("/") + "/v1/models", timeout=10).close()
        except OSError as e:
            ap.error(f"--base-url {a.base_url}: no server answers /v1/models ({e})")
    proc = None
    if a.base_url is None:
        from fidelity import start_server, stop_server
        from tuner.run.process import free_port
        from tuner.models.presets import TINY_MODEL

        port = free_port()
        log = Path(tempfile.mkdtemp(prefix="closed-loop-start-")) / "server.log"
        print(f"starting a CPU vLLM of the tiny model (log {log}) ...", flush=True)
        proc = start_server(port, a.max_num_seqs, log)
        a.base_url, a.model = f"http://127.0.0.1:{port}", str(TINY_MODEL)
    runs: dict[tuple[int, str], list[dict]] = {}
    t0 = time.monotonic()
    try:
        print("round | level | start | requests | TTFT p50 ms | tok/s | server TTFT mean ms", flush=True)
        for rnd in range(a.rounds):
            for k, c in enumerate(levels):
                order = STARTS if (rnd + k) % 2 == 0 else STARTS[::-1]
                for start in order:
                    if a.deadline is not None and time.monotonic() - t0 > a.deadline:
                        break
                    w = Workload(prompt_tokens=a.prompt_tokens, output_tokens=a.output_tokens,
                                 warmup_requests=4, single_stream_requests=2, levels=(c,),
                                 level_seconds=a.seconds, closed_loop_start=start,
                                 seed=1000 * rnd + 10 * k + STARTS.index(start))
                    got = one_run(a.base_url, a.model, w)
                    runs.setdefault((c, start), []).append(got)
                    server = got["server_ttft_ms_mean"]
                    print(f"{rnd} | c{c} | {start} | {got['requests']} | {got['ttft_ms']:.1f} | "
                          f"{got['throughput_tok_s']:.0f} | {'-' if server is None else f'{server:.1f}'}",
                          flush=True)
    finally:
        if proc is not None:
            stop_server(proc)
    print("\nlevel | start | TTFT p50 ms: mean (CV) | tok/s: mean (CV) | server TTFT mean ms: mean (CV)")
    for c in levels:
        for start in STARTS:
            rs = runs.get((c, start), [])
            if not rs:
                continue
            cols = []
            for key in ("ttft_ms", "throughput_tok_s", "server_ttft_ms_mean"):
                vals = [r[key] for r in rs if r[key] is not None]
                cols.append(f"{statistics.fmean(vals):.1f} ({cv(vals)})" if vals else "-")
            print(f"c{c} | {start} | " + " | ".join(cols))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
