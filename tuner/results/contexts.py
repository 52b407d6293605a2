"""The longest context a device serves, and how fast: one row per context length a study tried.

A user squeezing a big model onto a small card asks first "how long a context does it serve, how
many requests of that length at once, and how fast". A study answers it as it goes: every trial
has a context length (vLLM's max_model_len, llama.cpp's context per slot), every launch that
started logged its KV cache in tokens, and the memory model says which configs it did not launch.
This module folds the trials frame (report.trials_frame) into that answer: `context_frame` for
contexts.csv and the report, `describe` for `tuner show`.
"""

from __future__ import annotations

import pandas as pd

from tuner import engines
from tuner.records import MEMORY_FAILURES
from tuner.results.report import measured_feasible
from tuner.search.requirement import sequences_at_context

# the best config of a context per objective, and which way is better
BEST = (("single_stream_tok_s", max, "single_stream_trial"), ("throughput_tok_s", max, "throughput_trial"),
        ("ttft_ms", min, "ttft_trial"))

COLUMNS = ["context", "served", "failed_for_memory", "predicted_not_to_fit", "infeasible",
           "kv_cache_tokens", "requests_at_context",
           "single_stream_tok_s", "single_stream_trial", "throughput_tok_s", "throughput_trial",
           "ttft_ms", "ttft_trial"]


def _context(row: pd.Series) -> int | None:
    values = {k: v for k, v in row.items() if not (pd.api.types.is_scalar(v) and pd.isna(v))}
    context = engines.get().request_context(values)
    return int(context) if context else None


def _kind(row: pd.Series) -> str:
    """served | memory (failed for memory at launch) | predicted (not launched: the memory model
    or an earlier memory failure said it does not fit) | infeasible (broke another constraint: the
    budget's peak, an SLO, the roofline, the user's requirement) | "" (anything else)."""
    failure = str(row.get("failure") or "")
    if measured_feasible(row):   # what the card really serves at that context
        return "served"
    if failure in MEMORY_FAILURES:
        return "memory"
    memory = row.get("constraint_memory")
    if failure == "predicted_infeasible":
        return "predicted" if memory is not None and pd.notna(memory) and memory > 0 else "infeasible"
    if row.get("state") == "COMPLETE" and pd.notna(row.get("throughput_tok_s")):
        return "infeasible"
    return ""


def context_frame(df: pd.DataFrame) -> pd.DataFrame:
    """One row per context length, shortest first: how many configs served it, failed for memory
    at launch, were predicted not to fit (never launched) or broke another constraint (`_kind`);
    the most KV-cache tokens a served config held
    and how many requests of the full context that is at once; the best figure of each objective
    among the served configs and its trial."""
    if df.empty:
        return pd.DataFrame(columns=COLUMNS)
    groups: dict[int, list[pd.Series]] = {}
    for _, row in df.iterrows():
        context = _context(row)
        if context is not None:
            groups.setdefault(context, []).append(row)
    out = []
    for context in sorted(groups):
        rows = groups[context]
        kinds = [_kind(r) for r in rows]
        served = [r for r, k in zip(rows, kinds) if k == "served"]
        entry = {"context": context, "served": len(served),
                 "failed_for_memory": kinds.count("memory"),
                 "predicted_not_to_fit": kinds.count("predicted"),
                 "infeasible": kinds.count("infeasible")}
        kv = [float(r["kv_cache_tokens"]) for r in served
              if pd.notna(r.get("kv_cache_tokens", float("nan")))]
        entry["kv_cache_tokens"] = int(max(kv)) if kv else None
        entry["requests_at_context"] = sequences_at_context(int(max(kv)), context) if kv else None
        for key, better, trial in BEST:
            if served:
                best = better(served, key=lambda r, k=key: float(r[k]))
                entry[key], entry[trial] = float(best[key]), int(best["trial"])
        out.append(entry)
    frame = pd.DataFrame(out, columns=COLUMNS)
    counts = ["served", "failed_for_memory", "predicted_not_to_fit", "infeasible", "kv_cache_tokens",
              "requests_at_context", "single_stream_trial", "throughput_trial", "ttft_trial"]
    return frame.astype({c: "Int64" for c in counts})


def at_least(df: pd.DataFrame, tokens: int, tie_tolerance: float, study_name: str) -> pd.DataFrame:
    """The trials frame cut to the configs that serve requests of at least `tokens` tokens, with
    their own Pareto set (`export --min-context`): the front of the whole study may hold only
    short contexts. None served: refused with the longest context that did."""
    from tuner.errors import TunerError
    from tuner.results.report import pareto_mask

    context = df.apply(_context, axis=1) if len(df) else pd.Series(dtype=float)
    scope = df[context.fillna(0) >= tokens].copy() if len(df) else df
    if len(scope):
        scope["pareto"] = pareto_mask(scope, tie_tolerance, df.attrs.get("noise"))
    scope.attrs = dict(df.attrs)
    if scope.empty or not scope["pareto"].any():
        served = context_frame(df)
        served = served[served["served"] > 0]
        longest = (f"the longest served is {int(served['context'].max()):,} tokens" if len(served)
                   else "no config has served yet")
        name = engines.get().request_context_name
        raise TunerError(f"study {study_name} has no measured config with {name} of at least "
                         f"{tokens:,} tokens within every constraint ({longest}): search longer "
                         "contexts (more memory, offload, fewer sequences) or ask for less")
    return scope


def headline(ctx: pd.DataFrame) -> list[str]:
    """The longest context served with its figures, and the longer ones that did not serve (or why
    none has yet); nothing when no trial has a context length."""
    if ctx.empty:
        return []
    name = engines.get().request_context_name
    served = ctx[ctx["served"] > 0]
    if served.empty:
        return [f"no {name} has served yet: " + _not_served(ctx)]
    top = served.iloc[-1]
    held = top["requests_at_context"]
    lines = [
        f"longest {name} served: {int(top['context']):,} tokens (trial {int(top['throughput_trial'])}: "
        f"{top['throughput_tok_s']:,.1f} tok/s throughput; best single stream "
        f"{top['single_stream_tok_s']:,.1f} tok/s, trial {int(top['single_stream_trial'])}"
        + (f"; its KV cache held {int(held)} request{'s' if held != 1 else ''} of that length at once"
           if pd.notna(held) else "") + ")"]
    longer = ctx[(ctx["context"] > top["context"]) & (ctx["served"] == 0)]
    if len(longer):
        lines.append(f"longer {name} not served: " + _not_served(longer))
    return lines


def describe(ctx: pd.DataFrame) -> list[str]:
    """Lines for `tuner show`: the headline, then one line per context length."""
    lines = headline(ctx)
    if ctx.empty or (ctx["served"] == 0).all():
        return lines
    name = engines.get().request_context_name
    lines.append(f"{name:>14} served  most KV tokens  at once  single-stream tok/s  throughput tok/s  "
                 "TTFT p50 ms")
    for _, r in ctx.iterrows():
        if r["served"]:
            lines.append(f"{int(r['context']):>14,} {int(r['served']):>6} {_int(r['kv_cache_tokens']):>15} "
                         f"{_int(r['requests_at_context']):>8} {r['single_stream_tok_s']:>20,.1f} "
                         f"{r['throughput_tok_s']:>17,.1f} {r['ttft_ms']:>12,.0f}")
        else:
            lines.append(f"{int(r['context']):>14,} {0:>6}  {_why_not(r)}")
    return lines


def _int(value) -> str:
    return "" if value is None or pd.isna(value) else f"{int(value):,}"


def _why_not(r: pd.Series) -> str:
    parts = []
    if r["failed_for_memory"]:
        parts.append(f"{int(r['failed_for_memory'])} failed for memory")
    if r["predicted_not_to_fit"]:
        parts.append(f"{int(r['predicted_not_to_fit'])} predicted not to fit")
    if r["infeasible"]:
        parts.append(f"{int(r['infeasible'])} broke a constraint")
    return ", ".join(parts) or "no config measured"


def _not_served(ctx: pd.DataFrame) -> str:
    return "; ".join(f"{int(r['context']):,} ({_why_not(r)})" for _, r in ctx.iterrows())
