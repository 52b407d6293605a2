"""Results from storage: the trials DataFrame, the noise-aware Pareto set, CSV files and plots."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import pandas as pd

from tuner import engines
from tuner.config import StudyConfig
from tuner.noise import log_margin, noise_estimate, noise_z, tie_margin
from tuner.records import MAXIMIZE, OBJECTIVES, is_feasible  # noqa: F401  (callers read them here)
from tuner.search.trial import extra_runs, over_budget, successful_runs
LABELS = {"single_stream_tok_s": "single-stream speed (tok/s, concurrency 1)",
          "throughput_tok_s": "throughput (steady-state output tok/s, top level)",
          "ttft_ms": "TTFT p50 at the TTFT level (ms, steady state)"}


def param_columns() -> tuple[str, ...]:
    """The flag columns: the engine's flag table, in its order."""
    return tuple(f.name for f in engines.flags())


def first_columns() -> list[str]:
    return ["trial", "state", "failure", *param_columns(), *OBJECTIVES, "pareto", "feasible",
            "baseline"]


PARAMS = param_columns()
FIRST_COLUMNS = first_columns()
SKIPPED = ("duplicate",)


# ---------------------------------------------------------------- the DataFrame

LEVEL_COLUMNS = ("throughput_tok_s", "ttft_ms", "ttft_ms_p90", "tpot_ms", "e2e_ms_p90", "steady")


# trial attrs whose names would read as something else in trials.csv: vLLM's "Maximum concurrency
# for N tokens per request" is not the workload's max_concurrency (the top of the load ladder)
ATTR_COLUMNS = {"max_concurrency": "kv_requests_at_context"}


def trials_frame(study, tie_tolerance: float = 0.02, requirement=None) -> pd.DataFrame:
    """One row per trial (duplicates left out): params, objectives, failure, every measured attr.

    The objective columns are the mean over every successful launch of the config (the trial and
    its replicates or confirmations); `{k}_first` is the trial's own launch, `runs` the count.
    The launch-to-launch noise, estimated from configs launched more than once, is in
    `df.attrs["noise"]` and decides the ties of the `pareto` column.
    """
    from optuna.trial import TrialState

    rows, groups = [], {k: [] for k in OBJECTIVES}
    for t in study.get_trials(deepcopy=False):
        a = t.user_attrs
        if a.get("failure") in SKIPPED or t.state == TrialState.WAITING:
            continue  # repeats of a measured config, and configs queued but never started
        row = {"trial": t.number, "state": t.state.name}
        # Optuna's stepped floats carry binary noise (0.9300000000000002): shown as the step made them
        row.update({k: round(v, 6) if isinstance(v, float) else v for k, v in t.params.items()})
        feasible = is_feasible(t)
        row["feasible"] = feasible
        row.update({f"constraint_{k}": v for k, v in t.constraints.items()})
        row.update({ATTR_COLUMNS.get(k, k): v for k, v in a.items()
                    if k not in ("failure_log_tail", "levels")})
        row.update(level_columns(a.get("levels", [])))
        row.setdefault("failure", "")
        row.setdefault("baseline", "")
        if feasible and requirement is not None and (why := _misses_requirement(t, requirement)):
            # the study file's [requirement] now, which may be stricter than when the trial ran:
            # a config below it is never on the front, nor exported
            feasible = row["feasible"] = False
            row.update(failure="requirement_not_met", failure_message=why,
                       constraint_requirement=1.0)
        if feasible and not row["failure"] and (over := over_budget(a, a.get("memory_budget_gib"))):
            # a trial recorded before the peak was judged against the budget: judged here too
            feasible = row["feasible"] = False
            row.update(failure="over_budget", failure_message=over[1])
        if t.state == TrialState.COMPLETE and feasible:
            runs = successful_runs(study, t)
            failed = [r for r in extra_runs(study, t.number) if r.get("failure")]
            row["runs"] = len(runs)
            row["relaunch_failed"] = failed[0]["failure"] if failed else ""
            for k in OBJECTIVES:
                values = [float(r[k]) for r in runs if r.get(k) is not None]
                row[f"{k}_first"] = t.values[OBJECTIVES.index(k)]
                row[k] = sum(values) / len(values)
                if len(values) >= 2:
                    m = row[k]
                    row[f"{k}_std"] = math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))
                    groups[k].append(values)
        rows.append(row)
    df = pd.DataFrame(rows)
    first = first_columns()
    for col in first:
        if col not in df.columns:
            df[col] = pd.NA if col not in ("pareto", "feasible") else False
    df["failure"] = df["failure"].fillna("")
    df["baseline"] = df["baseline"].fillna("")
    if "relaunch_failed" in df.columns:
        df["relaunch_failed"] = df["relaunch_failed"].fillna("")
    noise = noise_estimate(groups)
    df["pareto"] = pareto_mask(df, tie_tolerance, noise) if len(df) else []
    df["strict_pareto"] = pareto_mask(df, 0.0, None) if len(df) else []
    rest = [c for c in df.columns if c not in first]
    df = df[first + rest].sort_values("trial").reset_index(drop=True)
    blank_coalesced(df)
    df.attrs["noise"] = noise
    df.attrs["defaults"] = defaults_point(study)
    return df


# the defaults baseline's name per engine: "vllm-defaults", "llamacpp-defaults", "sglang-defaults"
DEFAULTS_BASELINES = frozenset(f"{name}-defaults" for name in engines.NAMES)


def _misses_requirement(t, req) -> str:
    """Why a measured trial falls short of `req` (the context it serves, the sequences of that
    context its KV cache held), "" when it meets it or nothing says."""
    from tuner.search import requirement

    context = engines.get().request_context(t.params)
    if requirement.context_shortfall(context, req) > 0:
        return requirement.context_message(engines.get().request_context_name, context, req)
    kv = t.user_attrs.get("kv_cache_tokens")
    if requirement.capacity_shortfall(kv, req) > 0:
        return requirement.capacity_message(kv, req)
    return ""


def measured_feasible(row) -> bool:
    """A trial row measured within every constraint (pareto_mask's test, one row at a time)."""
    return (row.get("state") == "COMPLETE" and bool(row.get("feasible"))
            and all(pd.notna(row.get(k)) for k in OBJECTIVES))


def defaults_point(study) -> dict:
    """The searched flags' values of the defaults baseline (vLLM's defaults snapped into the
    space), {} when the study has none; export prefers it among configs that tie."""
    for t in study.get_trials(deepcopy=False):
        if t.user_attrs.get("baseline") in DEFAULTS_BASELINES and t.params:
            return dict(t.params)
    return {}


def level_columns(levels: list[dict]) -> dict:
    """Flat CSV columns of every load level: c16_throughput_tok_s, c16_ttft_ms, ..."""
    out = {}
    for lv in levels:
        for key in LEVEL_COLUMNS:
            if key in lv:
                out[f"{lv['name']}_{key}"] = lv[key]
    return out


# A TPOT or ITL figure below the gap at which load/metrics.py calls chunks coalesced (one read)
# times no decoding: the streams arrived together (a starved client, a proxy); shown blank, not 0.
_PER_TOKEN = re.compile(r"(^|_)(tpot|itl)_ms(_p\d+|_mean)?$")


def coalesced_floor_ms() -> float:
    from tuner.load.metrics import COALESCED_GAP_S

    return COALESCED_GAP_S * 1e3


def blank_coalesced(df: pd.DataFrame) -> pd.DataFrame:
    """TPOT/ITL columns of `df` (client-side, not the server's `server_itl_ms_mean`) with every
    value below the coalesced floor made NaN, in place."""
    floor = coalesced_floor_ms()
    for col in df.columns:
        if isinstance(col, str) and _PER_TOKEN.search(col) and not col.startswith("server_"):
            values = pd.to_numeric(df[col], errors="coerce")
            df[col] = values.where(~(values < floor))
    return df


def pareto_mask(df: pd.DataFrame, tie_tolerance: float, noise: dict | None = None) -> pd.Series:
    """Feasible trials that no other feasible trial beats beyond the noise on any objective.

    a dominates b when a is nowhere worse than b by more than the tie margin and somewhere better
    by more than it. The margin per objective is the larger of `tie_tolerance` times the value and
    noise_z(dof) standard errors of the difference of the two means, from the measured launch-to-launch
    noise and each config's number of runs. A config whose relaunch failed is not on the front.
    """
    feasible = df["feasible"].astype(bool) & df[list(OBJECTIVES)].notna().all(axis=1)
    if "relaunch_failed" in df.columns:
        feasible &= df["relaunch_failed"].fillna("") == ""
    idx = list(df.index[feasible])
    vals = {i: {k: float(df.at[i, k]) for k in OBJECTIVES} for i in idx}
    runs = {i: int(df.at[i, "runs"]) if "runs" in df.columns and pd.notna(df.at[i, "runs"]) else 1
            for i in idx}

    def dominates(a: int, b: int) -> bool:
        gains = objective_gains(vals[a], vals[b], runs[a], runs[b], noise, tie_tolerance)
        return all(gain >= -margin for gain, margin in gains) and \
            any(gain > margin or (margin == 0 and gain > 0) for gain, margin in gains)

    front = {i for i in idx if not any(dominates(o, i) for o in idx if o != i)}
    if idx and not front:  # ties can in rare cases dominate in a cycle: fall back to the strict front
        return pareto_mask(df, 0.0, None)
    return pd.Series([i in front for i in df.index], index=df.index)


def objective_gains(a: dict, b: dict, runs_a: int, runs_b: int, noise: dict | None,
                    tie_tolerance: float) -> list[tuple[float, float]]:
    """Per objective: how much better config a's mean is than b's (positive = better, whichever
    way the objective points), and the margin within which that difference is a tie."""
    out = []
    for k in OBJECTIVES:
        gain = a[k] - b[k] if MAXIMIZE[k] else b[k] - a[k]
        out.append((gain, tie_margin(k, a[k], b[k], runs_a, runs_b, noise, tie_tolerance)))
    return out


def front_changed(df: pd.DataFrame, previous: set[int], tie_tolerance: float) -> bool:
    """Whether the front of `df` (its "pareto" column) differs beyond the noise from the trials
    `previous`: a member of it left the front, or a new member ties none of the members that
    stayed on every objective (a config within the noise of one already there adds no news)."""
    rows = {int(df.at[i, "trial"]): i for i in df.index[df["pareto"].astype(bool)]}
    if set(previous) - set(rows):
        return True
    noise = df.attrs.get("noise")

    def runs(i) -> int:
        return int(df.at[i, "runs"]) if "runs" in df.columns and pd.notna(df.at[i, "runs"]) else 1

    def ties(a, b) -> bool:
        values = [{k: float(df.at[i, k]) for k in OBJECTIVES} for i in (a, b)]
        return all(abs(gain) <= margin for gain, margin
                   in objective_gains(*values, runs(a), runs(b), noise, tie_tolerance))

    stayed = [rows[n] for n in previous]
    return any(not any(ties(rows[n], old) for old in stayed) for n in set(rows) - set(previous))


def outcome(row) -> str:
    """pareto | dominated | infeasible | failed, for plotting."""
    if row["state"] != "COMPLETE":
        return "failed"
    if not row["feasible"]:
        return "infeasible"
    return "pareto" if row["pareto"] else "dominated"


# ---------------------------------------------------------------- files


def write_trials(study, cfg: StudyConfig) -> pd.DataFrame:
    """results/<study>/trials.csv, rewritten after every trial (cheap: no plotting)."""
    df = trials_frame(study, cfg.tie_tolerance, cfg.requirement)
    folder = cfg.results_path
    folder.mkdir(parents=True, exist_ok=True)
    _write_csv(df, folder / "trials.csv")
    return df


def write_all(study, cfg: StudyConfig, prefer: str = "balanced") -> pd.DataFrame:
    """trials.csv, pareto.csv, levels.csv, noise.json, contexts.csv, the plots, best-command.sh,
    report.html;
    then the outputs of an earlier report that storage no longer backs are removed."""
    import json

    from tuner.results import contexts, export, html

    df = write_trials(study, cfg)
    folder = cfg.results_path
    front = df[df["pareto"]]
    _write_csv(front, folder / "pareto.csv")
    offered, warning = export.offered_front(df, cfg.tie_tolerance)
    levels = levels_frame(study)
    _write_csv(levels, folder / "levels.csv")
    (folder / "noise.json").write_text(json.dumps(df.attrs.get("noise", {}), indent=2) + "\n")
    _write_csv(contexts.context_frame(df), folder / "contexts.csv")
    written = {"trials.csv", "pareto.csv", "levels.csv", "noise.json", "report.html", "contexts.csv"}
    written |= {p.name for p in plot_all(df, folder, title=cfg.name, levels=levels)}
    if len(offered):
        noise = df.attrs.get("noise")
        row = export.choose(offered, prefer, noise, cfg.tie_tolerance)
        why = export.choice_note(offered, row, prefer, noise, cfg.tie_tolerance)
        (folder / "best-command.sh").write_text(
            export.script(row, study, cfg, warning=warning, prefer=prefer, why=why, df=df))
        written.add("best-command.sh")
    html.write(study, cfg, df, levels)
    remove_stale(folder, written, study)
    return df


# What a report writes into results/NAME/: only these names (and trials/<number>/*.log) are ever
# removed as stale, never anything a person put there.
REPORT_OUTPUTS = ("trials.csv", "pareto.csv", "levels.csv", "noise.json", "report.html",
                  "best-command.sh", "pareto.png", "parameters.png", "curves.png", "contexts.csv")


def remove_stale(folder: Path, written: set[str], study) -> list[Path]:
    """Remove from `folder` (results/NAME/) the report outputs this report did not write (a
    best-command.sh when nothing is feasible now, a plot with nothing to draw) and the launch logs
    of trials storage no longer holds (trials/N/*.log, then the folder if that emptied it), as
    when the study was created anew at the same storage URL. Returns what was removed."""
    removed = []
    for name in REPORT_OUTPUTS:
        path = folder / name
        if name not in written and path.is_file() and not path.is_symlink():
            path.unlink()
            removed.append(path)
    trials = folder / "trials"
    if not trials.is_dir() or trials.is_symlink():
        return removed
    # listed before storage is read: a trial asked meanwhile is in storage by the time its
    # folder could be in this list, so a running study never loses a live log
    listed = [p for p in trials.iterdir() if p.is_dir() and not p.is_symlink()
              and p.name.isdigit() and str(int(p.name)) == p.name]
    numbers = {t.number for t in study.get_trials(deepcopy=False)}
    for path in listed:
        if int(path.name) in numbers:
            continue
        for log in path.glob("*.log"):
            if log.is_file() and not log.is_symlink():
                log.unlink()
                removed.append(log)
        try:
            path.rmdir()    # only when the logs were all it held
            removed.append(path)
        except OSError:
            pass
    return removed


def level_frame_columns() -> list[str]:
    """levels.csv's columns, also when nothing was measured (a header, never an empty file)."""
    from dataclasses import fields

    from tuner.records import LevelMetrics

    return ["trial", "launch", "kind", *(f.name for f in fields(LevelMetrics)), "coalesced",
            "single_stream_source"]


def levels_frame(study) -> pd.DataFrame:
    """One row per launch and load level: each config's throughput-latency curve, every run.

    `coalesced`: most of the level's chunks arrived together, so its TPOT/ITL figures time no
    decoding (those below the coalesced floor are blank). `single_stream_source` (single_stream
    rows): see single_stream_source."""
    from optuna.trial import TrialState

    floor = coalesced_floor_ms()
    rows = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        launches = [("trial", t.user_attrs.get("levels", []), t.user_attrs)]
        launches += [(r.get("kind", "run"), r.get("levels", []), r) for r in extra_runs(study, t.number)]
        for i, (kind, levels, attrs) in enumerate(launches):
            for lv in levels:
                row = {"trial": t.number, "launch": i, "kind": kind, **lv}
                itl = _number(lv.get("itl_ms"))
                row["coalesced"] = itl is not None and itl < floor
                if lv.get("name") == "single_stream":
                    row["single_stream_source"] = single_stream_source(lv, attrs, row["coalesced"])
                rows.append(row)
    if not rows:
        return pd.DataFrame(columns=level_frame_columns())
    return blank_coalesced(pd.DataFrame(rows))


def single_stream_source(level: dict, attrs: dict, coalesced: bool) -> str:
    """Where a launch's single-stream figure came from (load/metrics.summarize): "client" (the
    streams' own timing), "server_itl" or "server_decode" (the server's counters, the streams having
    arrived together), "untimed" (coalesced, nothing stood in), "" (not measured). A replicate's
    run record keeps no source: its server-side figure reads "server"."""
    if _number(level.get("decode_tok_s")) is not None:
        return "client"
    stored = attrs.get("single_stream_source")
    if stored and stored != "client":
        return str(stored)
    if _number(attrs.get("single_stream_tok_s")) is not None:
        return "server"
    return "untimed" if coalesced else ""


def _number(value) -> float | None:
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _write_csv(df: pd.DataFrame, path: Path) -> None:
    tmp = path.with_suffix(f".{os.getpid()}.tmp")   # workers of one study write side by side
    df.to_csv(tmp, index=False)
    tmp.replace(path)


# ---------------------------------------------------------------- plots

STYLE = {"pareto": dict(color="#d62728", marker="*", s=160, zorder=4, label="Pareto set"),
         "dominated": dict(color="#7f7f7f", marker="o", s=40, alpha=0.6, zorder=3,
                           label="dominated"),
         "infeasible": dict(color="#ff7f0e", marker="x", s=60, zorder=2,
                            label="infeasible (measured, missed a constraint)"),
         "failed": dict(color="#000000", marker="s", s=30, zorder=1, label="failed")}
# A front member that a strict Pareto member beats on every objective, kept only because the
# difference is within the noise: the same star, hollow.
TIE_STYLE = dict(facecolors="none", edgecolors="#d62728", linewidths=1.4, marker="*", s=160,
                 zorder=4, label="Pareto set: ties within noise (a strict member beats it)")
STRICT_LABEL = "Pareto set (strict: nothing beats it)"
# Configs never launched, each for its reason: their own marker, never "infeasible".
NOT_LAUNCHED = {
    "predicted_dominated": dict(color="#9467bd", marker="v", label="not launched: predicted dominated"),
    "predicted_infeasible": dict(color="#8c564b", marker="1",
                                 label="not launched: predicted not to fit"),
    "gpu_busy": dict(color="#17becf", marker="p", label="not launched: GPU busy"),
    "budget_spent": dict(color="#bcbd22", marker="h", label="not launched: budget spent"),
}


def plot_kind(row) -> str:
    """outcome(row), with "tie" for a front member that is no strict Pareto member, and
    "skip:KIND" for a config never launched (NOT_LAUNCHED)."""
    failure = row.get("failure")
    if isinstance(failure, str) and failure in NOT_LAUNCHED:
        return f"skip:{failure}"
    kind = outcome(row)
    strict = row.get("strict_pareto")
    if kind == "pareto" and strict is not None and not pd.isna(strict) and not bool(strict):
        return "tie"
    return kind


def plot_all(df: pd.DataFrame, folder: Path, title: str = "",
             levels: pd.DataFrame | None = None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    paths = [plot_projections(df, folder / "pareto.png", title),
             plot_parameters(df, folder / "parameters.png", title)]
    if levels is not None and not levels.empty and {"throughput_tok_s", "ttft_ms"} <= set(levels.columns) \
            and levels[["throughput_tok_s", "ttft_ms"]].notna().all(axis=1).any():
        paths.append(plot_curves(df, levels, folder / "curves.png", title))
    return paths


def plot_curves(df: pd.DataFrame, levels: pd.DataFrame, path: Path, title: str = "") -> Path:
    """Each measured config's throughput-latency curve over the workload's levels (first launch)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    first = levels[(levels["launch"] == 0) & levels["throughput_tok_s"].notna()
                   & levels["ttft_ms"].notna()]
    front = set(df[df["pareto"]]["trial"].astype(int))
    # the baselines are named in the legend, on the front or off it (dashed black), as the page
    # promises they are marked in every plot
    baselines = {int(t): str(b) for t, b in zip(df["trial"], df["baseline"].fillna(""))
                 if b} if "baseline" in df.columns else {}
    dashed = False
    for number, part in first.groupby("trial"):
        part = part.sort_values([c for c in ("request_rate", "concurrency") if c in part.columns],
                                na_position="first")
        on = int(number) in front
        name = baselines.get(int(number))
        label = f"trial {int(number)}" + (f" (baseline {name})" if name else "")
        if on:
            style = dict(ms=6, lw=2, alpha=0.95, color=None, label=label)
        elif name:
            style = dict(ms=4, lw=1.2, alpha=0.8, color="#000000", ls="--", label=label)
            dashed = True
        else:
            style = dict(ms=4, lw=0.8, alpha=0.35, color="#7f7f7f", label=None)
        ax.plot(part["throughput_tok_s"], part["ttft_ms"], marker="o", **style)
    ax.set_xlabel("output tok/s at the level (steady state; whole level where it has none)")
    ax.set_ylabel("TTFT p50 at the level (ms)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, title="Pareto set" + (", baselines off it (dashed)" if dashed else ""))
    ax.set_title(f"{title}: load curves, one point per level (grey: off the front"
                 + ("; dashed black: a baseline off the front)" if dashed else ")"), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_projections(df: pd.DataFrame, path: Path, title: str = "") -> Path:
    """pareto.png: projections_figure saved and closed."""
    import matplotlib.pyplot as plt

    fig = projections_figure(df, title)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def projections_figure(df: pd.DataFrame, title: str = ""):
    """The three pairwise projections of the objectives; failures counted in the title. Front
    members carry their trial numbers and their spread (± over runs, else the study's noise) as
    error bars; strict Pareto members are filled stars, members kept only as ties within the noise
    hollow ones."""
    import matplotlib.pyplot as plt

    pairs = [("single_stream_tok_s", "throughput_tok_s"), ("ttft_ms", "throughput_tok_s"),
             ("ttft_ms", "single_stream_tok_s")]
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2))
    measured = df[df[list(OBJECTIVES)].notna().all(axis=1)]
    kinds = measured.apply(plot_kind, axis=1) if len(measured) else pd.Series(dtype=str)
    noise = df.attrs.get("noise")
    front = measured[kinds.isin(["pareto", "tie"])]
    spreads = {k: [spread(row, k, noise) for _, row in front.iterrows()] for k in OBJECTIVES}
    for ax, (x, y) in zip(axes, pairs):
        for kind in ("dominated", "infeasible", "tie", "pareto"):
            part = measured[kinds == kind]
            if not len(part):
                continue
            style = TIE_STYLE if kind == "tie" else \
                dict(STYLE["pareto"], label=STRICT_LABEL) if kind == "pareto" and \
                "strict_pareto" in df.columns else STYLE[kind]
            ax.scatter(part[x], part[y], **style)
        if len(front):
            xerr = pd.Series(spreads[x], index=front.index)
            yerr = pd.Series(spreads[y], index=front.index)
            has = xerr.notna() | yerr.notna()
            if has.any():
                ax.errorbar(front[x][has], front[y][has], xerr=xerr[has].fillna(0).to_numpy(),
                            yerr=yerr[has].fillna(0).to_numpy(), fmt="none", ecolor="#d62728",
                            elinewidth=0.8, alpha=0.6, capsize=2, zorder=3)
            for _, row in front.iterrows():
                ax.annotate(str(int(row["trial"])), (row[x], row[y]), textcoords="offset points",
                            xytext=(6, 5), fontsize=8, color="#d62728")
        for _, row in measured[measured["baseline"] != ""].iterrows():
            ax.annotate(row["baseline"], (row[x], row[y]), textcoords="offset points",
                        xytext=(6, -12), fontsize=8, color="#1f77b4")
            ax.scatter([row[x]], [row[y]], facecolors="none", edgecolors="#1f77b4", s=220,
                       linewidths=1.5, zorder=5)
        ax.set_xlabel(LABELS[x] + ("  ← better" if not MAXIMIZE[x] else "  better →"))
        ax.set_ylabel(LABELS[y] + "  better ↑")
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    handles.append(plt.scatter([], [], facecolors="none", edgecolors="#1f77b4", s=120))
    labels.append("baseline")
    if len(front) and any(pd.notna(v) for vs in spreads.values() for v in vs):
        handles.append(plt.Line2D([], [], color="#d62728", lw=0.8, alpha=0.6))
        labels.append("± spread (over runs, else the study's noise)")
    axes[0].legend(handles, labels, fontsize=8, loc="best")
    counts = df["failure"].replace("", pd.NA).dropna().value_counts()
    unmeasured = ", ".join(f"{k} ×{v}" for k, v in counts.items() if k != "load_test_failed")
    fig.suptitle(f"{title}: {plural(len(measured), 'measured config')}"
                 + (f"; failed, skipped or infeasible: {unmeasured}" if unmeasured else "")
                 + ("; numbers: trials on the front" if len(front) else ""), fontsize=11)
    fig.tight_layout()
    return fig


def _map_flags(df: pd.DataFrame):
    """The flags the fit map draws, from the engine's table: x the one that demands memory
    (vLLM: max_model_len), y the one that supplies it (gmu) or the next, marker size the next
    required one (max_num_seqs); None where the table has none."""
    numeric = [f for f in engines.flags() if f.kind in ("int", "float") and f.name in df.columns]
    x = next((f for f in numeric if f.memory == "demand"), numeric[0] if numeric else None)
    y = next((f for f in numeric if f.memory == "supply"), next((f for f in numeric if f is not x), None))
    size = next((f for f in numeric if f not in (x, y) and f.required), None)
    return x, y, size


def plot_parameters(df: pd.DataFrame, path: Path, title: str = "") -> Path:
    """parameters.png: parameters_figure saved and closed."""
    import matplotlib.pyplot as plt

    fig = parameters_figure(df, title)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parameters_figure(df: pd.DataFrame, title: str = ""):
    """Where the good configs live: gmu × max-model-len (size = max-num-seqs), and parallel
    coordinates. A config never launched has its reason's own marker (NOT_LAUNCHED)."""
    import matplotlib.pyplot as plt
    import numpy as np

    fx, fy, fsize = _map_flags(df)
    xcol, ycol = (fx.name if fx else "trial"), (fy.name if fy else "trial")

    fig, (ax, pc) = plt.subplots(1, 2, figsize=(16, 5.5), gridspec_kw={"width_ratios": [1, 1.4]})
    kinds = df.apply(plot_kind, axis=1) if len(df) else pd.Series(dtype=str)
    mem = df["failure"].isin(["kv_cache_too_small", "oom", "no_cache_blocks",
                              "insufficient_free_memory", "cpu_offload"])
    style = {k: dict(v) for k, v in STYLE.items()}
    style["infeasible"]["label"] = "infeasible (launched)"
    style["tie"] = dict(TIE_STYLE)
    style["pareto"]["label"] = STRICT_LABEL if "strict_pareto" in df.columns else "Pareto set"
    for failure, st in NOT_LAUNCHED.items():
        style[f"skip:{failure}"] = dict(st, s=60, zorder=2)
    order = ["failed", *(f"skip:{f}" for f in NOT_LAUNCHED), "infeasible", "dominated", "tie",
             "pareto"]
    for kind in order:
        part = df[(kinds == kind) & df[xcol].notna()]
        if len(part):
            sizes = (30 + 12 * np.log2(part[fsize.name].astype(float).clip(lower=1))) if fsize else 40.0
            st = dict(style[kind])
            st["s"] = sizes * (2 if kind in ("pareto", "tie") else 1)
            ax.scatter(part[xcol].astype(float), part[ycol].astype(float), **st)
    for _, row in df[mem & df[xcol].notna()].iterrows():
        ax.annotate(row["failure"].replace("_", " "), (row[xcol], row[ycol]), fontsize=6,
                    color="#ff7f0e", textcoords="offset points", xytext=(4, 4))
    # the baselines, circled and named as in the projections (the page says every plot marks them)
    based = df[(df["baseline"].fillna("") != "") & df[xcol].notna() & df[ycol].notna()] \
        if "baseline" in df.columns else df.iloc[0:0]
    for n, (_, row) in enumerate(based.iterrows()):
        ax.scatter([float(row[xcol])], [float(row[ycol])], facecolors="none", edgecolors="#1f77b4",
                   s=260, linewidths=1.5, zorder=5, label="baseline" if n == 0 else None)
        ax.annotate(str(row["baseline"]), (float(row[xcol]), float(row[ycol])), fontsize=7,
                    color="#1f77b4", textcoords="offset points", xytext=(6, -12))
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"{fx.cli if fx else 'trial'} (log scale)")
    ax.set_ylabel(f"{fy.cli if fy else 'trial'} (searched value)")
    ax.set_title("where configs fit" + (f" (marker size: {fsize.cli})" if fsize else ""))
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:   # nothing drawn yet: no empty legend (and no warning)
        ax.legend(fontsize=8, loc="best")

    axes_cols = [c for c in (*(f.name for f in engines.flags() if f.kind in ("int", "float")),
                             *OBJECTIVES) if c in df.columns
                 and pd.to_numeric(df[c], errors="coerce").notna().any()]
    data = df[axes_cols].apply(pd.to_numeric, errors="coerce")
    lo, hi = data.min(), data.max()
    scaled = (data - lo) / (hi - lo).replace(0, 1)
    xs = np.arange(len(axes_cols))
    for kind in order:
        for i in df.index[kinds == kind]:
            ys = scaled.loc[i].to_numpy(dtype=float)
            on = kind in ("pareto", "tie")
            colour = style[kind].get("color", style[kind].get("edgecolors"))
            pc.plot(xs, ys, color=colour, alpha=0.9 if kind == "pareto" else 0.35,
                    lw=2.2 if on else 1,
                    ls="-" if kind in ("pareto", "tie", "dominated") else ":" if kind.startswith("skip:")
                    else "--")
    pc.set_xticks(xs, [_axis_name(c) for c in axes_cols], fontsize=8)
    for x, c in zip(xs, axes_cols):
        pc.annotate(_axis_end(lo[c]), (x, -0.04), ha="center", fontsize=7, va="top")
        pc.annotate(_axis_end(hi[c]), (x, 1.02), ha="center", fontsize=7)
    pc.set_yticks([])
    pc.set_ylim(-0.12, 1.1)
    pc.set_title("parallel coordinates (red: Pareto set, faint red: its ties within noise, grey: "
                 "dominated, dashed: infeasible/failed, dotted: not launched)", fontsize=9)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


def _axis_name(column: str) -> str:
    """A parallel-coordinates axis: "single\nstream\ntok/s", not "single\nstream\ntok\ns"."""
    for suffix, unit in (("_tok_s", "\ntok/s"), ("_ms", "\nms"), ("_gb", "\nGB")):
        if column.endswith(suffix):
            return column[:-len(suffix)].replace("_", "\n") + unit
    return column.replace("_", "\n")


def _axis_end(value: float) -> str:
    """An axis end as a reader reads it: 32,768 and 2,864 (":.3g" wrote 3.28e+04), 0.05, 61.3."""
    if pd.isna(value):
        return ""
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"


def describe_noise(noise: dict | None) -> str:
    """One line on the launch-to-launch noise that decides ties."""
    if not noise:
        return ("launch-to-launch noise: not measured yet (no config launched twice); ties use the "
                "tie tolerance alone")
    parts = [f"{k} {v['cv'] * 100:.1f} %" for k, v in noise.items()]
    dof = max(v["dof"] for v in noise.values())
    line = (f"launch-to-launch noise (coefficient of variation, {dof} degrees of freedom): "
            + ", ".join(parts) + f"; differences within {noise_z(dof):.2f} standard errors (Student's t) "
            "are ties" + ("; `run --confirm 1` relaunches the front to narrow them" if dof < 6 else ""))
    # so wide that configs one launch each cannot be told apart unless one is 1.5x the other
    wide = {k: math.exp(log_margin(k, 1, 1, noise)) for k in noise}
    wide = {k: x for k, x in wide.items() if x >= 1.5}
    if wide:
        line += ("\nWARNING: the noise is too wide to rank configs launched once: "
                 + ", ".join(f"{k} ties up to {x:.1f}x" for k, x in wide.items())
                 + "; most measured configs can sit on the front. Quiet the machine, lengthen the "
                   "levels ([workload] level_seconds), or relaunch (`--confirm 2`, more replicates)")
    return line


def describe_machines(df: pd.DataFrame) -> str:
    """One line when the launches ran on more than one machine ("" otherwise): the noise comes from
    relaunches, mostly on one machine, and does not cover what another host changes (the 32B study
    read 3.8 and 2.5 tok/s for one offload config on two H100 hosts)."""
    if "machine" not in df.columns:
        return ""
    launched = df[df["machine"].notna() & (df["machine"] != "")]
    if "launch_s" in df.columns:   # a config screened without a launch records its machine too
        launched = launched[launched["launch_s"].notna()]
    if launched["machine"].nunique() < 2:
        return ""
    spans = []
    for machine, rows in launched.groupby("machine", sort=False):
        trials = sorted(int(t) for t in rows["trial"])
        spans.append(f"{machine} (trial{'s' if len(trials) > 1 else ''} {_ranges(trials)})")
    return (f"machines: launches ran on {launched['machine'].nunique()}: " + ", ".join(spans)
            + ". The launch-to-launch noise does not cover a change of machine: compare configs "
              "measured on one, or relaunch them on one (`run --confirm 1`, `measure`)")


def _ranges(numbers: list[int]) -> str:
    """[1, 2, 3, 7, 9, 10] -> "1-3, 7, 9-10"."""
    out, start = [], None
    for i, n in enumerate(numbers):
        if start is None:
            start = n
        if i + 1 == len(numbers) or numbers[i + 1] != n + 1:
            out.append(f"{start}" if start == n else f"{start}-{n}")
            start = None
    return ", ".join(out)


LAUNCH_PHASE_COLUMNS = ("launch_engine_start_s", "launch_weights_s", "launch_compile_s", "launch_profile_s",
                        "launch_graphs_s", "launch_warmup_s", "launch_other_s")


def describe_front_watch(study, patience: int = 0) -> str:
    """One line on how long the front has held (what --patience counts), "" before any record."""
    from optuna.trial import TrialState

    from tuner.search.study import launched_count

    watch = study.user_attrs.get("front_watch")
    if not watch or not watch.get("front"):
        return ""
    launched = launched_count(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL)))
    still = max(0, launched - int(watch["changed_at"]))
    rule = (f"--patience {patience} stops after {patience} unchanged" if patience
            else "--patience N stops after N launches leave it unchanged")
    if still == 0:
        return f"front: changed by the last launch ({plural(launched, 'launch')} so far; {rule})"
    return (f"front: unchanged beyond the noise for the last {still} of {plural(launched, 'launch')} "
            f"(last changed by launch {watch['changed_at']}; {rule})")


def plural(n: int, word: str) -> str:
    """"1 launch", "3 launches", "2 configs"."""
    return f"{n} {word}" if n == 1 else f"{n} {word}{'es' if word.endswith(('s', 'ch')) else 's'}"


def describe_launch(df: pd.DataFrame) -> str:
    """One line on where launch time goes: the median launch and the median of each logged phase."""
    if "launch_s" not in df.columns or df["launch_s"].dropna().empty:
        return ""
    parts = [f"{c[len('launch_'):-2]} {df[c].median():.1f} s" for c in LAUNCH_PHASE_COLUMNS
             if c in df.columns and not df[c].dropna().empty]
    line = (f"launch: median {df['launch_s'].median():.1f} s over the first launch of "
            f"{plural(int(df['launch_s'].count()), 'trial')}")
    line += " (median phases: " + ", ".join(parts) + ")" if parts else ""
    # a run's first launch imports the engine itself; the later ones find a warm spare that did
    # (launch_preimport_s): what a long run's launches cost
    if "launch_preimport_s" in df.columns:
        launched = df[df["launch_s"].notna()]
        warm = launched["launch_preimport_s"].notna()
        if warm.any() and not warm.all():
            line += (f"; {launched.loc[warm, 'launch_s'].median():.1f} s over the "
                     f"{plural(int(warm.sum()), 'launch')} after the first of their run")
    return line


def describe_empty_front(df: pd.DataFrame) -> str:
    """Why a study has no Pareto set yet: every trial so far failed or broke a constraint."""
    kinds = df.loc[df["failure"] != "", "failure"].value_counts()
    if kinds.empty:
        return "Pareto set: none yet (no trial has been measured)"
    said = ", ".join(f"{kind} {n}" for kind, n in kinds.items())
    return f"Pareto set: none yet; no trial has met every constraint ({said})"


def spread(row: pd.Series, key: str, noise: dict | None) -> float:
    """The standard deviation of objective `key` over the config's runs; with one run, the
    launch-to-launch noise of the study (its coefficient of variation times the value); NaN when
    neither was measured."""
    std = row.get(f"{key}_std")
    if std is not None and pd.notna(std):
        return float(std)
    cv = (noise or {}).get(key, {}).get("cv")
    return float(row[key]) * cv if cv else math.nan


def figure(value: float, sd: float) -> str:
    """A figure with its spread: "366.9 ± 61.8", or the figure alone where none was measured."""
    if pd.isna(value):
        return ""
    return f"{value:.1f}" + ("" if pd.isna(sd) else f" ± {sd:.1f}")


def describe_figures(row: pd.Series, noise: dict | None) -> str:
    """One config's objectives with their spreads, in words: "trial 4: single stream 370.4 ± 2.6
    tok/s, throughput 5,206.5 ± 130.2 tok/s, TTFT p50 53.3 ± 9.0 ms (1 run)"."""
    runs = int(row["runs"]) if "runs" in row and pd.notna(row["runs"]) else 1
    parts = []
    for key, name, unit in (("single_stream_tok_s", "single stream", "tok/s"),
                            ("throughput_tok_s", "throughput", "tok/s"), ("ttft_ms", "TTFT p50", "ms")):
        sd = spread(row, key, noise)
        parts.append(f"{name} {row[key]:,.1f}" + ("" if pd.isna(sd) else f" ± {sd:,.1f}") + f" {unit}")
    return f"trial {int(row['trial'])}: {', '.join(parts)} ({runs} run{'s' if runs != 1 else ''})"


def _flag_text(value, kind: str) -> str:
    """A flag's value as the command line spells it: an int flag never as 4096.0 (a column of a
    trial without params, a pruned or failed one, turns the whole column float), blank when unset."""
    if value is None or (not isinstance(value, str) and pd.isna(value)):
        return ""
    if kind == "int":
        try:
            return str(int(float(value)))
        except (TypeError, ValueError):
            return str(value)
    if kind == "float":
        try:
            return f"{float(value):.2f}" if float(value) == round(float(value), 2) else f"{float(value):g}"
        except (TypeError, ValueError):
            return str(value)
    return str(value)


def table(df: pd.DataFrame, columns: list[str] | None = None) -> str:
    # the three flags always, any other flag where a trial set it (a searched cpu_offload_gb)
    flags = [f.name for f in engines.flags()
             if f.required or (f.name in df.columns and df[f.name].notna().any())]
    cols = columns or ["trial", "state", "failure", *flags, *OBJECTIVES, "runs", "pareto", "baseline"]
    cols = [c for c in cols if c in df.columns]
    view = df[cols].copy()
    noise = df.attrs.get("noise")
    for c in OBJECTIVES:
        if c in view:   # each figure with its spread: over the config's runs, else the study's noise
            view[c] = [figure(row[c], spread(row, c, noise)) for _, row in df.iterrows()]
    if "runs" in view:
        view["runs"] = view["runs"].map(lambda v: "" if pd.isna(v) else str(int(v)))
    for f in engines.flags():
        if f.name in view:
            view[f.name] = view[f.name].map(lambda v, kind=f.kind: _flag_text(v, kind))
    # pd.NA (a trial with no params or attrs yet) prints as "<NA>" whatever na_rep says
    view = view.astype(object).where(view.notna(), "")
    return view.to_string(index=False, na_rep="")


def _cell_text(value) -> str:
    """One value of `all_columns_text`: floats to 6 significant digits, blank when missing."""
    if value is None or (not isinstance(value, (str, list, dict, tuple)) and pd.isna(value)):
        return ""
    if isinstance(value, float):
        # whole numbers whole: a column a failed trial leaves blank is float, and 6 digits wrote a
        # KV cache of 1,234,567 tokens or a pgid as 1.23457e+06
        return str(int(value)) if value.is_integer() and abs(value) < 1e15 else f"{value:.6g}"
    return str(value)


def all_columns_text(df: pd.DataFrame) -> str:
    """Every recorded column (`show --all-columns`), one block per trial rather than one line per
    trial: a study records over a hundred columns, which as one table is thousands of characters
    wide. The values every trial shares come once at the top; within a trial only the columns it
    has a value in, the objectives first with their spread (`_std` columns folded into the ±)."""
    if df.empty:
        return ""
    noise = df.attrs.get("noise")
    head = [c for c in ("trial", "state", "failure", "pareto", "strict_pareto", "feasible",
                        "baseline") if c in df.columns]
    objective = [c for c in OBJECTIVES if c in df.columns]
    rest = [c for c in df.columns if c not in head and c not in objective
            and not (isinstance(c, str) and c.endswith("_std") and c[:-4] in OBJECTIVES)]
    cells = {c: [_cell_text(v) for v in df[c]] for c in rest}
    shared = [c for c in rest if len(df) > 1 and len(set(cells[c])) == 1 and cells[c][0] != ""]
    rest = [c for c in rest if c not in shared]
    lines = []
    if shared:
        width = max(len(str(c)) for c in shared)
        lines.append(f"every trial ({plural(len(df), 'trial')}):")
        lines += [f"  {str(c):<{width}}  {cells[c][0]}" for c in shared]
        lines.append("")
    for i, (_, row) in enumerate(df.iterrows()):
        title = [f"trial {int(row['trial'])}", str(row.get("state", ""))]
        if row.get("failure"):
            title.append(str(row["failure"]))
        if row.get("pareto") is True or row.get("pareto") == True:   # noqa: E712 (numpy bools)
            strict = row.get("strict_pareto")
            tie = strict is not None and not pd.isna(strict) and not bool(strict)
            title.append("Pareto (a tie within the noise)" if tie else "Pareto")
        if row.get("baseline"):
            title.append(f"baseline {row['baseline']}")
        pairs = [(k, figure(row[k], spread(row, k, noise))) for k in objective if pd.notna(row[k])]
        pairs += [(c, cells[c][i]) for c in rest if cells[c][i] != ""]
        lines.append("  ".join(title))
        if pairs:
            width = max(len(str(k)) for k, _ in pairs)
            lines += [f"  {str(k):<{width}}  {v}" for k, v in pairs]
        lines.append("")
    return "\n".join(lines).rstrip("\n")
