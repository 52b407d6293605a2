"""Bench: one study on 1, 2, 4 and 8 workers, replaying recorded trial durations; wall-clock, speed-up and the front.

No GPU is launched. The real worker path runs (`Tuner` with a worker number on a shared SQLite
storage: the study lock, claims, heartbeats, duplicates told instead of launched, the budget shared),
one process per worker as `run --parallel N` starts them, but its `measure` sleeps the config's
recorded duration, scaled down (default 1 recorded second = 10 ms), and answers the config's
recorded figures (bench/data/grid-tiny-cpu.csv, the 36-config grid of bench/grid.toml, grid sampler).

Two sets of durations (launch_s + load_s of a recorded trial):

- `cpu`: each config's own, from the grid's recording on the 2-core CPU box (20-79 s).
- `h200`: the H200 trials of results/h200-full, h200-16gb and h200-levels (67-144 s a measured
  config, 57 s a memory failure), handed to the grid's configs in turn: the H200 studies searched
  another space, so their figures cannot be replayed, only how long a trial took there.

1 worker is the plain `run` (no worker number, no lock); N > 1 is `run --parallel N`'s workers after
the supervisor's `open()`. The clock starts once every worker has built its Tuner (process start
and imports are not counted) and stops when the last one ends; results/ is not written (the
serial run's report at the end and the supervisor's are both left out). A worker waiting for
another's launch polls every 1 s scaled the same way (at least 50 ms).

What is not scaled is the tuner's own work per trial (storage writes, the lock, trials.csv
rewritten after each trial): ~0.4 s of real time on the 2-core box, as long as a scaled CPU-grid
trial and nothing beside a real one, and shared by the workers' processes on the same 2 cores. So
the speed-ups below are a floor, set by this box; the columns that do not depend on it are the
launches, the duplicate launches and the front.

    .venv/bin/python bench/parallel_scaling.py
    .venv/bin/python bench/parallel_scaling.py --durations h200 --workers 1 2 --ms-per-s 5
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import pandas as pd  # noqa: E402

from search_efficiency import STUDY, TABLE, GridTable, key_of  # noqa: E402
from tuner.search import study as study_module  # noqa: E402
from tuner.config import load_study  # noqa: E402
from tuner.search.study import Platform, Tuner  # noqa: E402

H200 = [REPO / "results" / name / "trials.csv" for name in ("h200-full", "h200-16gb", "h200-levels")]
WORKERS = (1, 2, 4, 8)


def recorded_s(row) -> float:
    return float(row.get("launch_s") or 0.0) + float(row.get("load_s") or 0.0)


def durations(table: GridTable, which: str) -> dict:
    """Recorded seconds per config key: its own (`cpu`), or the H200 trials' in turn (`h200`)."""
    if which == "cpu":
        return {key: recorded_s(row) for key, row in table.rows.items()}
    ok, failed = [], []
    for path in H200:
        df = pd.read_csv(path)
        for _, r in df[(df["state"] == "COMPLETE") & df["launch_s"].notna()].iterrows():
            (failed if isinstance(r["failure"], str) and r["failure"] else ok).append(
                recorded_s(r.to_dict()))
    out = {}
    for i, (key, row) in enumerate(sorted(table.rows.items())):
        launched_only = row["failure"] and row["failure"] != "load_test_failed"
        pool = failed if launched_only and failed else ok
        out[key] = pool[i % len(pool)]
    return out


class SleepingDevice:
    """A `measure` that sleeps the config's recorded duration (scaled), notes the launch in a
    shared file (one O_APPEND write per launch, so workers' lines never mix) and answers the
    config's recorded figures."""

    def __init__(self, table: GridTable, seconds: dict, scale: float, launches: Path):
        self.table, self.seconds, self.scale, self.launches = table, seconds, scale, launches

    def __call__(self, spec, workload, on_started=None, progress=False):
        key = key_of(spec.params)
        start = time.time()
        time.sleep(self.seconds[key] * self.scale)
        line = json.dumps({"key": list(key), "pid": os.getpid(), "start": start, "end": time.time()})
        fd = os.open(self.launches, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)
        return self.table.outcome(spec)


class ScalingTuner(Tuner):
    """The real tuner with the replayed device: the node total the recording saw, no vLLM."""

    def __init__(self, cfg, table: GridTable, measure, worker: int | None):
        self.table = table
        platform = Platform("cpu", "CPU (replayed)", table.device_memory_bytes(), None, ("true",),
                            "replay")
        super().__init__(cfg, measure=measure, platform=platform, progress=False, worker=worker,
                         report_at_end=False)

    def predict(self, params):
        if self.memory_model is None:
            return None
        self.memory_model.device_memory_bytes = self.table.device_memory_bytes(key_of(params))
        return self.memory_model.predict(params)


def _child(job: dict) -> None:
    """One process of a run: `prepare` (the supervisor's `open()`), or a worker (None: the plain
    serial run) that builds its Tuner, says it is ready, and runs once told to go."""
    tmp = Path(job["tmp"])
    cfg = study_config(tmp)
    table = GridTable.from_csv(TABLE)
    device = SleepingDevice(table, durations(table, job["durations"]), job["scale"],
                            tmp / "launches.jsonl")
    study_module.WAIT_POLL_S = job["poll_s"]
    if job["worker"] == "prepare":
        ScalingTuner(cfg, table, None, worker=0).open()
        return
    tuner = ScalingTuner(cfg, table, device, job["worker"])
    (tmp / f"ready-{job['worker']}").touch()
    while not (tmp / "go").exists():
        time.sleep(0.005)
    tuner.run(job["trials"])


def study_config(tmp: Path):
    cfg = load_study(STUDY, {"storage": f"sqlite:///{tmp}/scaling.db", "results_dir": str(tmp)})
    return replace(cfg, replicates=0)    # one recorded measurement per config


def _start(job: dict) -> subprocess.Popen:
    # the worker's command line names the tuner, as `python -m tuner run --worker K` does: a worker
    # that finds a trial of a live pid whose command line does not is right to take it for a dead
    # tuner's (a reused pid), and would fail its trial
    log = open(Path(job["tmp"]) / f"{job['worker']}.log", "ab")
    return subprocess.Popen([sys.executable, __file__, "--as-tuner-worker", json.dumps(job)],
                            stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": str(REPO)})


@dataclass
class Result:
    workers: int
    wall_s: float
    launches: int
    duplicates: int          # launches of a config launched before (must be 0)
    overlaps: int            # pairs of launches of one config at the same time (must be 0)
    front: frozenset
    told_duplicate: int      # trials told a twin's figures instead of launching


def run_study(n_workers: int, which: str, scale: float, poll_s: float, n_trials: int) -> Result:
    import optuna

    from tuner.results import report

    # storage on tmpfs where there is one: SQLite's commit per attr then costs no disk sync, which
    # at this time scale would weigh as much as a trial
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="scaling-", dir=shm) as tmp:
        job = {"tmp": tmp, "durations": which, "scale": scale, "poll_s": poll_s, "trials": n_trials}
        if n_workers > 1:
            prep = _start({**job, "worker": "prepare"})
            if prep.wait() != 0:
                raise SystemExit(f"preparing the study failed:\n{_logs(tmp)}")
        slots = [None] if n_workers == 1 else list(range(n_workers))
        procs = [_start({**job, "worker": w}) for w in slots]
        while not all((Path(tmp) / f"ready-{w}").exists() for w in slots):
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.01)
        (Path(tmp) / "go").touch()
        started = time.monotonic()
        codes = [p.wait() for p in procs]
        wall = time.monotonic() - started
        if any(codes):
            raise SystemExit(f"a worker failed ({codes}):\n{_logs(tmp)}")
        cfg = study_config(Path(tmp))
        study = optuna.load_study(study_name=cfg.name, storage=cfg.storage)
        df = report.trials_frame(study, cfg.tie_tolerance)
        front = frozenset(key_of(r) for _, r in df[df["pareto"]].iterrows())
        told = sum(1 for t in study.trials if t.user_attrs.get("failure") == "duplicate")
        spans = [json.loads(line) for line in (Path(tmp) / "launches.jsonl").read_text().splitlines()]
    keys = [tuple(s["key"]) for s in spans]
    overlaps = sum(1 for i, a in enumerate(spans) for b in spans[i + 1:]
                   if a["key"] == b["key"] and a["start"] < b["end"] and b["start"] < a["end"])
    return Result(n_workers, wall, len(spans), len(keys) - len(set(keys)), overlaps, front, told)


def _logs(tmp: str) -> str:
    return "".join(f"--- {f.name}\n{f.read_text(errors='replace')[-3000:]}"
                   for f in sorted(Path(tmp).glob("*.log")))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--durations", nargs="+", default=["cpu", "h200"], choices=("cpu", "h200"))
    ap.add_argument("--workers", nargs="+", type=int, default=list(WORKERS))
    ap.add_argument("--ms-per-s", type=float, default=10.0,
                    help="milliseconds slept per recorded second (default 10)")
    ap.add_argument("--trials", type=int, default=26,
                    help="the budget of launches (default 26: what the serial run launches of the "
                         "grid before every config left is measured or ruled out by a failure)")
    ap.add_argument("--as-tuner-worker", metavar="JOB", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.as_tuner_worker:
        _child(json.loads(args.as_tuner_worker))
        return 0
    if min(args.workers) < 1 or args.trials < 1 or args.ms_per_s <= 0:
        ap.error("--workers and --trials of at least 1, --ms-per-s above 0")
    scale = args.ms_per_s / 1000.0
    poll_s = max(0.05, study_module.WAIT_POLL_S * scale)
    table = GridTable.from_csv(TABLE)
    print(f"time scaled: 1 recorded second = {args.ms_per_s:g} ms of sleep; wall-clock below is "
          f"real seconds (and recorded-time minutes, = real / scale); {len(table.rows)} configs of "
          f"{STUDY.relative_to(REPO)}, grid sampler, budget {args.trials} launches, SQLite storage; "
          f"{os.cpu_count()} CPU cores for every worker's tuner")
    for which in args.durations:
        seconds = durations(table, which)
        print(f"\ndurations {which}: {min(seconds.values()):.0f}-{max(seconds.values()):.0f} s a "
              f"trial, {sum(seconds.values()) / 60:.0f} min for the whole grid one after another")
        print("workers | wall s | recorded min | speed-up | launches | duplicate launches | "
              "same-config overlaps | told a twin's figures | front = serial's")
        serial = None
        for n in args.workers:
            r = run_study(n, which, scale, poll_s, args.trials)
            serial = serial or r
            same = "yes" if r.front == serial.front else f"NO ({len(r.front)} vs {len(serial.front)})"
            print(f"{r.workers:>7} | {r.wall_s:6.1f} | {r.wall_s / scale / 60:12.1f} | "
                  f"{serial.wall_s / r.wall_s:7.2f}x | {r.launches:>8} | {r.duplicates:>18} | "
                  f"{r.overlaps:>20} | {r.told_duplicate:>21} | {same} ({len(r.front)} configs)",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
