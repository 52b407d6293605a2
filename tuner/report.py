"""Results from storage: the trials DataFrame, the noise-aware Pareto set, CSV files and plots."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from tuner.config import StudyConfig

OBJECTIVES = ("single_stream_tok_s", "throughput_tok_s", "ttft_ms")
MAXIMIZE = {"single_stream_tok_s": True, "throughput_tok_s": True, "ttft_ms": False}
LABELS = {"single_stream_tok_s": "single-stream speed (tok/s, concurrency 1)",
          "throughput_tok_s": "throughput (output tok/s)",
          "ttft_ms": "TTFT p50 under load (ms)"}
PARAMS = ("gpu_memory_utilization", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
          "enforce_eager", "kv_cache_dtype")
FIRST_COLUMNS = ["trial", "state", "failure", *PARAMS, *OBJECTIVES, "pareto", "feasible",
                 "baseline"]
SKIPPED = ("duplicate",)


# ---------------------------------------------------------------- the DataFrame


def trials_frame(study, tie_tolerance: float = 0.02) -> pd.DataFrame:
    """One row per trial (duplicates left out): params, objectives, failure, every measured attr."""
    from optuna.trial import TrialState

    rows = []
    for t in study.get_trials(deepcopy=False):
        a = t.user_attrs
        if a.get("failure") in SKIPPED or t.state == TrialState.WAITING:
            continue  # repeats of a measured config, and configs queued but never started
        row = {"trial": t.number, "state": t.state.name}
        row.update(t.params)
        feasible = t.state == TrialState.COMPLETE and all(v <= 0 for v in t.constraints.values())
        row["feasible"] = feasible
        if t.state == TrialState.COMPLETE and feasible:
            row.update(dict(zip(OBJECTIVES, t.values)))
        row.update({f"constraint_{k}": v for k, v in t.constraints.items()})
        row.update({k: v for k, v in a.items() if k not in ("failure_log_tail",)})
        for key, n in sample_counts(study).items():  # trials recorded before counts were kept
            if t.state == TrialState.COMPLETE:
                row.setdefault(key, n)
        row.setdefault("failure", "")
        row.setdefault("baseline", "")
        confirm = study.user_attrs.get(f"confirm:{t.number}")
        if confirm:
            row.update(confirm_columns(row, confirm))
        rows.append(row)
    df = pd.DataFrame(rows)
    for col in FIRST_COLUMNS:
        if col not in df.columns:
            df[col] = pd.NA if col not in ("pareto", "feasible") else False
    df["failure"] = df["failure"].fillna("")
    df["baseline"] = df["baseline"].fillna("")
    df["pareto"] = pareto_mask(df, tie_tolerance) if len(df) else []
    df["strict_pareto"] = pareto_mask(df, 0.0, use_spread=False) if len(df) else []
    rest = [c for c in df.columns if c not in FIRST_COLUMNS]
    return df[FIRST_COLUMNS + rest].sort_values("trial").reset_index(drop=True)


def sample_counts(study) -> dict:
    """Samples behind each objective's spread, from the study's workload."""
    from tuner.metrics import THROUGHPUT_WINDOWS

    w = study.user_attrs.get("config", {}).get("workload", {})
    if not w:
        return {}
    return {"single_stream_tok_s_n": w.get("single_stream_requests"),
            "ttft_ms_n": w.get("throughput_requests"), "throughput_tok_s_n": THROUGHPUT_WINDOWS}


def confirm_columns(row: dict, runs: list[dict]) -> dict:
    """Mean and standard deviation over the first measurement and the confirmation runs."""
    out = {"confirm_runs": len(runs)}
    for k in OBJECTIVES:
        values = [v for v in [row.get(k), *(r.get(k) for r in runs)] if v is not None]
        if values:
            mean = sum(values) / len(values)
            var = sum((v - mean) ** 2 for v in values) / max(len(values) - 1, 1)
            out[f"{k}_confirm_mean"] = mean
            out[f"{k}_confirm_std"] = math.sqrt(var)
    return out


def pareto_mask(df: pd.DataFrame, tie_tolerance: float, use_spread: bool = True) -> pd.Series:
    """Feasible trials that no other feasible trial beats beyond the noise on any objective.

    a dominates b when a is nowhere worse than b by more than the tie margin and somewhere better
    by more than it. The margin per objective is the larger of `tie_tolerance` times the value and
    two standard errors of the figure, estimated from its recorded spread (an IQR over `{k}_n`
    samples: per-request values for medians, time windows for throughput), so differences inside
    the noise are ties. Without a sample count the spread is taken as the error itself.
    """
    feasible = df["feasible"].astype(bool) & df[list(OBJECTIVES)].notna().all(axis=1)
    idx = list(df.index[feasible])
    vals = {i: [float(df.at[i, k]) for k in OBJECTIVES] for i in idx}
    spreads = {i: [_spread(df, i, k) if use_spread else 0.0 for k in OBJECTIVES] for i in idx}

    def dominates(a: int, b: int) -> bool:
        strictly = False
        for j, k in enumerate(OBJECTIVES):
            gain = vals[a][j] - vals[b][j]
            if not MAXIMIZE[k]:
                gain = -gain
            margin = max(tie_tolerance * max(abs(vals[a][j]), abs(vals[b][j])),
                         max(spreads[a][j], spreads[b][j]))
            if gain < -margin:
                return False
            if gain > margin or (margin == 0 and gain > 0):
                strictly = True
        return strictly

    front = {i for i in idx if not any(dominates(o, i) for o in idx if o != i)}
    if idx and not front:  # ties can in rare cases dominate in a cycle: fall back to the strict front
        return pareto_mask(df, 0.0, use_spread=False)
    return pd.Series([i in front for i in df.index], index=df.index)


def _spread(df: pd.DataFrame, i, key: str) -> float:
    """The noise term of the tie margin: two standard errors of the trial's figure."""
    col = f"{key}_spread"
    if col not in df.columns or pd.isna(df.at[i, col]):
        return 0.0
    iqr = float(df.at[i, col])
    n_col = f"{key}_n"
    if n_col not in df.columns or pd.isna(df.at[i, n_col]) or df.at[i, n_col] < 2:
        return iqr / 2
    sigma = iqr / 1.349                      # IQR of a normal distribution is 1.349 sigma
    factor = 1.0 if key == "throughput_tok_s" else 1.253  # a mean of windows; else a median
    return 2 * factor * sigma / math.sqrt(float(df.at[i, n_col]))


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
    df = trials_frame(study, cfg.tie_tolerance)
    folder = cfg.results_path
    folder.mkdir(parents=True, exist_ok=True)
    _write_csv(df, folder / "trials.csv")
    return df


def write_all(study, cfg: StudyConfig, prefer: str = "balanced") -> pd.DataFrame:
    """trials.csv, pareto.csv, the plots and best-command.sh."""
    from tuner import export

    df = write_trials(study, cfg)
    folder = cfg.results_path
    front = df[df["pareto"]]
    _write_csv(front, folder / "pareto.csv")
    plot_all(df, folder, title=cfg.name)
    if len(front):
        row = export.choose(front, prefer)
        (folder / "best-command.sh").write_text(export.script(row, study, cfg))
    return df


def _write_csv(df: pd.DataFrame, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    df.to_csv(tmp, index=False)
    tmp.replace(path)


# ---------------------------------------------------------------- plots

STYLE = {"pareto": dict(color="#d62728", marker="*", s=160, zorder=4, label="Pareto set"),
         "dominated": dict(color="#7f7f7f", marker="o", s=40, alpha=0.6, zorder=3,
                           label="dominated"),
         "infeasible": dict(color="#ff7f0e", marker="x", s=60, zorder=2,
                            label="infeasible (SLO / load test)"),
         "failed": dict(color="#000000", marker="s", s=30, zorder=1, label="failed")}


def plot_all(df: pd.DataFrame, folder: Path, title: str = "") -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    paths = [plot_projections(df, folder / "pareto.png", title),
             plot_parameters(df, folder / "parameters.png", title)]
    return paths


def plot_projections(df: pd.DataFrame, path: Path, title: str = "") -> Path:
    """The three pairwise projections of the objectives; failures counted in the title."""
    import matplotlib.pyplot as plt

    pairs = [("single_stream_tok_s", "throughput_tok_s"), ("ttft_ms", "throughput_tok_s"),
             ("ttft_ms", "single_stream_tok_s")]
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2))
    measured = df[df[list(OBJECTIVES)].notna().all(axis=1)]
    for ax, (x, y) in zip(axes, pairs):
        for kind in ("dominated", "infeasible", "pareto"):
            part = measured[measured.apply(outcome, axis=1) == kind]
            if len(part):
                ax.scatter(part[x], part[y], **STYLE[kind])
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
    axes[0].legend(handles, labels, fontsize=8, loc="best")
    counts = df["failure"].replace("", pd.NA).dropna().value_counts()
    unmeasured = ", ".join(f"{k} ×{v}" for k, v in counts.items() if k != "load_test_failed")
    fig.suptitle(f"{title}: {len(measured)} measured configs"
                 + (f"; not measured: {unmeasured}" if unmeasured else ""), fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_parameters(df: pd.DataFrame, path: Path, title: str = "") -> Path:
    """Where the good configs live: gmu × max-model-len (size = max-num-seqs), and parallel coordinates."""
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (ax, pc) = plt.subplots(1, 2, figsize=(16, 5.5), gridspec_kw={"width_ratios": [1, 1.4]})
    kinds = df.apply(outcome, axis=1) if len(df) else pd.Series(dtype=str)
    mem = df["failure"].isin(["kv_cache_too_small", "oom", "no_cache_blocks",
                              "insufficient_free_memory", "cpu_offload", "predicted_infeasible"])
    style = dict(STYLE)
    style["infeasible"] = dict(STYLE["infeasible"], label="infeasible")
    for kind in ("failed", "infeasible", "dominated", "pareto"):
        part = df[(kinds == kind) & df["max_model_len"].notna()]
        if len(part):
            sizes = 30 + 12 * np.log2(part["max_num_seqs"].astype(float).clip(lower=1))
            st = dict(style[kind])
            st["s"] = sizes * (2 if kind == "pareto" else 1)
            ax.scatter(part["max_model_len"].astype(float),
                       part["gpu_memory_utilization"].astype(float), **st)
    for _, row in df[mem & df["max_model_len"].notna()].iterrows():
        ax.annotate(row["failure"].replace("_", " "), (row["max_model_len"],
                    row["gpu_memory_utilization"]), fontsize=6, color="#ff7f0e",
                    textcoords="offset points", xytext=(4, 4))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("--max-model-len (tokens, log scale)")
    ax.set_ylabel("--gpu-memory-utilization (searched value)")
    ax.set_title("where configs fit (marker size: --max-num-seqs)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")

    axes_cols = [c for c in ("gpu_memory_utilization", "max_model_len", "max_num_seqs",
                             "max_num_batched_tokens", *OBJECTIVES) if c in df.columns
                 and pd.to_numeric(df[c], errors="coerce").notna().any()]
    data = df[axes_cols].apply(pd.to_numeric, errors="coerce")
    lo, hi = data.min(), data.max()
    scaled = (data - lo) / (hi - lo).replace(0, 1)
    xs = np.arange(len(axes_cols))
    for kind in ("failed", "infeasible", "dominated", "pareto"):
        for i in df.index[kinds == kind]:
            ys = scaled.loc[i].to_numpy(dtype=float)
            pc.plot(xs, ys, color=STYLE[kind]["color"], alpha=0.9 if kind == "pareto" else 0.35,
                    lw=2.2 if kind == "pareto" else 1, ls="--" if kind != "pareto" and
                    kind != "dominated" else "-")
    pc.set_xticks(xs, [c.replace("_", "\n") for c in axes_cols], fontsize=8)
    for x, c in zip(xs, axes_cols):
        pc.annotate(f"{lo[c]:.3g}", (x, -0.04), ha="center", fontsize=7, va="top")
        pc.annotate(f"{hi[c]:.3g}", (x, 1.02), ha="center", fontsize=7)
    pc.set_yticks([])
    pc.set_ylim(-0.12, 1.1)
    pc.set_title("parallel coordinates (red: Pareto set, grey: dominated, dashed: infeasible/failed)")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def table(df: pd.DataFrame, columns: list[str] | None = None) -> str:
    cols = columns or ["trial", "state", "failure", "gpu_memory_utilization", "max_model_len",
                       "max_num_seqs", *OBJECTIVES, "pareto", "baseline"]
    cols = [c for c in cols if c in df.columns]
    view = df[cols].copy()
    for c in OBJECTIVES:
        if c in view:
            view[c] = view[c].map(lambda v: "" if pd.isna(v) else f"{v:.1f}")
    return view.to_string(index=False, na_rep="")
