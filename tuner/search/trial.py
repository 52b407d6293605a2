"""What one trial records: its objectives, constraints and attrs from a TrialOutcome, the values
told for a config that produced no measurement, a config's identity on the space's grid."""

from __future__ import annotations

import re
import shlex
from dataclasses import asdict

import optuna
from optuna.trial import FrozenTrial

from tuner.config import StudyConfig
from tuner.errors import TunerError
from tuner.records import (MAXIMIZE, OBJECTIVES, LaunchFailure, LoadMetrics, Platform, TrialOutcome,
                           is_feasible)
from tuner.load.metrics import NO_LEVEL_MEETS
from tuner.search import requirement, space

DIRECTIONS = tuple("maximize" if MAXIMIZE[k] else "minimize" for k in OBJECTIVES)
CONSTRAINTS = ("memory", "launch", "load_test", "slo", "requirement")
# A study stops at once when (nearly) every request of a launch failed with one error.
ALL_FAILED_SHARE = 0.9
# In-stream errors of a server whose KV cache ran out under the level's load (llama.cpp with a
# unified cache too small for its slots: "Context size has been exceeded."): the config's capacity,
# not a fault of the workload, so they never stop the study (see stop_if_every_request_failed).
CACHE_RAN_OUT = re.compile(r"context size has been exceeded|kv cache is full|no (free )?kv cache", re.I)


def extra_runs(study, number: int) -> list[dict]:
    """The replicate and confirmation launches of trial `number` (older studies: confirm:N)."""
    runs = list(study.user_attrs.get(f"runs:{number}", []))
    runs += [dict(r, kind="confirm") for r in study.user_attrs.get(f"confirm:{number}", [])]
    return runs


def successful_runs(study, t) -> list[dict]:
    """Every successful launch of measured trial `t`'s config, objectives by name: the trial's own,
    then its replicates and confirmations that did not fail."""
    return [dict(zip(OBJECTIVES, t.values))] + [r for r in extra_runs(study, t.number)
                                                if not r.get("failure")]


def grade_failure(params: space.ServerParams, failure: LaunchFailure) -> float:
    """How far a memory failure missed (> 0), so the sampler learns a gradient, not a wall."""
    if failure.estimated_max_model_len and params.max_model_len:
        return max(0.01, params.max_model_len / failure.estimated_max_model_len - 1)
    if failure.needed_gib and failure.available_gib and failure.available_gib > 0:
        return max(0.01, failure.needed_gib / failure.available_gib - 1)
    return 1.0


def slo_violation(cfg: StudyConfig, m: LoadMetrics) -> float:
    """How far a config misses the [slo]: 0 when some closed-loop level meets every SLO (its
    throughput there is the goodput objective), else the top figures' worst share over their SLO
    (at least 0.01). Missing the TTFT SLO at the top level alone is no violation: the TTFT
    objective already carries that level's figure."""
    w = cfg.workload
    if all(v is None for v in (w.slo_ttft_ms, w.slo_tpot_ms, w.slo_e2e_ms)):
        return 0.0
    if m.throughput_level and m.throughput_level != NO_LEVEL_MEETS:
        return 0.0
    worst = 0.0
    for slo, got in ((w.slo_ttft_ms, m.ttft_ms_p90), (w.slo_tpot_ms, m.tpot_ms_p90),
                     (w.slo_e2e_ms, m.e2e_ms_p90)):
        if slo is not None and got is not None:
            worst = max(worst, got / slo - 1)
    return max(worst, 0.01)


def slo_message(cfg: StudyConfig, m: LoadMetrics) -> str:
    w = cfg.workload
    said = [f"{name} p90 {got:,.0f} ms > {slo:g} ms" for name, slo, got in (
        ("TTFT", w.slo_ttft_ms, m.ttft_ms_p90), ("TPOT", w.slo_tpot_ms, m.tpot_ms_p90),
        ("E2E", w.slo_e2e_ms, m.e2e_ms_p90)) if slo is not None and got is not None and got > slo]
    return "no closed-loop level meets the [slo]" + (f"; at the top level {', '.join(said)}" if said else "")


def offload_figures(cfg: StudyConfig, platform: Platform, shape, outcome: TrialOutcome) -> dict:
    """The single stream against its roofline, as trial attrs: roofline_tok_s, roofline_pct and,
    below [slo] min_roofline_share of it, roofline_shortfall (wanted / measured share - 1).

    The roofline is offload-aware: the weights offloaded (what the server logged, else the
    config's --cpu-offload-gb, searched or fixed in extra_args) are read over PCIe. Empty where
    the bandwidth is unknown (the CPU build) or nothing was measured.
    """
    from tuner.search import feasibility
    from tuner.config import fixed_flag_values

    m = outcome.metrics
    if shape is None or platform.bandwidth_gbps is None or m is None:
        return {}
    logged = outcome.capacity.cpu_offload_gib if outcome.capacity is not None else None
    asked = outcome.params.cpu_offload_gb
    if asked is None:
        asked = fixed_flag_values(cfg.extra_args, cfg.source).get("cpu_offload_gb")
    offload_gib = logged if logged is not None else (asked or 0.0)
    w = cfg.workload
    bound = feasibility.roofline_tok_s(
        platform.bandwidth_gbps, shape, w.prompt_tokens + w.output_tokens // 2,
        feasibility.kv_dtype_bytes(outcome.params.kv_cache_dtype, shape.dtype_bytes),
        offload_bytes=offload_gib * 2**30, pcie_gbps=platform.pcie_gbps)
    out = {"roofline_tok_s": round(bound, 1)}
    if offload_gib:
        out["roofline_offload_gib"] = round(offload_gib, 2)
    if m.single_stream_tok_s:
        out["roofline_pct"] = round(100 * m.single_stream_tok_s / bound, 1)
        short = feasibility.roofline_shortfall(m.single_stream_tok_s, bound, cfg.min_roofline_share)
        out["offload_suspected"] = short > 0
        if short > 0:
            out["roofline_shortfall"] = round(short, 3)
    return out


def penalty_values(cfg: StudyConfig, study: optuna.Study | None = None) -> tuple[float, float, float]:
    """Objective values told for a config that produced no measurement (its constraints say why).

    The worst figures a feasible config measured so far, objective by objective: a placeholder such
    as 0 tok/s and the request timeout would stretch the GP sampler's standardised objectives so
    far that 40 ms and 360 ms of TTFT look alike. Before any feasible trial: 0, 0 and the timeout.
    """
    measured = [t.values for t in (study.get_trials(deepcopy=False) if study is not None else ())
                if is_feasible(t) and t.values is not None]
    if not measured:
        return 0.0, 0.0, cfg.workload.request_timeout_s * 1000.0
    return (min(v[0] for v in measured), min(v[1] for v in measured), max(v[2] for v in measured))


def flat_attrs(prefix: str, obj) -> dict:
    return {f"{prefix}{k}": v for k, v in asdict(obj).items()
            if v is not None and not isinstance(v, (tuple, list, dict))}


def level_dicts(m: LoadMetrics) -> list[dict]:
    return [{k: v for k, v in asdict(lv).items() if v is not None and v != ""} for lv in m.levels]


def launch_phase_attrs(outcome: TrialOutcome) -> dict:
    """launch_weights_s, launch_compile_s, ... of the phases the log named, and launch_other_s, the
    rest of launch_s (process start, imports, API server); launch_preimport_s when a warm spare
    did the engine's imports ahead of launch_s; {} when the log named none and the start was cold."""
    attrs = {}
    if outcome.launch_preimport_s is not None:
        attrs["launch_preimport_s"] = round(outcome.launch_preimport_s, 2)
    if not outcome.launch_phases:
        return attrs
    attrs.update({f"launch_{name}_s": round(s, 2) for name, s in outcome.launch_phases})
    attrs["launch_other_s"] = round(outcome.launch_s - sum(s for _, s in outcome.launch_phases), 2)
    return attrs


def run_dict(outcome: TrialOutcome, kind: str) -> dict:
    """One extra launch of a measured config (a replicate or a confirmation), for study storage."""
    m = outcome.metrics
    run = {"kind": kind, "failure": outcome.failure_kind, "launch_s": round(outcome.launch_s, 2),
           **launch_phase_attrs(outcome), "log_path": outcome.log_path}
    if outcome.failure is not None:
        run["failure_message"] = outcome.failure.message[:300]
    if m is not None:
        run.update({k: getattr(m, k) for k in OBJECTIVES})
        run["single_stream_source"] = m.single_stream_source
        run["levels"] = level_dicts(m)
        if m.load_test_failed:
            run["failure_message"] = m.load_test_failed[:300]
    return run


def config_key(params: dict, dimensions) -> tuple:
    """A config's identity: its params on the space's grid, so 0.07 and 0.07000000000000001 are one."""
    out = []
    for d in dimensions:
        v = params.get(d.name)
        if isinstance(v, float):
            v = d.snap(v) if d.step and not d.choices else round(v, 6)
        out.append((d.name, v))
    return tuple(out)


def record_outcome(trial: optuna.Trial, cfg: StudyConfig, outcome: TrialOutcome,
                   extra: dict, penalty: tuple[float, float, float] | None = None
                   ) -> tuple[float, float, float]:
    """Store everything the trial measured as user attrs and constraints; return its objective values.

    `extra` holds attrs of the trial measured beside the outcome, `offload_figures` among them: a
    roofline_shortfall there classifies a measured config cpu_offload (the slo constraint).
    """
    attrs = dict(extra)
    attrs["failure"] = outcome.failure_kind
    attrs["command"] = shlex.join(outcome.argv)
    attrs["log_path"] = outcome.log_path
    attrs["launch_s"] = round(outcome.launch_s, 2)
    attrs.update(launch_phase_attrs(outcome))
    attrs["load_s"] = round(outcome.load_s, 2)
    if outcome.server_exit_code is not None:   # the server died while it was being load-tested
        attrs["server_exit_code"] = outcome.server_exit_code
    for key in ("peak_gpu_memory", "peak_gpu_server", "peak_gpu_stranger"):
        value = getattr(outcome, f"{key}_bytes")
        if value:  # the device's use, the server's own share, and what other processes held
            attrs[f"{key}_gib"] = round(value / 2**30, 3)
    constraints = dict.fromkeys(CONSTRAINTS, 0.0)
    values = penalty if penalty is not None else penalty_values(cfg)
    f = outcome.failure
    if f is not None:
        attrs.update(failure_message=f.message[:500], failure_log_tail=f.log_tail[-2000:],
                     verdict_s=round(f.verdict_s, 2))
        for key in ("needed_gib", "available_gib", "estimated_max_model_len", "exit_code"):
            if getattr(f, key) is not None:
                attrs[key] = getattr(f, key)
        if f.is_memory:
            constraints["memory"] = grade_failure(outcome.params, f)
        else:
            constraints["launch"] = 1.0
    if outcome.capacity is not None:
        attrs.update({k: v for k, v in flat_attrs("", outcome.capacity).items()})
        # the context counted: the user's required one, else the config's own max_model_len
        context = cfg.requirement.context_tokens or outcome.params.max_model_len
        held = requirement.sequences_at_context(outcome.capacity.kv_cache_tokens, context)
        if held is not None:
            attrs.update(context_tokens=context, sequences_at_context=held)
        constraints["requirement"] = requirement.capacity_shortfall(outcome.capacity.kv_cache_tokens,
                                                                    cfg.requirement)
        if constraints["requirement"] > 0:
            attrs["failure"] = "requirement_not_met"
            attrs["failure_message"] = requirement.capacity_message(outcome.capacity.kv_cache_tokens,
                                                                    cfg.requirement)
    m = outcome.metrics
    if m is not None:
        attrs.update(flat_attrs("", m))
        attrs["levels"] = level_dicts(m)  # every level's figures: the config's load curve
        if m.load_test_failed:
            constraints["load_test"] = max(0.01, m.error_rate)
        constraints["slo"] = slo_violation(cfg, m)
        if constraints["slo"] > 0 and not attrs.get("failure"):
            attrs["failure"] = "slo_not_met"
            attrs["failure_message"] = slo_message(cfg, m)
        short = attrs.get("roofline_shortfall", 0.0)
        if short > 0:
            # a soft constraint: the measured figures stay the trial's values, so the search is
            # steered away from it, and export falls back on it only when nothing else fits
            attrs["slo_latency_violation"] = constraints["slo"]
            constraints["slo"] = max(constraints["slo"], short)
            if not attrs["failure"]:
                attrs["failure"] = "cpu_offload"
                logged = (f"; the server logged {outcome.capacity.cpu_offload_gib:g} GiB of weights "
                          "offloaded to the CPU" if outcome.capacity is not None
                          and outcome.capacity.cpu_offload_gib else "")
                attrs["failure_message"] = (
                    f"single stream {m.single_stream_tok_s:.1f} tok/s is {attrs['roofline_pct']:g} % "
                    f"of its {attrs['roofline_tok_s']:g} tok/s roofline, below [slo] "
                    f"min_roofline_share {cfg.min_roofline_share:g}: weights read from host memory"
                    f"{logged}")
        measured = (m.single_stream_tok_s, m.throughput_tok_s, m.ttft_ms)
        missing = [k for k, v in zip(OBJECTIVES, measured) if v is None]
        if m.load_test_failed:
            pass   # a failed load test's figures stay in its attrs, not in the sampler
        elif not missing:
            values = measured
        else:
            constraints["load_test"] = 1.0
            attrs["failure"] = "load_test_failed"
            attrs["failure_message"] = "no measurement of " + ", ".join(missing)
            if "single_stream_tok_s" in missing and m.single_stream_source == "untimed":
                attrs["failure_message"] += (
                    ": every single-stream response arrived in one read (a client starved of "
                    "CPU, or a buffering proxy), so its decode cannot be timed, and the server "
                    "exports no decode timing to stand in; give the tuner an idle CPU core")
        if constraints["requirement"] > 0:
            values = penalty if penalty is not None else penalty_values(cfg)
            attrs["failure"] = "requirement_not_met"
    died = outcome.died_under_load
    if died is not None:
        # the server exited during the load test: classified from its log like a launch failure,
        # its figures so far kept in the attrs, and a constraint that steers the search away
        attrs.update(failure=outcome.failure_kind, failure_message=died.message[:500],
                     failure_log_tail=died.log_tail[-2000:], died_under_load=died.kind)
        if m is not None:
            reached = [lv.name for lv in m.levels if lv.requests > lv.failed]
            broke = next((lv.name for lv in m.levels if lv.failure), "")
            attrs.update(last_level_served=reached[-1] if reached else "", died_at_level=broke)
        for key in ("needed_gib", "available_gib"):
            if getattr(died, key) is not None:
                attrs[key] = getattr(died, key)
        if died.is_memory:
            constraints["memory"] = max(constraints["memory"], grade_failure(outcome.params, died))
        else:
            constraints["launch"] = 1.0
        values = penalty if penalty is not None else penalty_values(cfg)
    if not attrs.get("failure") and (over := over_budget(attrs, cfg.memory_budget_gib)) is not None:
        # measured figures stay its values (what it did); the constraint keeps it off the front
        attrs.update(failure="over_budget", failure_message=over[1])
        constraints["memory"] = max(constraints["memory"], over[0])
    for key, value in attrs.items():
        trial.set_user_attr(key, value)
    for key, value in constraints.items():
        trial.set_constraint(key, value)
    return values


def over_budget(attrs: dict, budget_gib: float | None) -> tuple[float, str] | None:
    """Under a memory budget (a smaller card emulated by a share of this one): how far, and why,
    the server's measured peak of device memory exceeds the budget. vLLM keeps what it plans
    (weights, activations, KV cache) within the share, but a peak outside that plan (seen while
    loading offloaded AWQ weights) needs that memory on a real card of the budget's size too. NVML
    also counts memory PyTorch's allocator holds freed, which a smaller card would reuse, so this
    is the cautious reading: such a config is kept off the front. None when within the budget, and
    under a ballast (`memory_budget_mode` in attrs): the card then had only the budget free, so a
    peak above it would have failed for real."""
    peak = attrs.get("peak_gpu_server_gib") or attrs.get("peak_gpu_memory_gib")
    if not budget_gib or not peak or peak <= budget_gib or attrs.get("memory_budget_mode") == "ballast":
        return None
    return (max(0.01, peak / budget_gib - 1),
            f"the server's measured peak, {peak:g} GiB of device memory, exceeds the "
            f"{budget_gib:g} GiB memory budget: a card of that size can run out of memory "
            "(unless the excess was memory PyTorch held unused, which a smaller card reuses)")


# ---------------------------------------------------------------- the run


def last_failure_message(study: optuna.Study) -> str:
    t = study.get_trials(deepcopy=False)[-1]
    return t.user_attrs.get("failure_message", t.user_attrs.get("failure", ""))[:200]


def stop_if_every_request_failed(t: FrozenTrial, outcome: TrialOutcome) -> None:
    """A launch whose load test failed on (nearly) every request with one error says the workload
    or the client is wrong, not the config: stop with that error rather than relaunch for nothing."""
    m = outcome.metrics
    # a request refused as longer than the config's context is a fact of that config, not a
    # fault of the workload or the client: it does not count here
    failed = m.requests_failed - m.rejected_for_length if m is not None else 0
    if m is None or not m.requests_sent or failed < ALL_FAILED_SHARE * m.requests_sent:
        return
    if outcome.server_exit_code is not None or outcome.died_under_load is not None:
        return   # the server died under load: that is this config's (or an outside kill's) doing
    if CACHE_RAN_OUT.search(m.top_error or ""):
        return   # the config's cache ran out at this load: a fact of the config, as a failed launch is
    hint = "check [workload] (prompt/output tokens, endpoint) against the model and its tokenizer"
    if "401" in m.top_error or "Unauthorized" in m.top_error:
        hint = "the server wants an API key: export VLLM_API_KEY for the tuner"
    elif "timeout" in m.top_error:
        hint = "raise [workload] request_timeout_s or lower the load levels"
    raise TunerError(f"stopping: trial {t.number}'s server started but {m.requests_failed} of "
                     f"{m.requests_sent} requests failed ({m.top_error[:160]}); {hint}. "
                     "The trial is kept; fix this and run the same command to go on")


def outcome_dict(outcome: TrialOutcome) -> dict:
    """A TrialOutcome as one flat JSON-ready dict (for `measure`)."""
    out = {"failure": outcome.failure_kind, "command": shlex.join(outcome.argv),
           "log_path": outcome.log_path, "launch_s": round(outcome.launch_s, 2),
           **launch_phase_attrs(outcome), "load_s": round(outcome.load_s, 2)}
    out.update(outcome.params.values())
    for part in (outcome.failure, outcome.capacity, outcome.metrics):
        if part is not None:
            out.update({k: v for k, v in asdict(part).items() if k not in out and v is not None})
    return out


def predicted_grade(params: space.ServerParams, prediction) -> float:
    if prediction.max_model_len_fit and params.max_model_len:
        return max(0.01, params.max_model_len / max(prediction.max_model_len_fit, 1) - 1)
    if prediction.needed_gib and prediction.available_gib:
        return max(0.01, prediction.needed_gib / max(prediction.available_gib, 1e-9) - 1)
    return 1.0


def describe(t: FrozenTrial) -> str:
    a = t.user_attrs
    if a.get("failure") == "load_test_failed" and not a.get("requests_failed"):
        return f"trial {t.number}: load_test_failed ({str(a.get('failure_message', ''))[:300]})"
    if a.get("failure") == "load_test_failed":
        return (f"trial {t.number}: load_test_failed ({a.get('requests_failed', '?')} of "
                f"{a.get('requests_sent', '?')} requests failed: {str(a.get('top_error', ''))[:120]})")
    if a.get("failure") == "cpu_offload":
        return (f"trial {t.number}: cpu_offload (single-stream {a.get('single_stream_tok_s', 0):.1f} "
                f"tok/s, {a.get('roofline_pct', 0):g} % of its roofline)")
    if a.get("failure"):
        extra = a.get("estimated_max_model_len")
        if extra:
            return f"trial {t.number}: {a['failure']} (fits {extra} tokens)"
        # the reason on the line itself: "crashed" alone sent the user to trials.csv to learn
        # that vLLM refused a flag or could not read the model
        why = " ".join(str(a.get("failure_message", "")).split())
        return f"trial {t.number}: {a['failure']}" + (f" ({why[:200]})" if why else "")
    ss, tp, ttft = t.values
    return (f"trial {t.number}: single-stream {ss:.1f} tok/s, throughput {tp:.1f} tok/s, "
            f"TTFT p50 {ttft:.0f} ms")
