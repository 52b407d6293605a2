"""Warm starts against cold starts, side by side: seconds to ready per launch, and the wall-clock of
a run of launches, with the spare interpreter (tuner/run/spare.py) on and off.

One launch first warms the page cache and vLLM's compile cache (not counted). Then each round
runs LAUNCHES launches of the same config cold and LAUNCHES warm, the order alternating between
rounds. A warm run's first launch is cold by construction (nobody started a spare for it), and its
spare imports while that launch starts, competing with it for the CPU: so the figures that matter
are the median of the later launches and the whole run's wall-clock, printed for both and as a
ratio (warm / cold).

    .venv/bin/python bench/warm_start.py [--rounds 2] [--launches 3] [--model DIR|preset:NAME]
        [--gmu 0.1 --max-model-len 2048 --max-num-seqs 4] [--extra-args "--dtype float16"]
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tuner.models.presets import TINY_MODEL, preset_folder  # noqa: E402
from tuner.run import spare  # noqa: E402
from tuner.run.process import LaunchFailure, LaunchSpec, ServerProcess  # noqa: E402
from tuner.search.space import ServerParams  # noqa: E402


def launch_once(spec: LaunchSpec) -> tuple[float, bool]:
    """Seconds until ready, and whether a spare served; one short request proves it serves."""
    t0 = time.monotonic()
    with ServerProcess(spec) as server:
        server.start()
        ready = server.wait_ready()
        ready_s = time.monotonic() - t0
        if isinstance(ready, LaunchFailure):
            raise SystemExit(f"launch failed: {ready.kind}: {ready.message}")
        body = json.dumps({"model": spec.model, "prompt": "hello", "max_tokens": 4}).encode()
        request = urllib.request.Request(server.base_url + "/v1/completions", body,
                                         {"Content-Type": "application/json"})
        usage = json.loads(urllib.request.urlopen(request, timeout=120).read())["usage"]
        assert usage["completion_tokens"] == 4, usage
        return ready_s, server.warm_imported_s is not None


def run(spec: LaunchSpec, warm: bool, launches: int, log_dir: Path) -> tuple[list[float], float]:
    spare.enable(warm)
    t0 = time.monotonic()
    seconds = []
    for i in range(launches):
        s, served_warm = launch_once(LaunchSpec(**{**spec.__dict__,
                                                   "log_path": str(log_dir / f"{'warm' if warm else 'cold'}-{time.time():.0f}-{i}.log")}))
        assert served_warm == (warm and i > 0), (warm, i, served_warm)
        seconds.append(s)
        print(f"  {'warm' if warm else 'cold'} launch {i + 1}: ready after {s:.1f} s"
              + (" (spare)" if served_warm else ""), flush=True)
    spare.discard()
    return seconds, time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--launches", type=int, default=3)
    ap.add_argument("--model", default=str(TINY_MODEL))
    ap.add_argument("--gmu", type=float, default=0.1)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--extra-args", default="")
    args = ap.parse_args()
    if args.launches < 2:
        ap.error("--launches must be at least 2 (a warm run's first launch is cold)")
    model = preset_folder(args.model[len("preset:"):]) if args.model.startswith("preset:") else args.model
    spec = LaunchSpec(model=str(model), params=ServerParams(
        gpu_memory_utilization=args.gmu, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs),
        extra_args=("--load-format", "dummy", *shlex.split(args.extra_args)), launch_timeout_s=900)
    log_dir = Path(tempfile.mkdtemp(prefix="warm-start-"))
    print(f"warm-up launch (not counted); logs in {log_dir}", flush=True)
    spare.enable(False)
    print(f"  ready after {launch_once(LaunchSpec(**{**spec.__dict__, 'log_path': str(log_dir / 'warmup.log')}))[0]:.1f} s")
    later = {True: [], False: []}
    totals = {True: [], False: []}
    for r in range(args.rounds):
        for warm in ((False, True) if r % 2 == 0 else (True, False)):
            seconds, total = run(spec, warm, args.launches, log_dir)
            later[warm] += seconds[1:]
            totals[warm].append(total)
    print(f"\n{args.rounds} rounds x {args.launches} launches, model {Path(str(model)).name}")
    print("| start | launches after the first: median ready s (min-max) | run of launches: median wall s |")
    print("| --- | --- | --- |")
    for warm in (False, True):
        xs = later[warm]
        print(f"| {'warm' if warm else 'cold'} | {statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f}) "
              f"| {statistics.median(totals[warm]):.1f} |")
    print(f"ratio warm / cold: later launches {statistics.median(later[True]) / statistics.median(later[False]):.3f}, "
          f"whole run {statistics.median(totals[True]) / statistics.median(totals[False]):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
