"""The launch command of a chosen Pareto config: ServerParams -> argv -> shlex.join."""

from __future__ import annotations

import shlex

import pandas as pd

from tuner import space
from tuner.report import MAXIMIZE, OBJECTIVES

PREFERENCES = ("balanced", "throughput", "single-stream", "ttft")
_BY = {"throughput": "throughput_tok_s", "single-stream": "single_stream_tok_s", "ttft": "ttft_ms"}


def choose(front: pd.DataFrame, prefer: str = "balanced", noise: dict | None = None,
           tie_tolerance: float = 0.02) -> pd.Series:
    """The Pareto row a preference picks (objective columns are means over every run of a config).

    throughput / single-stream / ttft: the best on that objective. balanced: the best sum of the
    objectives scaled to [0, 1] across the front, counting only objectives whose spread across the
    front is beyond the measured noise (a spread inside it would let noise pick the command); when
    no objective is, every member is a tie and the highest throughput wins.
    """
    if front.empty:
        raise ValueError("empty Pareto set")
    if prefer in _BY:
        keys = [_BY[prefer]]
    else:
        keys = balanced_objectives(front, noise, tie_tolerance) or ["throughput_tok_s"]
    score = pd.Series(0.0, index=front.index)
    for k in keys:
        v = front[k].astype(float)
        span = v.max() - v.min()
        s = (v - v.min()) / span if span > 0 else pd.Series(1.0, index=v.index)
        score += s if MAXIMIZE[k] else 1 - s
    best = score.max()
    return front[score == best].sort_values("trial").iloc[0]


def balanced_objectives(front: pd.DataFrame, noise: dict | None = None,
                        tie_tolerance: float = 0.02) -> list[str]:
    """The objectives `balanced` weighs for this front (those whose spread is beyond the noise)."""
    from tuner.report import tie_margin

    runs = front["runs"] if "runs" in front.columns else pd.Series(1, index=front.index)
    runs = runs.fillna(1).astype(int)
    keys = []
    for k in OBJECTIVES:
        v = front[k].astype(float)
        if v.empty:
            continue
        hi, lo = v.idxmax(), v.idxmin()
        if v[hi] - v[lo] > tie_margin(k, v[hi], v[lo], runs[hi], runs[lo], noise, tie_tolerance):
            keys.append(k)
    return keys


def launch_params(row: pd.Series) -> space.ServerParams:
    """The params the server was launched with (a memory budget scales the searched gmu)."""
    values = {k: row[k] for k in space.ServerParams.__dataclass_fields__
              if k in row.index and pd.notna(row[k])}
    if "launch_gpu_memory_utilization" in row.index and pd.notna(row["launch_gpu_memory_utilization"]):
        values["gpu_memory_utilization"] = float(row["launch_gpu_memory_utilization"])
    for k in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
        if k in values:
            values[k] = int(values[k])
    if "enforce_eager" in values:
        values["enforce_eager"] = bool(values["enforce_eager"])
    return space.params_from(values)


def argv(model: str, params: space.ServerParams, extra_args: list[str] | tuple[str, ...]) -> list[str]:
    return ["vllm", "serve", model, *params.vllm_flags(), *extra_args]


def command(row: pd.Series, study) -> str:
    summary = study.user_attrs.get("config", {})
    return shlex.join(argv(summary.get("model", row.get("model", "")), launch_params(row),
                           summary.get("extra_args", [])))


def params_dict(row: pd.Series) -> dict:
    p = launch_params(row)
    out = {k: v for k, v in p.__dict__.items() if v is not None}
    out["trial"] = int(row["trial"])
    for k in OBJECTIVES:
        out[k] = None if pd.isna(row.get(k)) else float(row[k])
    return out


def script(row: pd.Series, study) -> str:
    figures = ", ".join(f"{k} {float(row[k]):.1f}" for k in OBJECTIVES if pd.notna(row.get(k)))
    return ("#!/bin/sh\n"
            f"# tuner study {study.study_name}, trial {int(row['trial'])}: {figures}\n"
            f"exec {command(row, study)}\n")
