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

--imports MOD[,MOD]: compare warm starts without and with those modules imported ahead by every
spare (TUNER_WARM_IMPORTS), instead of cold against warm; e.g. `--imports vllm.v1.engine.core`,
what vLLM's engine-core process imports after it starts. Every launch's phases from its log
(engine_start, weights, compile, profile, graphs, warmup) are printed beside its seconds to ready,
and the table gives the median engine_start of each side.

--env KEY=VALUE: compare warm starts without and with that variable in the server's environment,
e.g. `--env VLLM_WORKER_MULTIPROC_METHOD=fork`: vLLM's CLI starts its engine-core process with
`spawn` (a fresh interpreter that imports torch and vLLM again) unless the variable is set; with
`fork` the engine core is a copy of the API server, whose imports the spare has already done.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tuner.engines.vllm_logs import launch_phases  # noqa: E402
from tuner.models.presets import TINY_MODEL, preset_folder  # noqa: E402
from tuner.run import spare  # noqa: E402
from tuner.run.process import LaunchFailure, LaunchSpec, ServerProcess  # noqa: E402
from tuner.search.space import ServerParams  # noqa: E402


def launch_once(spec: LaunchSpec) -> tuple[float, bool]:
    """Seconds until ready, and whether a spare served; one short request proves it serves. The
    launch's phases from its log are in spec.log_path (read them with launch_phases)."""
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


def run(spec: LaunchSpec, warm: bool, launches: int, log_dir: Path, imports: str = "",
        label: str = "", env: dict | None = None) -> tuple[list[float], float, list[dict]]:
    """One run of launches: seconds to ready of each, the run's wall-clock, and each launch's
    phases from its log. `imports` is TUNER_WARM_IMPORTS for the spares of this run; `env` is set
    for the run (servers and spares) and taken away after it."""
    label = label or ("warm" if warm else "cold")
    os.environ[spare.ENV_IMPORTS] = imports
    os.environ.update(env or {})
    spare.enable(warm)
    t0 = time.monotonic()
    seconds, phases = [], []
    for i in range(launches):
        log_path = log_dir / f"{label}-{time.time():.0f}-{i}.log"
        s, served_warm = launch_once(LaunchSpec(**{**spec.__dict__, "log_path": str(log_path)}))
        assert served_warm == (warm and i > 0), (warm, i, served_warm)
        seconds.append(s)
        phases.append(launch_phases(log_path.read_text(errors="replace")))
        print(f"  {label} launch {i + 1}: ready after {s:.1f} s" + (" (spare)" if served_warm else "")
              + "; " + " ".join(f"{k} {v:.1f}" for k, v in phases[-1].items()), flush=True)
    spare.discard()
    os.environ.pop(spare.ENV_IMPORTS, None)
    for key in env or {}:
        os.environ.pop(key, None)
    return seconds, time.monotonic() - t0, phases


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--launches", type=int, default=3)
    ap.add_argument("--model", default=str(TINY_MODEL))
    ap.add_argument("--gmu", type=float, default=0.1)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--extra-args", default="")
    ap.add_argument("--skip-warmup", action="store_true",
                    help="no uncounted first launch (each run's first launch is uncounted anyway)")
    ap.add_argument("--imports", default="", metavar="MOD[,MOD]",
                    help="compare warm starts without and with these modules imported by every spare")
    ap.add_argument("--env", default="", metavar="KEY=VALUE",
                    help="compare warm starts without and with this variable in the server's environment")
    args = ap.parse_args()
    if args.launches < 2:
        ap.error("--launches must be at least 2 (a warm run's first launch is cold)")
    model = preset_folder(args.model[len("preset:"):]) if args.model.startswith("preset:") else args.model
    spec = LaunchSpec(model=str(model), params=ServerParams(
        gpu_memory_utilization=args.gmu, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs),
        extra_args=("--load-format", "dummy", *shlex.split(args.extra_args)), launch_timeout_s=900)
    log_dir = Path(tempfile.mkdtemp(prefix="warm-start-"))
    spare.enable(False)
    if not args.skip_warmup:
        print(f"warm-up launch (not counted); logs in {log_dir}", flush=True)
        print(f"  ready after {launch_once(LaunchSpec(**{**spec.__dict__, 'log_path': str(log_dir / 'warmup.log')}))[0]:.1f} s")
    # The two sides: (label, warm, TUNER_WARM_IMPORTS, env); cold vs warm, or warm vs warm with
    # the imports and/or the variable.
    if args.env and "=" not in args.env:
        ap.error("--env takes KEY=VALUE")
    env = dict([args.env.split("=", 1)]) if args.env else {}
    if args.imports or env:
        extra = "+".join(["imports"] * bool(args.imports) + [args.env] * bool(env))
        sides = [("warm", True, "", {}), (f"warm+{extra}", True, args.imports, env)]
    else:
        sides = [("cold", False, "", {}), ("warm", True, "", {})]
    later = {label: [] for label, *_ in sides}
    engine_start = {label: [] for label, *_ in sides}
    totals = {label: [] for label, *_ in sides}
    for r in range(args.rounds):
        for label, warm, imports, side_env in (sides if r % 2 == 0 else sides[::-1]):
            seconds, total, phases = run(spec, warm, args.launches, log_dir, imports, label, side_env)
            later[label] += seconds[1:]
            engine_start[label] += [p["engine_start"] for p in phases[1:] if "engine_start" in p]
            totals[label].append(total)
    print(f"\n{args.rounds} rounds x {args.launches} launches, model {Path(str(model)).name}"
          + (f", imports ahead: {args.imports}" if args.imports else ""))
    print("| start | launches after the first: median ready s (min-max) | median engine_start s "
          "| run of launches: median wall s |")
    print("| --- | --- | --- | --- |")
    for label, *_ in sides:
        xs, es = later[label], engine_start[label]
        print(f"| {label} | {statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f}) "
              f"| {statistics.median(es) if es else float('nan'):.1f} | {statistics.median(totals[label]):.1f} |")
    (a, *_), (b, *_) = sides
    print(f"ratio {b} / {a}: later launches {statistics.median(later[b]) / statistics.median(later[a]):.3f}, "
          f"whole run {statistics.median(totals[b]) / statistics.median(totals[a]):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
