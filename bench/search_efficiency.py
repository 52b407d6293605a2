"""Bench: replay samplers against a recorded grid; launches needed to reach 95% of the grid's hypervolume.

The grid (bench/grid.toml, 36 configs of the embedded tiny model on the CPU build) was measured once
by the tuner itself; bench/data/grid-tiny-cpu.csv is its trials.csv plus the NUMA node total vLLM
saw at each launch. Here the real `Tuner` runs again, baselines, duplicate handling and memory model
included, but its `measure` looks the config up in that table instead of launching vLLM. Each run
stops as soon as the configs launched so far reach 95% of the hypervolume of the whole grid's
feasible measurements (three objectives, each normalised by the grid's range, reference point at
the worst value of each), and the number of launches it took is the figure.

    .venv/bin/python bench/search_efficiency.py                       # GP, TPE, random, grid
    .venv/bin/python bench/search_efficiency.py --samplers tpe random --seeds 20
    .venv/bin/python bench/search_efficiency.py --no-memory-model
    .venv/bin/python bench/search_efficiency.py --record /tmp/grid-results/grid-tiny-cpu{,-low}  # the CSV

Storage and results folders live in a temporary folder per run; nothing is left behind.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import re
import statistics
import sys
import tempfile
import json
import random
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import pandas as pd  # noqa: E402

from tuner.cli import nonneg_int, positive_int  # noqa: E402
from tuner.config import StudyConfig, load_study  # noqa: E402
from tuner.errors import ConfigError, TunerError  # noqa: E402
from tuner.run.process import Capacity, LaunchFailure  # noqa: E402
from tuner.run.measure import TrialOutcome  # noqa: E402
from tuner.load.metrics import LoadMetrics  # noqa: E402
from tuner.records import LevelMetrics  # noqa: E402
from tuner.results import report  # noqa: E402
from tuner.search.study import Platform, Tuner  # noqa: E402

STUDY = REPO / "bench" / "grid.toml"
STUDY_LEVELS = REPO / "bench" / "grid-levels.toml"     # the same-load recording (grid-levels-cpu.csv)
TABLE = REPO / "bench" / "data" / "grid-tiny-cpu.csv"
KEYS = ("gpu_memory_utilization", "max_model_len", "max_num_seqs")
OBJECTIVES = ("single_stream_tok_s", "throughput_tok_s", "ttft_ms")
MAXIMIZE = {"single_stream_tok_s": True, "throughput_tok_s": True, "ttft_ms": False}
HV_SHARE = 0.95
SAMPLERS = ("gp", "tpe", "random", "grid")
GIB = 2**30


def key_of(params) -> tuple:
    """The table key of a ServerParams or a dict of params."""
    get = params.get if isinstance(params, dict) else lambda k: getattr(params, k)
    return (round(float(get("gpu_memory_utilization")), 4), int(get("max_model_len")),
            int(get("max_num_seqs")))


def _clean(value):
    if value is None or (isinstance(value, float) and math.isnan(value)) or value is pd.NA:
        return None
    return value.item() if hasattr(value, "item") else value


# ---------------------------------------------------------------- the table


@dataclass
class GridTable:
    """Recorded outcome per config: {key: row dict}, with the grid's feasible objective ranges."""

    rows: dict
    noise: dict = field(default_factory=dict)   # the recording's launch-to-launch noise (noise.json)
    rng: object = None                          # set: each replayed launch is jittered by that noise

    @classmethod
    def from_csv(cls, path: Path) -> "GridTable":
        df = pd.read_csv(path)
        df = df[df["state"] == "COMPLETE"]
        rows = {}
        for _, r in df.iterrows():
            row = {k: _clean(v) for k, v in r.items()}
            row["failure"] = row.get("failure") or ""
            rows[key_of(row)] = row
        noise_file = path.with_suffix(".noise.json")
        noise = json.loads(noise_file.read_text()) if noise_file.exists() else {}
        return cls(rows, noise)

    def feasible(self, key) -> bool:
        row = self.rows[key]
        return bool(row.get("feasible")) and all(row.get(k) is not None for k in OBJECTIVES)

    def device_memory_bytes(self, key=None) -> int:
        """What vLLM sized gmu against for this config's launch (the node total drifts), or the
        median over the table when the config has no figure."""
        def of(row):
            for col in ("device_memory_bytes", "node_memory_bytes"):
                if row.get(col):
                    return int(row[col])
            if row.get("gpu_memory_total_gib"):
                return int(row["gpu_memory_total_gib"] * GIB)
            return None
        if key is not None and key in self.rows and of(self.rows[key]):
            return of(self.rows[key])
        known = [of(r) for r in self.rows.values() if of(r)]
        return int(statistics.median(known)) if known else 12 * GIB

    def outcome(self, spec) -> TrialOutcome:
        p = spec.params
        key = key_of(p)
        if key not in self.rows:
            raise TableError(f"config {key} of the study's space is not in the table: pass the "
                             "--study the table was recorded with")
        row = self.rows[key]
        base = TrialOutcome(params=p, argv=("vllm", "serve", spec.model, *p.vllm_flags()),
                            log_path=spec.log_path, launch_s=row.get("launch_s") or 0.0)
        kind = row["failure"]
        if kind and kind != "load_test_failed":
            return replace(base, failure=LaunchFailure(
                kind=kind, message=row.get("failure_message") or "",
                needed_gib=row.get("needed_gib"), available_gib=row.get("available_gib"),
                estimated_max_model_len=_int(row.get("estimated_max_model_len")),
                exit_code=_int(row.get("exit_code"))))
        # trials.csv names some capacity attrs apart from the workload's (report.ATTR_COLUMNS)
        column = report.ATTR_COLUMNS
        capacity = Capacity(**{f.name: _typed(f, row.get(column.get(f.name, f.name), row.get(f.name)))
                               for f in fields(Capacity) if f.name != "cache_config"
                               and row.get(column.get(f.name, f.name), row.get(f.name)) is not None})
        metrics = LoadMetrics(**{f.name: _typed(f, row.get(f.name)) for f in fields(LoadMetrics)
                                 if f.name not in ("error_kinds", "levels") and row.get(f.name) is not None})
        metrics = replace(metrics, levels=self.levels(row))
        if self.rng is not None and self.noise:
            metrics = self.jittered(metrics)
        return replace(base, capacity=capacity, metrics=metrics, load_s=row.get("load_s") or 0.0)

    def levels(self, row: dict) -> tuple:
        """The same-load levels a row recorded (c4_throughput_tok_s, c4_ttft_ms, ...), if any."""
        out = []
        for col in row:
            m = re.fullmatch(r"c(\d+)_throughput_tok_s", col)
            if m and row[col] is not None:
                c = int(m.group(1))
                out.append(LevelMetrics(name=f"c{c}", concurrency=c, throughput_tok_s=float(row[col]),
                                        ttft_ms=row.get(f"c{c}_ttft_ms"), steady=True))
        return tuple(sorted(out, key=lambda lv: lv.concurrency))

    def jittered(self, m: LoadMetrics) -> LoadMetrics:
        """A launch's figures: the table's mean times the measured launch-to-launch noise."""
        def j(key, x):
            cv = self.noise.get(key, {}).get("cv", 0.0)
            return None if x is None else x * max(0.05, 1 + self.rng.gauss(0, cv))
        levels = tuple(replace(lv, throughput_tok_s=j("throughput_tok_s", lv.throughput_tok_s),
                               ttft_ms=j("ttft_ms", lv.ttft_ms)) for lv in m.levels)
        return replace(m, levels=levels, **{k: j(k, getattr(m, k)) for k in OBJECTIVES})


def _int(v):
    return None if v is None else int(v)


def _typed(f, v):
    t = str(f.type)
    if "bool" in t:
        return bool(v) if not isinstance(v, str) else v == "True"
    if t.startswith("int"):
        return int(v)
    return v


def synthetic_table(node_gib: float = 12.0, non_kv_gib: float = 0.72) -> GridTable:
    """The grid.toml space with CPU-build-like figures, for developing and testing without vLLM."""
    rows = {}
    for gmu in (0.03, 0.05, 0.08, 0.12):
        for mml in (2048, 8192, 32768):
            for mns in (1, 4, 16):
                kv_gib = gmu * node_gib - non_kv_gib
                tokens = int(kv_gib * GIB / 4096 // 128 * 128) if kv_gib > 0 else 0
                row = {"gpu_memory_utilization": gmu, "max_model_len": mml, "max_num_seqs": mns,
                       "state": "COMPLETE", "node_memory_bytes": int(node_gib * GIB)}
                if kv_gib <= 0:
                    row.update(failure="no_cache_blocks", feasible=False,
                               needed_gib=round(kv_gib, 2), available_gib=0.1)
                elif tokens < mml:
                    row.update(failure="kv_cache_too_small", feasible=False,
                               estimated_max_model_len=tokens, available_gib=round(kv_gib, 2),
                               needed_gib=mml * 4096 / GIB)
                else:
                    conc = min(mns, tokens // 96)
                    row.update(failure="", feasible=True, kv_cache_tokens=tokens,
                               kv_cache_gib=round(kv_gib, 2), num_gpu_blocks=tokens // 128,
                               block_size=128, max_concurrency=tokens / mml,
                               single_stream_tok_s=40.0 - 0.4 * mns - 2e-4 * mml + 5 * gmu,
                               throughput_tok_s=38.0 * conc ** 0.7 + 30 * gmu,
                               ttft_ms=60.0 + 25.0 * conc + 1e-3 * mml)
                rows[key_of(row)] = row
    return GridTable(rows)


# ---------------------------------------------------------------- hypervolume


def normaliser(table: GridTable, objectives=OBJECTIVES, log_ttft: bool = True):
    """Map a row to [0, 1]^3, larger better, 0 = the grid's worst feasible value (the reference
    point), 1 its best; TTFT on a log scale by default (40 ms against 80 ms counts as much as 400
    against 800). Objectives left out of `objectives` are 1 for every point (a 2-D or 1-D volume)."""
    feasible = [table.rows[k] for k in table.rows if table.feasible(k)]
    if not feasible:   # nothing ran: every point is the reference point, the volume 0
        return lambda row: (0.0,) * len(OBJECTIVES)

    def value(row, o):
        return math.log(row[o]) if o == "ttft_ms" and log_ttft else row[o]
    lo = {o: min(value(r, o) for r in feasible) for o in objectives}
    hi = {o: max(value(r, o) for r in feasible) for o in objectives}

    def point(row) -> tuple[float, ...]:
        out = []
        for o in OBJECTIVES:
            if o not in objectives:
                out.append(1.0)
                continue
            x = (value(row, o) - lo[o]) / ((hi[o] - lo[o]) or 1.0)
            out.append(x if MAXIMIZE[o] else 1.0 - x)
        return tuple(out)
    return point


def hypervolume(points) -> float:
    """Exact volume of the union of boxes [0, p] (3 objectives, all maximised, reference 0)."""
    pts = sorted({p for p in points if min(p) > 0}, key=lambda p: -p[2])
    volume = 0.0
    for i, p in enumerate(pts):
        z_next = pts[i + 1][2] if i + 1 < len(pts) else 0.0
        if p[2] > z_next:
            volume += (p[2] - z_next) * _area([q[:2] for q in pts[:i + 1]])
    return volume


def _area(points) -> float:
    area, best_y = 0.0, 0.0
    ordered = sorted(points, key=lambda p: -p[0])
    for i, (x, y) in enumerate(ordered):
        best_y = max(best_y, y)
        x_next = ordered[i + 1][0] if i + 1 < len(ordered) else 0.0
        area += (x - x_next) * best_y
    return area


# ---------------------------------------------------------------- replay


class TableError(Exception):
    """The table cannot answer the replay (a config of the space missing, a bad value)."""


def checked_table(path: str | None, need_feasible: bool = True) -> GridTable:
    """The table, or TableError in one line: a missing or empty file, missing columns, no config
    that ran (nothing to take a volume of)."""
    try:
        table = load_table(path)
    except FileNotFoundError as e:
        raise TableError(f"no table at {e.filename}") from e
    except (KeyError, ValueError, TypeError) as e:
        raise TableError(f"{path or TABLE}: cannot read the table ({type(e).__name__}: {e})") from e
    if not table.rows:
        raise TableError(f"{path or TABLE}: the table holds no config")
    if need_feasible and not any(table.feasible(k) for k in table.rows):
        raise TableError(f"{path or TABLE}: no config of the table ran, so there is no volume to reach")
    return table


def space_keys(study_path: Path) -> set[tuple] | None:
    """The table keys of every config of the study's space (None for a space the table's keys do
    not span: other searched flags)."""
    import itertools

    dims = {d.name: d.grid() for d in load_study(study_path).dimensions}
    names = ("gpu_memory_utilization", "max_model_len", "max_num_seqs")
    if set(dims) != set(names):
        return None
    return {key_of(dict(zip(names, combo))) for combo in itertools.product(*(dims[n] for n in names))}


def check_covers(table: GridTable, study_path: Path, said_as: Path | None = None) -> None:
    """TableError unless the table holds every config of the study's space (a replay asks them)."""
    keys = space_keys(study_path)
    if keys is not None and keys - set(table.rows):
        missing = sorted(keys - set(table.rows))
        raise TableError(f"{len(missing)} of the {len(keys)} configs of {said_as or study_path} are "
                         f"not in the table (e.g. {missing[0]}): pass the --study the table was "
                         "recorded with")


class Reached(TunerError):
    """Raised from the fake measure once the target is met, to stop the tuner's loop."""


class TableDevice:
    """A `measure` that answers from the table and follows the hypervolume of what it launched."""

    def __init__(self, table: GridTable, target_hv: float | None, objectives=OBJECTIVES,
                 log_ttft: bool = True, stop: bool = True):
        self.table = table
        self.target_hv = target_hv
        self.stop = stop            # raise Reached at the target (else note it and go on)
        self.point = normaliser(table, objectives, log_ttft)
        self.launches: list[tuple] = []
        self.points: list[tuple] = []
        self.reached_at: int | None = None
        self.elapsed_s = 0.0        # the recorded launch and load-test seconds of every launch so far
        self.reached_s: float | None = None

    def __call__(self, spec, workload, on_started=None, progress=False) -> TrialOutcome:
        outcome = self.table.outcome(spec)
        key = key_of(spec.params)
        self.launches.append(key)
        row = self.table.rows[key]
        self.elapsed_s += (row.get("launch_s") or 0.0) + (row.get("load_s") or 0.0)
        if self.table.feasible(key):
            self.points.append(self.point(self.table.rows[key]))
        if self.target_hv is not None and self.reached_at is None \
                and hypervolume(self.points) >= self.target_hv - 1e-12:
            self.reached_at = len(self.launches)
            self.reached_s = self.elapsed_s
            if self.stop:
                raise Reached("target hypervolume reached")
        return outcome


class ReplayTuner(Tuner):
    """The real tuner, but the memory model sees the node total each config's launch saw."""

    def __init__(self, cfg: StudyConfig, table: GridTable, measure):
        self.table = table
        platform = Platform("cpu", "CPU (vLLM CPU build, replayed)", table.device_memory_bytes(),
                            None, ("true",), "replay")
        super().__init__(cfg, measure=measure, platform=platform, progress=False)

    def predict(self, params):
        if self.memory_model is None:
            return None
        self.memory_model.device_memory_bytes = self.table.device_memory_bytes(key_of(params))
        return self.memory_model.predict(params)


@dataclass
class RunResult:
    sampler: str
    seed: int
    launches: list            # keys in launch order
    reached_at: int | None    # launches needed for the target, None if never
    kinds: list               # every finished trial's failure kind ("" = ran), skips included
    skipped: list             # keys predicted infeasible (not launched)
    dominated: list = field(default_factory=list)   # keys the screen skipped (predicted_dominated)
    reached_s: float | None = None   # the recorded seconds of the launches until the target
    wasted: int = 0                  # launches that failed (their config could not serve)
    # with --patience: where the tuner stopped by itself, and the share of the grid's volume then
    stopped_s: float | None = None
    hv_share: float | None = None
    front: list = field(default_factory=list)    # the study's own front: objective means and runs
    noise: dict = field(default_factory=dict)    # the study's measured noise
    tie_tolerance: float = 0.02


def replay(table: GridTable, sampler: str, seed: int, memory_model: bool,
           max_launches: int | None = None, stop_at_target: bool = True,
           study_path: Path = STUDY, objectives=OBJECTIVES, screen: bool = False,
           log_ttft: bool = True, within_noise: bool = False, patience: int = 0) -> RunResult:
    """One tuning run of `sampler` against the table, in a throwaway storage. A table recorded
    with its noise (grid-levels: `<table>.noise.json`) answers each launch with its mean times that
    noise, and the tuner replicates its baselines as a study does; the hypervolume is taken on the
    table's means (what each launched config is, not what one launch of it read). With `patience`
    the tuner runs until its own early stop (or the whole grid) and the target is only noted."""
    from optuna.trial import TrialState

    point = normaliser(table, objectives, log_ttft)
    grid = [table.rows[k] for k in table.rows if table.feasible(k)]
    full_hv = hypervolume([point(row) for row in grid])   # the share at a stop is of this one
    if within_noise:   # the target: what the grid holds up to one launch-to-launch CV per objective
        grid = [worse_by_noise(row, table.noise) for row in grid]
    grid_hv = hypervolume([point(row) for row in grid])
    if table.noise:
        table = replace(table, rng=random.Random(f"replay:{seed}"))
    device = TableDevice(table, HV_SHARE * grid_hv if stop_at_target or patience else None, objectives,
                         log_ttft, stop=stop_at_target and not patience)
    budget = max_launches or len(table.rows)
    with tempfile.TemporaryDirectory(prefix="replay-") as tmp:
        cfg = load_study(study_path, {"storage": f"sqlite:///{tmp}/replay.db",
                                      "results_dir": tmp, "sampler": sampler, "seed": seed})
        # without the recording's noise a replicate launch would replay the same figures
        cfg = replace(cfg, use_memory_model=memory_model, screen=screen,
                      replicates=cfg.replicates if table.noise else 0, patience=patience)
        tuner = ReplayTuner(cfg, table, device)
        with contextlib.redirect_stderr(io.StringIO()):
            try:
                study = tuner.run(budget)
            except Reached:
                study = tuner.study
        trials = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        kinds = [t.user_attrs.get("failure", "") for t in trials]
        skipped = [key_of(t.params) for t in trials
                   if t.user_attrs.get("failure") == "predicted_infeasible"]
        dominated = [key_of(t.params) for t in trials
                     if t.user_attrs.get("failure") == "predicted_dominated"]
        frame = report.trials_frame(study, cfg.tie_tolerance)   # the study's own front, as it read it
        front = [{**{o: float(r[o]) for o in OBJECTIVES}, "runs": int(r["runs"]) if pd.notna(r["runs"]) else 1}
                 for _, r in frame[frame["pareto"]].iterrows()]
    wasted = sum(1 for k in device.launches[:device.reached_at] if table.rows[k]["failure"])
    return RunResult(sampler, seed, device.launches, device.reached_at, kinds, skipped, dominated,
                     device.reached_s, wasted, stopped_s=device.elapsed_s,
                     hv_share=hypervolume(device.points) / full_hv if full_hv else None,
                     front=front, noise=frame.attrs.get("noise") or {}, tie_tolerance=cfg.tie_tolerance)


def front_covered(final: RunResult, stopped: RunResult) -> bool:
    """Whether the front a study stopped with equals, within the noise, the front it has at the
    end of the full run: every member of the final front is matched by a stopped-front member
    nowhere worse beyond the noise margin (the final run's measured noise and ties)."""
    def as_good(s: dict, f: dict) -> bool:
        return all(gain >= -margin for gain, margin in report.objective_gains(
            s, f, s["runs"], f["runs"], final.noise, final.tie_tolerance))

    return bool(stopped.front) and all(any(as_good(s, f) for s in stopped.front) for f in final.front)


def worse_by_noise(row: dict, noise: dict) -> dict:
    """The row with each objective one launch-to-launch CV worse: a launched config that reaches
    it is, as far as one more launch could tell, as good as the row."""
    out = dict(row)
    for o in OBJECTIVES:
        cv = noise.get(o, {}).get("cv", 0.0)
        out[o] = row[o] * (1 - cv if MAXIMIZE[o] else 1 + cv)
    return out


def spread(values: list[float]) -> str:
    values = sorted(values)
    if len(values) < 2:
        return f"{values[0]:g}" if values else "-"
    q = statistics.quantiles(values, n=4, method="inclusive")
    return f"IQR {q[0]:g}-{q[2]:g}, range {values[0]:g}-{values[-1]:g}"


# ---------------------------------------------------------------- recording the table


NODE_TOTAL = [re.compile(r"Auto set \([-\d.]+/([\d.]+)\) GiB for KV cache"),
              re.compile(r"Available memory on node \d+ \([-\d.]+/([\d.]+) GiB\)")]


def record(results_dirs: list[Path], out: Path) -> None:
    """trials.csv of the grid run(s), plus the node total vLLM logged at each launch."""
    frames = []
    for results in results_dirs:
        df = pd.read_csv(results / "trials.csv").copy()   # one block: inserting below stays cheap
        df.insert(0, "study", results.name)
        totals = []
        for n in df["trial"]:
            log = results / "trials" / str(n) / "server.log"
            text = log.read_text(errors="replace") if log.exists() else ""
            found = None
            for pattern in NODE_TOTAL:
                m = pattern.search(text)
                if m:
                    found = int(float(m.group(1)) * GIB)
                    break
            totals.append(found)
        df["node_memory_bytes"] = pd.array(totals, dtype="Int64")
        frames.append(df)
    df = pd.concat(frames, ignore_index=True)
    # A config the study did not launch because one with more memory and a shorter context had
    # failed for memory fails the same way (the rule is certain): the table gives it that kind, so
    # a replay that launches it first counts a memory failure, and says which trial it is inferred
    # from; its figures stay blank.
    inferred = []
    for i, row in df.iterrows():
        m = re.match(r"trial (\d+) \((\w+)\) had more memory", str(row.get("failure_message") or ""))
        if row.get("failure") == "predicted_infeasible" and m:
            df.at[i, "failure"] = m.group(2)
            inferred.append(int(m.group(1)))
        else:
            inferred.append(None)
    df["failure_inferred_from"] = pd.array(inferred, dtype="Int64")
    df = df.drop(columns=[c for c in ("log_path", "tuner_host", "tuner_pid", "server_pgid",
                                      "server_port", "command") if c in df.columns])
    out.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(out, index=False)
    print(f"wrote {out}: {len(df)} trials, {int((df['failure'].fillna('') == '').sum())} ran")
    noise_files = [d / "noise.json" for d in results_dirs if (d / "noise.json").exists()]
    if noise_files:   # the recording's launch-to-launch noise, which a replay applies to each launch
        out.with_suffix(".noise.json").write_text(noise_files[0].read_text())
        print(f"wrote {out.with_suffix('.noise.json')}")


def print_patience(name: str, runs: list[RunResult], n: int, patience: int,
                   full: list[RunResult]) -> None:
    """Where the tuner stopped by itself, per seed and as medians: launches, recorded
    wall-clock, the share of the grid's volume its launched configs hold, the target, and whether
    its front then equals (within the noise) the front the same seed ends the whole grid with."""
    stopped = [len(r.launches) for r in runs]
    same = [front_covered(f, r) for r, f in zip(runs, full)]
    shares = [r.hv_share or 0.0 for r in runs]
    reached = [r.reached_at for r in runs if r.reached_at is not None]
    for r, f, ok in zip(runs, full, same):
        print(f"    seed {r.seed}: stopped after {len(r.launches)} launches "
              f"({(r.stopped_s or 0) / 60:.1f} min), volume {r.hv_share or 0:.1%} of the grid's"
              + (f", target reached at launch {r.reached_at}" if r.reached_at else ", target not reached")
              + f"; its front {'equals' if ok else 'misses'} the one it ends with after "
              f"{len(f.launches)} launches ({(f.stopped_s or 0) / 60:.1f} min), within the noise")
    print(f"{name:>6}, patience {patience}: stopped after median {statistics.median(stopped):g} "
          f"launches ({statistics.median(stopped) / n:.0%} of {n}), {spread(stopped)}; recorded "
          f"wall-clock median {statistics.median([(r.stopped_s or 0) / 60 for r in runs]):.1f} min; "
          f"volume at the stop median {statistics.median(shares):.1%} (lowest {min(shares):.1%}); "
          f"the {HV_SHARE:.0%} target reached before the stop in {len(reached)}/{len(runs)} seeds; "
          f"front equal within the noise to the whole grid's run in {sum(same)}/{len(runs)} seeds "
          f"(which took median {statistics.median([len(f.launches) for f in full]):g} launches, "
          f"{statistics.median([(f.stopped_s or 0) / 60 for f in full]):.1f} min)", flush=True)


def load_table(path: str | None) -> GridTable:
    if path == "synthetic":
        return synthetic_table()
    return GridTable.from_csv(Path(path or TABLE))


def describe_table(table: GridTable) -> str:
    kinds: dict[str, int] = {}
    for row in table.rows.values():
        kinds[row["failure"] or "ran"] = kinds.get(row["failure"] or "ran", 0) + 1
    totals = sorted({table.device_memory_bytes(k) for k in table.rows})
    return (f"{len(table.rows)} configs: " + ", ".join(f"{v} {k}" for k, v in sorted(kinds.items()))
            + f"; node total {totals[0] / GIB:.2f}-{totals[-1] / GIB:.2f} GiB")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", help=f"grid CSV (default {TABLE.relative_to(REPO)}; 'synthetic' "
                                    "for a made-up one)")
    ap.add_argument("--samplers", nargs="+", default=list(SAMPLERS), choices=SAMPLERS)
    ap.add_argument("--seeds", type=positive_int, default=20)
    ap.add_argument("--gp-seeds", type=positive_int, default=10, help="GP is slow per trial")
    ap.add_argument("--study", type=Path, default=STUDY,
                    help=f"the study file the table was recorded with (default {STUDY.relative_to(REPO)})")
    ap.add_argument("--no-memory-model", action="store_true")
    ap.add_argument("--screen", action="store_true",
                    help="screen configs with launches already measured (the tuner's default; valid "
                         "only for a table recorded with the same-load protocol)")
    ap.add_argument("--within-noise", action="store_true",
                    help="target 95%% of the volume the grid holds with each of its figures one "
                         "launch-to-launch CV worse (needs the table's noise.json): finding a config "
                         "within the noise of the best counts as finding the best")
    ap.add_argument("--linear-ttft", action="store_true", help="TTFT on a linear scale in the volume")
    ap.add_argument("--objectives", nargs="+", default=list(OBJECTIVES), choices=OBJECTIVES,
                    help="score the hypervolume on these (the tuner still optimises all three)")
    ap.add_argument("--patience", type=nonneg_int, default=0, metavar="N",
                    help="run each seed until the tuner's own early stop (N launches without a "
                         "change of its front beyond the noise) and report where it stopped: "
                         "launches, wall-clock, the share of the grid's volume then")
    ap.add_argument("--record", metavar="RESULTS_DIR", nargs="+",
                    help="write the table from grid runs' results folders and stop")
    return refusing("search_efficiency", run, ap.parse_args(argv))


def refusing(name: str, run, args) -> int:
    """`run(args)`, or one line and exit code 2 for a table or study it cannot use."""
    try:
        return run(args)
    except (TableError, ConfigError, OSError) as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return 2


def run(args) -> int:
    if args.record:
        missing = [d for d in args.record if not (Path(d) / "trials.csv").is_file()]
        if missing:
            raise TableError(f"no trials.csv in {', '.join(missing)}: give grid runs' results folders")
        record([Path(d) for d in args.record], Path(args.table or TABLE))
        return 0
    if not Path(args.study).is_file():
        raise TableError(f"no study file at {args.study}")
    table = checked_table(args.table)
    if args.table != "synthetic":
        check_covers(table, args.study)
    if args.within_noise and not table.noise:
        print("search_efficiency: error: --within-noise needs the table's noise.json", file=sys.stderr)
        return 2
    n = len(table.rows)
    memory_model = not args.no_memory_model
    print(f"table: {describe_table(table)}")
    print(f"memory model {'on' if memory_model else 'off'}, screen {'on' if args.screen else 'off'}; "
          f"target {HV_SHARE:.0%} of the grid's hypervolume"
          f"{' (each grid figure one noise CV worse)' if args.within_noise else ''} over "
          f"{', '.join(args.objectives)}"
          f"{'' if args.linear_ttft else ' (TTFT on a log scale)'}, each normalised by the grid's "
          "feasible range, reference point = the worst value of each; launches count baselines, "
          "replicates and failed launches, not duplicates or skips"
          + ("; each launch jittered by the recording's noise (CV "
             + ", ".join(f"{k} {v['cv']:.1%}" for k, v in table.noise.items()) + ")" if table.noise else ""))
    medians = {}
    for name in args.samplers:
        seeds = args.gp_seeds if name == "gp" else args.seeds
        runs = [replay(table, name, seed, memory_model, objectives=tuple(args.objectives),
                       study_path=args.study, screen=args.screen, log_ttft=not args.linear_ttft,
                       within_noise=args.within_noise, patience=args.patience)
                for seed in range(seeds)]
        if args.patience:
            # the same seeds without the stop, over the whole grid: the front each study ends with
            full = [replay(table, name, seed, memory_model, objectives=tuple(args.objectives),
                           study_path=args.study, screen=args.screen, log_ttft=not args.linear_ttft,
                           stop_at_target=False) for seed in range(seeds)]
            print_patience(name, runs, n, args.patience, full)
            continue
        needed = [r.reached_at if r.reached_at is not None else math.inf for r in runs]
        reached = [x for x in needed if x != math.inf]
        med = statistics.median(needed)
        medians[name] = med
        minutes = [r.reached_s / 60 for r in runs if r.reached_s is not None]
        spent = [len(r.launches[:r.reached_at]) for r in runs]
        wasted = sum(r.wasted for r in runs) / max(1, sum(spent))
        print(f"{name:>6}: median {med:g} launches ({med / n:.0%} of {n}), {spread(reached)}; "
              f"reached in {len(reached)}/{len(runs)} seeds; recorded wall-clock to the target "
              f"median {statistics.median(minutes) if minutes else math.inf:.1f} min "
              f"({spread([round(m, 1) for m in minutes])}); failed launches {wasted:.0%}",
              flush=True)
    limit = 0.15 * n
    random_med = medians.get("random")
    for name, med in medians.items():
        if name in ("random", "grid"):
            continue
        ok_grid = med <= limit
        ok_random = random_med is not None and med <= random_med / 2
        print(f"{name}: median {med:g} <= 15% of the grid ({limit:.1f}): {'yes' if ok_grid else 'NO'}; "
              f"<= half of random's ({'-' if random_med is None else f'{random_med / 2:g}'}): "
              f"{'yes' if ok_random else 'NO'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
