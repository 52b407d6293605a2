"""Two or more studies' fronts side by side (e.g. the same model and workload on vLLM and on
llama.cpp): a table, compare.csv and compare.png, built from storage like `report`."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from tuner import engines
from tuner.config import StudyConfig
from tuner.errors import TunerError
from tuner.results.report import LABELS, MAXIMIZE, OBJECTIVES, figure, spread

SHORT = {"single_stream_tok_s": "single-stream tok/s", "throughput_tok_s": "throughput tok/s",
         "ttft_ms": "TTFT p50 ms"}
CSV_COLUMNS = ["study", "engine", "trial", "flags", *OBJECTIVES,
               *(f"{k}_spread" for k in OBJECTIVES), "runs", "balanced", "strict_pareto"]


@dataclass
class Side:
    """One study of the comparison, read while its engine was the one in use."""

    label: str
    cfg: StudyConfig
    engine: str                 # the engine's label: "vLLM", "llama.cpp"
    platform: str               # "cpu", "cuda NVIDIA H200 (139.8 GiB)", ...
    trials: int                 # trials stored (duplicates left out)
    measured: int               # trials with all three objectives
    front: pd.DataFrame         # one row per member: trial, flags, objectives, spreads, runs
    command: str                # the exported command of the balanced pick ("" without a front)
    warning: str = ""           # export's warning about the offered front


def platform_of(df: pd.DataFrame) -> str:
    """Where the study's trials ran, from the first trial that says."""
    if "platform" not in df.columns or df["platform"].dropna().empty:
        return "unknown"
    row = df[df["platform"].notna()].iloc[0]
    kind, name = str(row["platform"]), row.get("gpu_name")
    total = row.get("gpu_memory_total_gib")
    text = name if isinstance(name, str) and name else kind
    if total is not None and pd.notna(total):
        text += f", {float(total):.1f} GiB"
    return text


def load_side(cfg: StudyConfig, label: str) -> Side:
    """Everything the comparison shows of one study. The engine in use must be the study's (as
    `config.load_study` leaves it): the flag table and the export read it."""
    from tuner.results import export, report
    from tuner.search.storage import load_existing

    engines.use(cfg.engine_name)
    study = load_existing(cfg)
    df = report.trials_frame(study, cfg.tie_tolerance, cfg.requirement)
    if df.empty:
        raise TunerError(f"study {cfg.name} ({cfg.source}) has no stored trials in {cfg.storage}: "
                         "run `python -m tuner run` for it first")
    noise = df.attrs.get("noise")
    offered, warning = export.offered_front(df, cfg.tie_tolerance)
    rows, command, pick = [], "", None
    # strict: no member beats it on every objective at all (ties within the noise aside); the
    # offered slow front (cpu_offload) is judged among itself, as it was chosen
    strict = report.pareto_mask(offered, 0.0, None) if warning or "strict_pareto" not in offered \
        else offered["strict_pareto"].astype(bool)
    if len(offered):
        chosen = export.choose(offered, "balanced", noise, cfg.tie_tolerance)
        pick, command = int(chosen["trial"]), export.exported(chosen, study, cfg).command()
    for _, row in offered.sort_values("ttft_ms").iterrows():
        out = {"study": label, "engine": engines.get(cfg.engine_name).label,
               "trial": int(row["trial"]),
               "flags": shlex.join(export.launch_params(row).vllm_flags())}
        out.update({k: float(row[k]) for k in OBJECTIVES})
        out.update({f"{k}_spread": spread(row, k, noise) for k in OBJECTIVES})
        runs = row.get("runs")
        out["runs"] = int(runs) if runs is not None and pd.notna(runs) else 1
        out["balanced"] = out["trial"] == pick
        out["strict_pareto"] = bool(strict.get(row.name, False))
        rows.append(out)
    measured = int(df[list(OBJECTIVES)].notna().all(axis=1).sum())
    return Side(label, cfg, engines.get(cfg.engine_name).label, platform_of(df), len(df), measured,
                pd.DataFrame(rows, columns=CSV_COLUMNS), command, warning)


def load_sides(study_files: list[str], resolve, storages: list[str] | None = None) -> list[Side]:
    """Each study file (a path or a name, `resolve`d as the other commands do) read in turn.
    `storages` (--storage): none, one URL for every study, or one per study in their order."""
    from tuner.config import load_study

    if len(study_files) < 2:
        raise TunerError(f"compare needs at least two --study (got {len(study_files)}): "
                         "e.g. --study demo --study demo-llamacpp")
    storages = list(storages or [])
    if len(storages) not in (0, 1, len(study_files)):
        raise TunerError(f"compare got {len(storages)} --storage for {len(study_files)} --study: "
                         "give one (every study's) or one per --study, in the same order")
    if len(storages) == 1:
        storages = storages * len(study_files)
    sides, seen, files = [], {}, set()
    try:
        for i, name in enumerate(study_files):
            path = Path(resolve(name)).resolve()
            # one study file run twice into two storages (two seeds, two hosts) is two studies
            key = (path, storages[i] if storages else None)
            if key in files:
                raise TunerError(f"--study {name} is given twice"
                                 + (" with the same --storage" if storages else "")
                                 + ": compare needs different studies (or one per --storage)")
            files.add(key)
            cfg = load_study(path, {"storage": storages[i]} if storages else None)
            seen[cfg.name] = seen.get(cfg.name, 0) + 1
            label = cfg.name if seen[cfg.name] == 1 else f"{cfg.name}#{seen[cfg.name]}"
            sides.append(load_side(cfg, label))
    finally:
        engines.use(engines.DEFAULT)
    return sides


def workload_key(cfg: StudyConfig) -> dict:
    """What a like-for-like comparison needs equal: the request lengths (the mix and its
    parameters, the endpoint's template), the load levels, how many requests and how long each
    runs (waves), and the SLOs that pick the throughput level."""
    from tuner.load.plan import closed_levels, ttft_level_name

    w = cfg.workload
    return {"prompt_tokens": w.prompt_tokens, "output_tokens": w.output_tokens,
            "length_mix": w.length_mix, "prompt_tokens_mix": tuple(w.prompt_tokens_mix),
            "output_tokens_mix": tuple(w.output_tokens_mix), "length_trace": w.length_trace,
            "endpoint": w.endpoint, "levels": closed_levels(w), "waves": w.waves,
            "max_waves": w.max_waves if w.level_seconds > 0 else None,
            "throughput_requests": w.throughput_requests,
            "single_stream_requests": w.single_stream_requests,
            "request_rates": tuple(w.request_rates) or ((w.request_rate,) if w.request_rate else ()),
            "ttft_level": ttft_level_name(w), "level_seconds": w.level_seconds,
            "slo_ttft_ms": w.slo_ttft_ms, "slo_tpot_ms": w.slo_tpot_ms, "slo_e2e_ms": w.slo_e2e_ms}


def mismatch(sides: list[Side]) -> str:
    """One line naming what differs between the studies (workload, model); "" when nothing."""
    parts = []
    keys = [workload_key(s.cfg) for s in sides]
    for k in keys[0]:
        values = [kk[k] for kk in keys]
        if any(v != values[0] for v in values):
            shown = " vs ".join(f"{s.label} {_show(v)}" for s, v in zip(sides, values))
            parts.append(f"{k.replace('_', ' ')} {shown}")
    models = [s.cfg.model for s in sides]
    if any(m != models[0] for m in models):
        parts.append("model " + " vs ".join(f"{s.label} {m}" for s, m in zip(sides, models)))
    if not parts:
        return ""
    return ("warning: the studies are not like for like, their figures are not comparable as "
            "they stand: " + "; ".join(parts))


def _show(v) -> str:
    if isinstance(v, tuple):
        return ",".join(f"{x:g}" for x in v) or "none"
    if isinstance(v, float):
        return f"{v:g}"
    return "none" if v is None else str(v)


def rows(sides: list[Side]) -> pd.DataFrame:
    """compare.csv: one row per front member of every study."""
    parts = [s.front for s in sides if len(s.front)]
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=CSV_COLUMNS)


def best(all_rows: pd.DataFrame) -> dict[str, tuple[str, int]]:
    """Per objective, the (study, trial) best across every study's front."""
    out = {}
    for k in OBJECTIVES:
        if all_rows.empty:
            continue
        i = all_rows[k].idxmax() if MAXIMIZE[k] else all_rows[k].idxmin()
        out[k] = (all_rows.at[i, "study"], int(all_rows.at[i, "trial"]))
    return out


def table(sides: list[Side]) -> str:
    """The printed comparison: per study its front with flags and figures, the best marked."""
    marks = best(rows(sides))
    lines = []
    for s in sides:
        lines.append(f"study {s.label} ({s.cfg.source}): engine {s.engine}, platform {s.platform}, "
                     f"{s.measured} of {s.trials} trials measured, {len(s.front)} on the front")
        if s.front.empty:
            lines.append("  (no feasible measured config: no front)")
            lines.append("")
            continue
        view = pd.DataFrame({"trial": s.front["trial"], "flags": s.front["flags"]})
        for k in OBJECTIVES:
            view[SHORT[k]] = [
                figure(r[k], r[f"{k}_spread"]) + (" *" if marks.get(k) == (s.label, int(r["trial"]))
                                                    else "")
                for _, r in s.front.iterrows()]
        view["runs"] = s.front["runs"]
        lines += ["  " + line for line in view.to_string(index=False).splitlines()]
        if s.warning:
            lines.append(f"  {s.warning}")
        lines.append(f"  balanced: {s.command}")
        lines.append("")
    if marks:
        lines.append("* best across the studies: " + "; ".join(
            f"{SHORT[k]} {study} trial {trial}" for k, (study, trial) in marks.items()))
    lines.append("± the standard deviation over the config's runs, or the study's launch-to-launch "
                 "noise for a config run once (a figure without ± has neither)")
    return "\n".join(lines)


def default_out(sides: list[Side]) -> Path:
    return Path(sides[0].cfg.results_dir) / ("compare-" + "-".join(s.label.replace("#", "-")
                                                                  for s in sides))


def write(sides: list[Side], out: Path) -> list[Path]:
    """compare.csv and compare.png in `out`."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TunerError(f"cannot write {out}/: {e.strerror}; pass --out a writable folder")
    csv_path = out / "compare.csv"
    rows(sides).to_csv(csv_path, index=False)
    return [csv_path, plot(sides, out / "compare.png")]


MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def plot(sides: list[Side], path: Path) -> Path:
    """compare.png: figure(sides) saved and closed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plot_figure(sides)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_figure(sides: list[Side]):
    """Throughput against TTFT (log axis), marker size the single-stream speed; beside it
    single-stream speed against throughput. A line joins only a study's strict Pareto members
    (none beats another on every objective); a member kept only as a tie within the noise is a
    hollow marker off the line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(15, 5.5), gridspec_kw={"width_ratios": [1.3, 1]})
    every = rows(sides)
    ss_max = float(every["single_stream_tok_s"].max()) if len(every) else 1.0
    for i, s in enumerate(sides):
        colour, marker = f"C{i}", MARKERS[i % len(MARKERS)]
        f = s.front.sort_values("ttft_ms")
        if f.empty:
            continue
        label = f"{s.label} ({s.engine}, {s.platform})"
        on = f["strict_pareto"].astype(bool) if "strict_pareto" in f else pd.Series(True, f.index)
        sizes = 40 + 260 * f["single_stream_tok_s"] / ss_max
        strict, ties = f[on], f[~on]
        if len(strict) > 1:
            ax.plot(strict["ttft_ms"], strict["throughput_tok_s"], color=colour, lw=1.2,
                    alpha=0.7, zorder=2)
        ax.scatter(strict["ttft_ms"], strict["throughput_tok_s"], s=sizes[on], color=colour,
                   marker=marker, edgecolors="black", linewidths=0.5, alpha=0.85, zorder=3,
                   label=label)
        if len(ties):
            ax.scatter(ties["ttft_ms"], ties["throughput_tok_s"], s=sizes[~on], marker=marker,
                       facecolors="none", edgecolors=colour, linewidths=1.2, zorder=3,
                       label=f"{s.label}: ties within noise")
        for _, r in f.iterrows():
            ax.annotate(str(int(r["trial"])), (r["ttft_ms"], r["throughput_tok_s"]), fontsize=7,
                        textcoords="offset points", xytext=(6, 4), color=colour)
        g = strict.sort_values("throughput_tok_s")
        if len(g) > 1:
            ax2.plot(g["throughput_tok_s"], g["single_stream_tok_s"], color=colour, lw=1.2,
                     alpha=0.7)
        ax2.scatter(g["throughput_tok_s"], g["single_stream_tok_s"], color=colour, marker=marker,
                    s=70, edgecolors="black", linewidths=0.5, zorder=3, label=label)
        if len(ties):
            ax2.scatter(ties["throughput_tok_s"], ties["single_stream_tok_s"], marker=marker,
                        s=70, facecolors="none", edgecolors=colour, linewidths=1.2, zorder=3)
    ax.set_xscale("log")
    ax.set_xlabel(LABELS["ttft_ms"] + ", log scale  ← better")
    ax.set_ylabel(LABELS["throughput_tok_s"] + "  better ↑")
    ax.set_title("Pareto fronts: throughput vs TTFT (marker size: single-stream speed)", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax2.set_xlabel(LABELS["throughput_tok_s"] + "  better →")
    ax2.set_ylabel(LABELS["single_stream_tok_s"] + "  better ↑")
    ax2.set_title("single-stream speed vs throughput", fontsize=10)
    ax2.grid(alpha=0.3)
    if len(every):
        ax.legend(fontsize=8, loc="best")
    fig.suptitle("compare: " + " vs ".join(s.label for s in sides)
                 + " (lines join strict Pareto members; hollow: ties within noise)", fontsize=11)
    fig.tight_layout()
    return fig
