"""results/NAME/report.html: one self-contained page a person reads (front, load curves, failures, commands)."""

from __future__ import annotations

import html
import math
import re
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

from tuner import engines
from tuner.results import contexts, export, report
from tuner.config import StudyConfig
from tuner.results.report import LABELS, OBJECTIVES

# Columns of each table: (column, header, digits); digits None for text.
OBJECTIVE_COLUMNS = [("single_stream_tok_s", "single-stream tok/s", 1),
                     ("throughput_tok_s", "throughput tok/s", 1),
                     ("ttft_ms", "TTFT p50 ms", 1)]
LEVEL_FIGURES = [("throughput_tok_s", "throughput tok/s", 1), ("ttft_ms", "TTFT p50 ms", 1),
                 ("ttft_ms_p90", "TTFT p90 ms", 1), ("tpot_ms", "TPOT p50 ms", 2),
                 ("e2e_ms_p90", "E2E p90 ms", 1)]
ENGINE = "{engine}"   # the engine's label (vLLM, llama.cpp, SGLang), filled in per study
FAILURE_FACTS = [("failure_message", "what the log or the tuner said", None),
                 ("estimated_max_model_len", f"{ENGINE}: fits tokens", 0),
                 ("needed_gib", f"{ENGINE}: needed GiB", 2),
                 ("available_gib", f"{ENGINE}: available GiB", 2),
                 ("predicted_fits", "model: fits", None),
                 ("predicted_max_model_len_fit", "model: fits tokens", 0),
                 ("predicted_needed_gib", "model: needed GiB", 2),
                 ("predicted_available_gib", "model: available GiB", 2),
                 ("predicted_reason", "memory model said", None)]
# What a failure kind means, for a reader who has not read vLLM's logs.
FAILURE_MEANING = {
    "kv_cache_too_small": "the KV cache left after the weights cannot hold one max-model-len request",
    "oom": "CUDA (or host) out of memory during the launch",
    "no_cache_blocks": "no memory was left for any KV cache block",
    "insufficient_free_memory": "other processes held the memory this config asked for",
    "cpu_offload": "single stream far below its roofline (weights read from host memory)",
    "predicted_infeasible": "not launched: the memory model or an earlier failure ruled it out",
    "predicted_dominated": "not launched: its best possible figures, read off launches already "
                           "measured, are beaten beyond the noise (screened_by names the trial)",
    "gpu_busy": "not launched: the GPU stayed busy",
    "load_test_failed": "launched, but the load test did not measure it (too many requests of a level "
                        "failed, or a figure could not be timed: see the trial's failure_message)",
    "startup_timeout": "the server did not become ready in time",
    "interrupted": "the run was stopped during this trial; the config was queued again",
    "tuner_error": "a fault of the tuner itself",
    "duplicate": "a repeat of a measured config (not launched)",
    "crashed": "the server exited during the launch (its log's last error is kept)",
    "model_load": "the engine could not load the model (missing or unreadable weights, bad config)",
    "port_in_use": "the server could not bind its port (another process held it)",
    "context_too_long": "the context asked for is longer than the model or the KV pool allows",
    "requirement_not_met": "measured, but below the study's [requirement] (context or concurrency)",
    "slo_not_met": "measured, but no closed-loop load level meets the study's [slo] (no goodput)",
    "over_budget": "measured, but its peak device memory exceeds the study's memory budget: a card "
                   "of that size can run out of memory",
    "budget_spent": "queued, but the trial budget was spent before it was launched",
    "rejected_for_length": "requests were refused for their length (prompt + output over the context)",
}
UNDER_LOAD = "_under_load"


def failure_meaning(kind: str) -> str:
    """What a failure kind means; `X_under_load` is X, after the server was ready and under load."""
    if kind.endswith(UNDER_LOAD):
        base = FAILURE_MEANING.get(kind[:-len(UNDER_LOAD)], "")
        return (base + "; " if base else "") + "it happened under load, after the server was ready"
    return FAILURE_MEANING.get(kind, "")


# ---------------------------------------------------------------- cells


def _missing(value) -> bool:
    if value is None or value is pd.NA:
        return True
    try:
        return bool(pd.isna(value))
    except (TypeError, ValueError):
        return False


def _number(value) -> float | None:
    if _missing(value) or isinstance(value, (bool, np.bool_, str)):
        return None
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def fmt(value, digits: int | None) -> str:
    """A value as the page shows it: numbers rounded to `digits`, text as it is."""
    if _missing(value):
        return ""
    if isinstance(value, (bool, np.bool_)):   # "model: fits", "offload suspected": a word, not False
        return "yes" if value else "no"
    x = _number(value)
    if digits is None or x is None:
        return str(value)
    if x != 0 and abs(x) < 0.5 * 10 ** -digits:
        # 0.0039 GiB is no 0.00: two significant digits where rounding would leave nothing
        return f"{x:.2g}"
    return f"{x:,.{digits}f}"


# The ± column of each objective: over the config's runs, else the study's launch-to-launch noise.
SPREAD_COLUMNS = [(f"{k}_pm", f"{h} ±", d) for k, h, d in OBJECTIVE_COLUMNS]


def with_spreads(rows: pd.DataFrame, noise) -> pd.DataFrame:
    """`rows` with the `{objective}_pm` columns of SPREAD_COLUMNS (NaN where nothing was measured)."""
    rows = rows.copy()
    for k, _, _ in OBJECTIVE_COLUMNS:
        rows[f"{k}_pm"] = [report.spread(row, k, noise) if _number(row.get(k)) is not None
                           else math.nan for _, row in rows.iterrows()]
    return rows


def _plus_minus(row, key: str, digits: int, noise) -> str:
    sd = report.spread(row, key, noise)
    return "" if _missing(sd) else f" ± {sd:,.{digits}f}"


def cell(value, column: str, digits: int | None = None) -> str:
    """One <td>, escaped; a number also carries its full value (data-value) for tests and scripts."""
    text = html.escape(fmt(value, digits))
    x = _number(value) if digits is not None else None
    if x is None:
        return f'<td data-col="{html.escape(column)}">{text}</td>'
    return (f'<td class="num" data-col="{html.escape(column)}" data-value="{x!r}">{text}</td>')


def table(rows: pd.DataFrame, columns: list[tuple[str, str, int | None]], table_id: str,
          extra=None, drop_empty: bool = False) -> str:
    """A table of `rows` (one <tr data-trial> each); `extra(row)` adds leading cells;
    `drop_empty` leaves out columns no row has a value in."""
    columns = [c for c in columns if c[0] in rows.columns and not (
        drop_empty and rows[c[0]].map(lambda v: _missing(v) or v == "").all())]
    head = "".join(f"<th>{html.escape(h)}</th>" for _, h, _ in columns)
    lead = extra.header if extra is not None else ""
    body = []
    for _, row in rows.iterrows():
        cells = extra(row) if extra is not None else ""
        cells += "".join(cell(row.get(c), c, d) for c, _, d in columns)
        trial = row.get("trial")
        attr = f' data-trial="{int(trial)}"' if _number(trial) is not None else ""
        body.append(f"<tr{attr}>{cells}</tr>")
    return (f'<table id="{table_id}"><thead><tr>{lead}{head}</tr></thead>'
            f'<tbody>{"".join(body)}</tbody></table>')


class _Marks:
    """Leading cells of a trial row: its number and badges (Pareto, baseline, running, failure)."""

    header = "<th>trial</th><th>marks</th>"

    def __call__(self, row) -> str:
        badges = []
        if row.get("state") == "RUNNING":
            badges.append('<span class="badge running">running</span>')
        elif row.get("state") not in ("COMPLETE", None):
            badges.append(f'<span class="badge failed">{html.escape(str(row.get("state")))}</span>')
        if bool(row.get("pareto")):
            badges.append('<span class="badge pareto">Pareto</span>')
        baseline = row.get("baseline")
        if isinstance(baseline, str) and baseline:
            badges.append(f'<span class="badge baseline">baseline: {html.escape(baseline)}</span>')
        failure = row.get("failure")
        if isinstance(failure, str) and failure:
            badges.append(f'<span class="badge failure">{html.escape(failure)}</span>')
        return (f'<td class="num" data-col="trial" data-value="{int(row["trial"])}">'
                f'{int(row["trial"])}</td><td>{" ".join(badges)}</td>')


# ---------------------------------------------------------------- plots


def svg(draw, name: str) -> str:
    """A figure `draw(path)` saves (report.plot_*) as inline SVG, its ids prefixed so several can
    share one page."""
    import matplotlib

    matplotlib.use("Agg")
    with tempfile.TemporaryDirectory() as tmp, matplotlib.rc_context(
            {"svg.fonttype": "none", "svg.hashsalt": name}):
        path = draw(Path(tmp) / f"{name}.svg")
        text = path.read_text(encoding="utf-8")
    text = text[text.index("<svg"):]
    text = re.sub(r"<metadata>.*?</metadata>", "", text, flags=re.S)   # RDF naming matplotlib
    text = re.sub(r'\bid="([^"]+)"', rf'id="{name}-\1"', text)
    text = re.sub(r"url\(#([^)]+)\)", rf"url(#{name}-\1)", text)
    return re.sub(r'href="#([^"]+)"', rf'href="#{name}-\1"', text)


def figure(draw, name: str, caption: str) -> str:
    return (f'<figure id="plot-{name}" class="plot">{svg(draw, name)}'
            f"<figcaption>{html.escape(caption)}</figcaption></figure>")


# ---------------------------------------------------------------- sections


def params_of(df: pd.DataFrame, cfg: StudyConfig) -> list[tuple[str, str, int | None]]:
    """The searched flags present in the frame, as table columns."""
    names = [d.name for d in cfg.dimensions] or list(report.param_columns())
    floats = {f.name for f in engines.flags() if f.kind == "float"}   # gpu_memory_utilization
    return [(n, n.replace("_", "-"), 2 if n in floats else 0) for n in names
            if n in df.columns and df[n].notna().any()]


def section(section_id: str, title: str, body: str) -> str:
    return f'<section id="{section_id}"><h2>{html.escape(title)}</h2>{body}</section>'


def para(text: str) -> str:
    return f"<p>{html.escape(text)}</p>"


def engine_label(cfg: StudyConfig) -> str:
    """How the page names the study's engine: "vLLM", "llama.cpp", "SGLang"."""
    return engines.get(cfg.engine_name).label


def summary_section(study, cfg: StudyConfig, df: pd.DataFrame) -> str:
    config = study.user_attrs.get("config", {})
    states = df["state"].value_counts().to_dict() if len(df) else {}
    running = int(states.get("RUNNING", 0))
    first = df.iloc[0] if len(df) else pd.Series(dtype=object)
    # the engine's version is stored as vllm_version whatever the engine
    facts = [("study", cfg.name), ("storage", cfg.storage),
             ("model", config.get("model") or cfg.model),
             ("device", first.get("gpu_name")), (engine_label(cfg), first.get("vllm_version")),
             ("trials", ", ".join(f"{k.lower()} {v}" for k, v in states.items()) or "none yet"),
             ("generated", time.strftime("%Y-%m-%d %H:%M:%S %Z"))]
    items = "".join(f"<dt>{html.escape(k)}</dt><dd>{html.escape(str(v))}</dd>"
                    for k, v in facts if not _missing(v) and v != "")
    body = f'<dl class="facts">{items}</dl>'
    gone = 0
    if running:
        from tuner.search.study import tuner_gone

        gone = sum(tuner_gone({k: r.get(k) for k in ("tuner_host", "tuner_pid")})
                   for _, r in df[df["state"] == "RUNNING"].iterrows())
    if running - gone:
        body += (f'<p id="partial" class="partial">The study is still running: {running - gone} '
                 f"trial{'s' if running - gone > 1 else ''} in progress (shown as running); "
                 "this page is a snapshot. Run <code>python -m tuner report</code> again later.</p>")
    if gone:
        body += (f'<p id="orphaned" class="partial">{gone} trial{"s" if gone > 1 else ""} shown as '
                 f"running {'belong' if gone > 1 else 'belongs'} to a tuner that is gone (killed): "
                 "nothing of it was measured; "
                 "the next <code>python -m tuner run</code> stops any server it left and queues "
                 "the config again.</p>")
    body += relaunch_banner(study)
    w = config.get("workload") or {}
    if w:
        body += para("workload: " + describe_workload(w))
    req = cfg.requirement
    if req.context_tokens:
        body += para(f"requirement: context_tokens {req.context_tokens}"
                     + (f", sequences_at_context {req.sequences_at_context}" if req.sequences_at_context else ""))
    return section("summary", f"tuner study {cfg.name}", body)


def relaunch_banner(study) -> str:
    """A replicate or confirmation launch in progress: its trial stays COMPLETE in storage, so
    only the study's `relaunch_server` record (set while that server runs, cleared after its
    load test) says so. "" when none is."""
    from tuner.search.study import tuner_gone

    r = study.user_attrs.get("relaunch_server") or {}
    if not r or r.get("trial") is None:
        return ""
    kind = html.escape(str(r.get("kind") or "relaunch"))
    trial = int(r["trial"])
    if tuner_gone({"tuner_host": r.get("host"), "tuner_pid": r.get("tuner_pid")}):
        return (f'<p id="orphaned-relaunch" class="partial">A {kind} launch of trial {trial} was '
                "left by a tuner that is gone (killed): nothing of it was measured; the next "
                "<code>python -m tuner run</code> stops its server.</p>")
    return (f'<p id="partial-relaunch" class="partial">The study is still running: a {kind} '
            f"launch of trial {trial} is in progress; this page is a snapshot: trial {trial}'s "
            "figures (the mean over its runs), the measured noise and the front can change when "
            "it ends. Run <code>python -m tuner report</code> again later.</p>")


def describe_workload(w: dict) -> str:
    """The stored [workload] (and [slo]) as a reader needs it: the request lengths as they were
    sent (a mix or a trace, not only the fixed pair), the levels, and what picks each objective."""
    from pathlib import PurePath

    mix = w.get("length_mix") or "fixed"
    if mix == "trace":
        lengths = f"lengths from the trace {PurePath(str(w.get('length_trace'))).name}"
    elif mix != "fixed":
        lengths = (f"{mix} lengths, prompt {w.get('prompt_tokens_mix')} output {w.get('output_tokens_mix')}"
                   f" (single stream {w.get('prompt_tokens')} + {w.get('output_tokens')})")
    else:
        lengths = f"prompt_tokens {w.get('prompt_tokens')}, output_tokens {w.get('output_tokens')}"
    keys = ["levels", "request_rates", "waves", "level_seconds", "warmup_requests", "ttft_level"]
    if not w.get("levels"):
        keys.insert(2, "max_concurrency")   # the ladder's top; with levels given it is unused
    parts = [lengths] + [f"{k} {w[k]}" for k in keys if w.get(k) not in (None, [], (), 0, 0.0)]
    slos = [f"{k[len('slo_'):]} p90 <= {w[k]:g}" for k in ("slo_ttft_ms", "slo_tpot_ms", "slo_e2e_ms")
            if w.get(k) is not None]
    if slos:
        parts.append("[slo] " + ", ".join(slos) + " (throughput at the highest level meeting them)")
    return ", ".join(parts)


def noise_section(df: pd.DataFrame) -> str:
    noise = df.attrs.get("noise") or {}
    body = para(report.describe_noise(noise))
    if machines := report.describe_machines(df):
        body += para(machines)
    if noise:
        rows = pd.DataFrame([{"objective": k, "cv_pct": v["cv"] * 100, "dof": v["dof"],
                              "configs": v["configs"]} for k, v in noise.items()])
        body += table(rows, [("objective", "objective", None),
                             ("cv_pct", "coefficient of variation %", 2),
                             ("dof", "degrees of freedom", 0), ("configs", "configs", 0)], "noise")
    return section("noise-section", "Measured noise", body)


def _command_html(command: str) -> str:
    """A command line whose long lines wrap between its words, never inside one: a browser breaks
    after any hyphen, which cut --gpu-memory-utilization in two. Each word is its own inline box;
    the text (what the copy button copies) is the command unchanged."""
    return " ".join(f'<span class="arg">{html.escape(word)}</span>' for word in command.split(" "))


def commands_section(study, cfg: StudyConfig, df: pd.DataFrame) -> str:
    front, warning = export.offered_front(df, cfg.tie_tolerance)
    if front.empty:
        return section("commands", "Commands to copy",
                       para("no feasible measured config yet: no command to export"))
    blocks = []
    noise = df.attrs.get("noise")
    for prefer in export.PREFERENCES:
        row = export.choose(front, prefer, noise, cfg.tie_tolerance)
        e = export.exported(row, study, cfg, warning=warning)
        figures = ", ".join(f"{h} {fmt(row.get(c), d)}" + _plus_minus(row, c, d, noise)
                            for c, h, d in OBJECTIVE_COLUMNS)
        # the line `export` prints on stderr when a tie, not the preference, picked the trial
        why = export.choice_note(front, row, prefer, noise, cfg.tie_tolerance)
        ties = export.objective_tie_note(front, row, prefer, noise, cfg.tie_tolerance)
        notes = "".join(f"<li>{html.escape(n)}</li>" for n in e.notes)
        blocks.append(
            f'<div class="command" data-prefer="{prefer}" data-trial="{int(row["trial"])}">'
            f"<h3>--prefer {prefer}: trial {int(row['trial'])}</h3><p>{html.escape(figures)}</p>"
            + (f'<p class="why">{html.escape(why)}</p>' if why else "")
            + (f'<p class="ties">{html.escape(ties)}</p>' if ties else "") +
            f'<div class="cmdline"><pre><code id="cmd-{prefer}">{_command_html(e.command())}'
            f'</code></pre><button type="button" class="copy" data-target="cmd-{prefer}">copy'
            f"</button></div>" + (f"<ul class=\"notes\">{notes}</ul>" if notes else "") + "</div>")
    intro = para("python -m tuner export --prefer NAME prints the same line; balanced weighs only "
                 "the objectives whose spread across the front is beyond the measured noise.")
    wide = [ln for ln in report.describe_noise(noise).splitlines() if ln.startswith("WARNING")]
    if wide:   # the picks below may be ties: said beside them, not only under "Measured noise"
        intro += f'<p class="partial noise-warning">{html.escape(wide[0])}</p>'
    return section("commands", "Commands to copy", intro + "".join(blocks))


def front_section(cfg: StudyConfig, df: pd.DataFrame, params) -> str:
    front = with_spreads(df[df["pareto"]], df.attrs.get("noise"))
    if front.empty:   # not "0 configs no other beats" over a table of headers alone
        body = para(report.describe_empty_front(df))
    else:
        body = para(f"{report.plural(len(front), 'config')} no other beats beyond the measured "
                    "noise. " + "; ".join(f"{k}: {LABELS[k]}" for k in OBJECTIVES)
                    + ". ± is the standard deviation over a config's runs, or the study's "
                      "launch-to-launch noise for a config run once.")
        body += table(front, params + OBJECTIVE_COLUMNS + SPREAD_COLUMNS
                      + [("runs", "runs", 0), ("roofline_pct", "roofline %", 1)],
                      "front", _Marks(), drop_empty=True)
    measured = df[df[list(OBJECTIVES)].notna().all(axis=1)] if len(df) else df
    if len(measured):
        body += figure(lambda p: report.plot_projections(df, p, cfg.name), "pareto",
                       caption="the three pairwise projections of the objectives: red stars the "
                               "Pareto set, circles the baselines")
    return section("front-section", "Pareto front", body)


def curves_section(cfg: StudyConfig, df: pd.DataFrame, levels: pd.DataFrame) -> str:
    if levels.empty or "name" not in levels.columns:
        return section("curves", "Load curves",
                       para("no load levels recorded (a study from before per-level records, or "
                            "nothing measured yet)"))
    body = ""
    if {"throughput_tok_s", "ttft_ms"} <= set(levels.columns):
        body += figure(lambda p: report.plot_curves(df, levels, p, cfg.name), "curves",
                       caption="each config's throughput-latency curve over the load levels "
                               "(first launch)")
    first = levels[levels["launch"] == 0]
    order = list(dict.fromkeys(first["name"]))
    head = "".join(f'<th colspan="{len(LEVEL_FIGURES)}">{html.escape(str(n))}</th>' for n in order)
    sub = "".join(f"<th>{html.escape(h)}</th>" for _ in order for _, h, _ in LEVEL_FIGURES)
    by_trial = df.set_index("trial")
    rows = []
    for number, part in first.groupby("trial", sort=True):
        part = part.set_index("name")
        marks = _Marks()(by_trial.loc[number].to_dict() | {"trial": number}) \
            if number in by_trial.index else f"<td>{int(number)}</td><td></td>"
        cells = "".join(cell(part.at[n, k] if n in part.index and k in part.columns else None,
                             f"{n}_{k}", d) for n in order for k, _, d in LEVEL_FIGURES)
        rows.append(f'<tr data-trial="{int(number)}">{marks}{cells}</tr>')
    body += para("every config meets the same levels; one column group per level, first launch "
                 "of each config (levels.csv holds every launch); a blank TPOT is a level whose "
                 "tokens arrived together (coalesced: levels.csv column coalesced), which times "
                 "no decoding")
    body += (f'<div class="wide"><table id="levels"><thead><tr><th rowspan="2">trial</th>'
             f'<th rowspan="2">marks</th>{head}</tr><tr>{sub}</tr></thead>'
             f'<tbody>{"".join(rows)}</tbody></table></div>')
    return section("curves", "Load curves", body)


def failures_section(df: pd.DataFrame, params, duplicates: int, engine: str = "vLLM") -> str:
    mask = (df["failure"] != "") | (df["state"] != "COMPLETE")
    if "relaunch_failed" in df.columns:
        mask |= df["relaunch_failed"] != ""
    failed = df[mask & (df["state"] != "RUNNING")]
    body = ""
    if len(failed):
        kinds = failed["failure"].replace("", "relaunch_failed").value_counts()
        items = "".join(f"<li><b>{html.escape(k)}</b> ×{v}: "
                        f"{html.escape(failure_meaning(k))}</li>" for k, v in kinds.items())
        body += f'<ul class="kinds">{items}</ul>'
        facts = [(c, h.replace(ENGINE, engine), d) for c, h, d in FAILURE_FACTS]
        if "relaunch_failed" in df.columns:
            facts.insert(0, ("relaunch_failed", "a relaunch failed", None))
        body += f'<div class="wide">{table(failed, params + facts, "failures", _Marks(), drop_empty=True)}</div>'
        body += para(f"{engine}: what the failed launch's log said; model: what the memory model "
                     "predicted before the launch (empty where it was off)")
    else:
        body += para("no launch failed and no config was skipped")
    if duplicates:
        body += para(f"{report.plural(duplicates, 'proposal')} repeated a measured config and "
                     f"{'was' if duplicates == 1 else 'were'} not launched")
    return section("failures-section", "Failures and skips", body)


def contexts_section(df: pd.DataFrame) -> str:
    """The longest context served and how fast, one row per context length (contexts.py)."""
    ctx = contexts.context_frame(df)
    name = engines.get().request_context_name
    if ctx.empty:
        return section("contexts", "Contexts", para(f"no trial has a {name} yet"))
    body = "".join(para(line) for line in contexts.headline(ctx))
    body += para("per context length: the configs that served it within every constraint, that "
                 "failed for memory at launch, that were predicted not to fit (not launched), and that "
                 "broke another constraint (the budget's peak, an SLO, the requirement); the most KV-cache tokens a served config held and how many "
                 "requests of the full length that is at once; the best figure of each objective "
                 "among the served configs and its trial")
    body += table(ctx, [("context", name, 0), ("served", "served", 0),
                        ("failed_for_memory", "failed for memory", 0),
                        ("predicted_not_to_fit", "predicted not to fit", 0),
                        ("infeasible", "broke a constraint", 0),
                        ("kv_cache_tokens", "most KV tokens", 0),
                        ("requests_at_context", "requests at once", 0),
                        ("single_stream_tok_s", "best single-stream tok/s", 1),
                        ("single_stream_trial", "trial", 0),
                        ("throughput_tok_s", "best throughput tok/s", 1),
                        ("throughput_trial", "trial", 0),
                        ("ttft_ms", "best TTFT p50 ms", 0), ("ttft_trial", "trial", 0)], "contexts")
    return section("contexts", "Contexts", body)


def roofline_section(df: pd.DataFrame, params) -> str:
    rows = df[df["roofline_pct"].notna()] if "roofline_pct" in df.columns else df.iloc[0:0]
    if rows.empty:
        return section("roofline-section", "Roofline share",
                       para("not recorded: the roofline needs the memory model and the GPU's "
                            "memory bandwidth"))
    parts = []
    for _, row in rows.iterrows():
        pct = max(0.0, min(100.0, float(row["roofline_pct"])))
        parts.append(f'<div class="bar"><span>trial {int(row["trial"])}</span>'
                     f'<div class="track"><div class="fill" style="width:{pct:.1f}%"></div></div>'
                     f"<span>{pct:.1f} %</span></div>")
    body = para("single-stream decode speed as a share of the memory-bandwidth bound "
                "(weights and KV cache read once per token)")
    body += table(rows, params + [("single_stream_tok_s", "single-stream tok/s", 1),
                                  ("roofline_tok_s", "roofline tok/s", 1),
                                  ("roofline_pct", "roofline %", 1),
                                  ("offload_suspected", "offload suspected", None)],
                  "roofline", _Marks())
    body += f'<div class="bars">{"".join(parts)}</div>'
    return section("roofline-section", "Roofline share", body)


def baselines_section(df: pd.DataFrame, params, engine: str = "vLLM") -> str:
    rows = df[df["baseline"] != ""] if len(df) else df
    if rows.empty:
        return section("baselines", "Baselines", para("no baseline measured yet"))
    cols = params + OBJECTIVE_COLUMNS + SPREAD_COLUMNS + [
        ("runs", "runs", 0), ("baseline_source", "values from", None),
        ("baseline_snapped", "snapped into the space", None)]
    rows = with_spreads(rows, df.attrs.get("noise"))
    return section("baselines", "Baselines",
                   para(f"{engine}'s defaults and the hand-tuned config, measured first (marked "
                        "in every table and plot)")
                   + table(rows, cols, "baselines", _Marks(), drop_empty=True))


def trials_section(cfg: StudyConfig, df: pd.DataFrame, params) -> str:
    cols = params + OBJECTIVE_COLUMNS + SPREAD_COLUMNS + [
        ("runs", "runs", 0), ("kv_cache_tokens", "KV tokens", 0), ("roofline_pct", "roofline %", 1),
        ("preemptions", "preemptions", 0), ("launch_s", "launch s", 1)]
    rows = with_spreads(df, df.attrs.get("noise"))
    body = f'<div class="wide">{table(rows, cols, "trials", _Marks(), drop_empty=True)}</div>'
    fx, _, _ = report._map_flags(df)   # the engine's memory-demand flag (vLLM: max_model_len)
    if len(df) and fx is not None and df[fx.name].notna().any():
        body += figure(lambda p: report.plot_parameters(df, p, cfg.name), "parameters",
                       caption="where configs fit, and parallel coordinates of flags and objectives")
    return section("trials-section", "Every trial", body)


STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:1.5em auto;max-width:1400px;padding:0 1em;color:#222}
h1,h2{font-weight:600} h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:2em}
table{border-collapse:collapse;margin:.6em 0;font-size:13px}
th,td{border:1px solid #ddd;padding:3px 7px;text-align:left;vertical-align:top}
th{background:#f4f4f4} td.num{text-align:right;font-variant-numeric:tabular-nums}
.wide{overflow-x:auto} figure.plot{margin:1em 0} figure.plot svg{max-width:100%;height:auto}
figcaption{color:#555;font-size:12px}
.badge{display:inline-block;white-space:nowrap;border-radius:3px;padding:0 5px;margin:1px;font-size:11px;color:#fff}
.pareto{background:#d62728} .baseline{background:#1f77b4} .running{background:#2ca02c}
.failed{background:#000} .failure{background:#ff7f0e}
.partial{background:#fff3cd;border:1px solid #e0c36a;padding:.5em}
.cmdline{display:flex;gap:.5em;align-items:flex-start}
.cmdline pre{flex:1;background:#f6f8fa;padding:.6em;margin:0;white-space:pre-wrap;overflow-wrap:anywhere}
.cmdline .arg{display:inline-block;max-width:100%;overflow-wrap:anywhere}
button.copy{padding:.3em .9em;cursor:pointer}
dl.facts{display:grid;grid-template-columns:max-content 1fr;gap:2px 1em} dd{margin:0}
.bars .bar{display:flex;align-items:center;gap:.6em;margin:3px 0;font-size:12px}
.bars .bar span:first-child{width:5em} .bars .track{background:#eee;height:14px;width:500px}
.bars .fill{background:#1f77b4;height:100%}
"""

# Copying: the Clipboard API where the browser allows it (https, localhost), else the selection
# and execCommand, which file:// pages still have.
SCRIPT = """
document.querySelectorAll("button.copy").forEach(function (button) {
  button.addEventListener("click", function () {
    var code = document.getElementById(button.dataset.target);
    var text = code.textContent;
    function selected() {
      var range = document.createRange();
      range.selectNodeContents(code);
      var sel = window.getSelection();
      sel.removeAllRanges();
      sel.addRange(range);
      var ok = false;
      try { ok = document.execCommand("copy"); } catch (e) { ok = false; }
      button.textContent = ok ? "copied" : "selected: press Ctrl+C";
    }
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(text).then(function () { button.textContent = "copied"; },
                                               selected);
    } else {
      selected();
    }
  });
});
"""


def page(study, cfg: StudyConfig, df: pd.DataFrame | None = None,
         levels: pd.DataFrame | None = None) -> str:
    """The whole page as one string: inline CSS, SVG plots and script; nothing fetched."""
    from optuna.trial import TrialState

    df = report.trials_frame(study, cfg.tie_tolerance, cfg.requirement) if df is None else df
    levels = report.levels_frame(study) if levels is None else levels
    duplicates = sum(1 for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                     if t.user_attrs.get("failure") == "duplicate")
    params = params_of(df, cfg)
    if df.empty:
        sections = [summary_section(study, cfg, df), para("no trials yet")]
    else:
        sections = [summary_section(study, cfg, df), commands_section(study, cfg, df),
                    front_section(cfg, df, params), noise_section(df),
                    curves_section(cfg, df, levels), contexts_section(df),
                    roofline_section(df, params),
                    baselines_section(df, params, engine_label(cfg)),
                    failures_section(df, params, duplicates, engine_label(cfg)),
                    trials_section(cfg, df, params)]
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>tuner: {html.escape(cfg.name)}</title><style>{STYLE}</style></head><body>"
            + "".join(sections) + f"<script>{SCRIPT}</script></body></html>\n")


def write(study, cfg: StudyConfig, df: pd.DataFrame | None = None,
          levels: pd.DataFrame | None = None) -> Path:
    """results/NAME/report.html, replaced whole (a reader never sees half a page)."""
    path = cfg.results_path / "report.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".html.tmp")
    tmp.write_text(page(study, cfg, df, levels), encoding="utf-8")
    tmp.replace(path)
    return path
