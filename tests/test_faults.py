"""Faults of the server and of the tuner, with real processes: each ends as a classified trial or
a resumable study, with no server process left and no finished trial lost."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from types import SimpleNamespace

import pytest
from optuna.trial import TrialState

import faultkit as fk
from tuner.run import devices
from tuner.config import parse_study
from tuner.errors import TunerError
from tuner.run.devices import GIB, GpuBusy
from tuner.run.process import LaunchSpec
from tuner.load.client import Workload
from tuner.run.measure import measure_config
from tuner.search.space import ServerParams
from tuner.search.storage import load_existing
from tuner.search.study import Platform, Tuner


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return fk.private_model(tmp_path_factory.mktemp("model"))


def config(tmp_path, doc):
    return parse_study(doc, str(tmp_path / "study.toml"), {
        "storage": f"sqlite:///{tmp_path}/s.db", "results_dir": str(tmp_path / "results")})


def run_study(cfg, n):
    return Tuner(cfg, progress=False).run(n)


def assert_no_server_left(study, marker):
    pgids = {t.user_attrs.get("server_pgid") for t in study.trials}
    assert pgids - {None}, "no server was started"
    assert fk.leftovers(pgids, [marker]) == []


# ---------------------------------------------------------------- the server dies at start

START_FAILURES = [
    ("cpu_kv_cache_too_small.log", "kv_cache_too_small", "memory"),
    ("gpu_kv_cache_too_small.log", "kv_cache_too_small", "memory"),
    ("cpu_gmu_too_small_for_weights.log", "no_cache_blocks", "memory"),
    ("gpu_no_cache_blocks.log", "no_cache_blocks", "memory"),
    ("gpu_insufficient_free_memory.log", "insufficient_free_memory", "memory"),
    ("cpu_insufficient_free_memory.log", "insufficient_free_memory", "memory"),
    ("gpu_oom.log", "oom", "memory"),
    ("cpu_port_in_use.log", "port_in_use", "launch"),
    ("crashed_unknown.log", "crashed", "launch"),
]


@pytest.mark.parametrize("excerpt,kind,constraint", START_FAILURES)
def test_server_dying_at_start_is_a_classified_trial_and_the_study_goes_on(tmp_path, model, excerpt,
                                                                           kind, constraint):
    # the fake engine prints real vLLM failure text, then exits (or, for one kind, lingers as
    # vLLM's API server does when its engine core died)
    linger = "1" if kind == "kv_cache_too_small" else "0"
    doc = fk.fake_engine_study(model, engine=(sys.executable, str(fk.FAKE_VLLM)),
                               env={"FAKE_MODE": "fail", "FAKE_LOG": str(fk.LOGS / excerpt),
                                    "FAKE_LINGER": linger})
    study = run_study(config(tmp_path, doc), 2)
    done = [t for t in study.trials if t.state == TrialState.COMPLETE]
    launched = [t for t in done if t.user_attrs["failure"] not in ("predicted_infeasible", "duplicate")]
    if kind == "no_cache_blocks":
        # no room for any cache at the space's largest share (the first baseline) rules out every
        # smaller share: the study records the rest without launching them and stops
        assert len(launched) == 1
        assert all(t.user_attrs["failure"] in ("predicted_infeasible", "duplicate") for t in done[1:])
        assert any(t.user_attrs["failure"] == "predicted_infeasible" for t in done[1:])
    else:
        assert len(launched) == 2                # the study went on past the first failure
    for t in launched:
        assert t.user_attrs["failure"] == kind
        assert t.constraints[constraint] > 0
    assert_no_server_left(study, str(model))



# ---------------------------------------------------------------- the server misbehaves once up

@pytest.mark.parametrize("mode,error_kind", [
    ("http500", "http_error"), ("drop", "disconnected"), ("garbage", "bad_stream"),
    ("truncated", "truncated"),
])
def test_misbehaving_server_is_a_failed_load_test_and_the_study_stops(tmp_path, model, mode,
                                                                     error_kind):
    # every request failing the same way says the workload or the client is wrong, not the
    # config: the study stops at once with that error, the trial kept, rather than relaunch
    cfg = config(tmp_path, fk.fake_engine_study(model, mode))
    with pytest.raises(TunerError, match=f"requests failed \\({error_kind}"):
        run_study(cfg, 2)
    study = load_existing(cfg)
    done = [t for t in study.trials if t.state == TrialState.COMPLETE]
    assert len(done) == 1
    assert (cfg.results_path / "trials.csv").exists()
    for t in done:
        assert t.user_attrs["failure"] == "load_test_failed"
        assert t.constraints["load_test"] > 0
        assert error_kind in t.user_attrs["error_kinds"]
    assert_no_server_left(study, str(model))


def test_a_well_behaved_fake_server_is_measured(tmp_path, model):
    study = run_study(config(tmp_path, fk.fake_engine_study(model, "ok")), 2)
    assert all(not t.user_attrs.get("failure") and t.values[1] > 0 for t in study.trials)
    assert_no_server_left(study, str(model))


def test_server_that_never_answers_health_is_a_startup_timeout(tmp_path, model):
    doc = fk.fake_engine_study(model, "hang_health", launch_timeout_s=2.0)
    started = time.monotonic()
    study = run_study(config(tmp_path, doc), 2)
    assert [t.user_attrs["failure"] for t in study.trials] == ["startup_timeout"] * 2
    assert all(t.constraints["launch"] > 0 for t in study.trials)
    assert time.monotonic() - started < 60
    assert_no_server_left(study, str(model))


# ---------------------------------------------------------------- the port is taken meanwhile

def test_port_taken_once_is_retried_on_another_port(tmp_path, model):
    doc = fk.fake_engine_study(model, "port_taken_once", env={"FAKE_STATE": str(tmp_path / "once")})
    study = run_study(config(tmp_path, doc), 1)
    (t,) = study.trials
    assert not t.user_attrs.get("failure") and t.values[1] > 0
    assert_no_server_left(study, str(model))


def test_port_always_taken_is_a_classified_trial(tmp_path, model):
    study = run_study(config(tmp_path, fk.fake_engine_study(model, "port_taken")), 2)
    assert [t.user_attrs["failure"] for t in study.trials] == ["port_in_use"] * 2
    assert_no_server_left(study, str(model))


def test_port_given_is_held_by_another_process(tmp_path, model):
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    port = squatter.getsockname()[1]
    spec = LaunchSpec(model=str(model), params=ServerParams(0.5, 1024, 2),
                      engine_cmd=(sys.executable, str(fk.FAKE_OPENAI)), port=port,
                      env=(("FAKE_MODE", "ok"),), launch_timeout_s=30,
                      log_path=str(tmp_path / "server.log"))
    pgids = []
    try:
        outcome = measure_config(spec, Workload(), on_started=lambda s: pgids.append(s.pgid),
                                 progress=False)
    finally:
        squatter.close()
    assert outcome.failure_kind == "port_in_use"
    assert str(port) in outcome.failure.message
    assert fk.leftovers(pgids, [str(model)]) == []


# ---------------------------------------------------------------- the GPU is busy

class FakeNvml:
    """One 80 GiB GPU, 70 GiB of it held by another process."""

    def __init__(self, monkeypatch, holder_pid):
        import pynvml

        self.total, self.used = 80 * GIB, 70 * GIB
        procs = [SimpleNamespace(pid=holder_pid, usedGpuMemory=70 * GIB)]
        for attr, value in {
            "nvmlInit": lambda: None, "nvmlDeviceGetCount": lambda: 1,
            "nvmlDeviceGetHandleByIndex": lambda i: "h0", "nvmlDeviceGetName": lambda h: "NVIDIA H100",
            "nvmlDeviceGetMemoryInfo": lambda h: SimpleNamespace(
                total=self.total, used=self.used, free=self.total - self.used),
            "nvmlDeviceGetMaxClockInfo": lambda h, kind: 2619,
            "nvmlDeviceGetMemoryBusWidth": lambda h: 5120,
            "nvmlDeviceGetComputeRunningProcesses": lambda h: procs,
            "nvmlDeviceGetGraphicsRunningProcesses": lambda h: [],
        }.items():
            monkeypatch.setattr(pynvml, attr, value)


def test_busy_gpu_is_named_waited_for_and_skipped_without_wedging_resume(tmp_path, model,
                                                                          monkeypatch):
    devices.reset_nvml()
    holder = os.getppid()  # some other live process of ours, standing in for the GPU's holder
    FakeNvml(monkeypatch, holder)
    launches = []

    def measure(spec, workload, **kw):
        launches.append(spec)
        raise AssertionError("launched although the GPU is busy")

    doc = fk.fake_engine_study(model)
    doc["server"]["gpu_busy_wait_s"] = 0.2
    cfg = config(tmp_path, doc)
    platform = Platform("cuda", "NVIDIA H100", 80 * GIB, 3350.0, ("true",), "0-fake")
    try:
        with pytest.raises(TunerError, match="the GPU stayed busy for 3 trials in a row") as err:
            Tuner(cfg, measure=measure, platform=platform, progress=False).run(1)
    finally:
        devices.reset_nvml()
    assert launches == []
    assert "\n" not in str(err.value) and f"pid {holder}" in str(err.value)
    # each refused config is skipped with its reason, not queued again: a resumed run asks the
    # sampler for something new instead of stopping on the same config forever
    study = load_existing(cfg)
    skipped = [t for t in study.trials if t.state == TrialState.FAIL]
    assert len(skipped) == 3
    for t in skipped:
        assert t.user_attrs["failure"] == "gpu_busy"
        assert "GPU 0 is busy" in t.user_attrs["failure_message"]
        assert not any(w.state == TrialState.WAITING and w.system_attrs.get("fixed_params") == t.params
                       for w in study.trials)


# ---------------------------------------------------------------- the tuner is killed (fake engine)

ALL_KILLS = [(sig, phase) for phase in ("launch", "load") for sig in ("SIGINT", "SIGTERM", "SIGKILL")]


def test_killed_tuner_resumes_with_nothing_orphaned_or_lost(tmp_path, model):
    # a real `python -m tuner run`, killed six ways, then run again with the same arguments
    # each fault meets its phase for sure: the fake server holds there until the fault is sent
    # (FAKE_HOLD_DIR), so the launch and request timeouts must outlast any wait for it
    holds = tmp_path / "holds"
    doc = fk.fake_engine_study(model, env={"FAKE_HOLD_DIR": str(holds)}, output_tokens=8,
                               launch_timeout_s=fk.patience(300))
    doc["workload"]["request_timeout_s"] = fk.patience(300)
    study_file = fk.write_study(tmp_path, doc)
    run = fk.TunerRun(study_file, f"sqlite:///{tmp_path}/s.db", tmp_path / "results", "faults", 3,
                      str(model), timeout_s=120, hold_dir=holds)
    figures, final = fk.kill_chain(run, ALL_KILLS, tmp_path)
    for f in figures:
        assert not f.note.startswith("phase not reached"), f
        assert f.exit_code == (-9 if f.scenario.startswith("SIGKILL") else 130), f
        assert f.orphans == 0 and f.lost_completed == 0, f
        if f.scenario.startswith("SIGKILL"):
            # the server's watchdog stops it once the tuner is gone (left_behind counts what was
            # still up right after the kill, within its grace); whatever was left, the next run
            # found it gone
            assert f.reaped_by_next_run, f
    assert final["exit_code"] == 0, final["stderr_tail"]
    assert final["reached"] and final["orphans"] == 0 and final["lost_completed"] == 0, final


# ---------------------------------------------------------------- real vLLM

@pytest.mark.vllm
@pytest.mark.timeout(1800)   # six real launches: 6.5 min on a busy 2-core box, 12 min at load 8
def test_real_vllm_killed_tuner_and_killed_server(tmp_path, model):
    """The real CPU build: the tuner SIGINTed while vLLM starts, SIGTERMed and SIGKILLed during
    the load test and SIGKILLed during the launch; the same command run again reaps what the
    SIGKILLed tuner left and reaches the count, and a server SIGKILLed mid-load test ends as a
    classified trial."""
    study_file = fk.write_study(tmp_path, fk.real_vllm_study(model))
    run = fk.TunerRun(study_file, f"sqlite:///{tmp_path}/s.db", tmp_path / "results",
                      "faults-vllm", 2, str(model), timeout_s=420)
    killed = {}

    def kill_server_mid_load(trial, run):
        from tuner.run.process import group_members

        killed["pgid"] = trial.user_attrs["server_pgid"]
        killed["trial"] = trial.number
        # what the kill hits, for the failure message: the group's processes and the log so far
        killed["members"] = group_members(int(killed["pgid"]))
        killed["log_tail"] = run.server_log(trial)[-1500:]
        os.killpg(int(killed["pgid"]), signal.SIGKILL)

    figures, final = fk.kill_chain(run, REAL_KILLS, tmp_path, on_final_load=kill_server_mid_load)
    for f in figures:
        assert not f.note.startswith("phase not reached"), f
        assert f.exit_code == (-9 if f.scenario.startswith("SIGKILL") else 130), f
        assert f.orphans == 0 and f.lost_completed == 0, f
        # SIGKILLed while vLLM starts, the server's watchdog stops it (TERM, then KILL after
        # 10 s: a starting vLLM ignores TERM); SIGKILLed mid-load, vLLM 0.32 (CPU) was seen
        # shutting itself down within 0.5 s. Either way none is left when the next run launches.
        if f.scenario.startswith("SIGKILL"):
            assert f.reaped_by_next_run, f
    assert final["exit_code"] == 0, final["stderr_tail"]
    assert final["reached"] and final["orphans"] == 0 and final["lost_completed"] == 0, final
    t = load_existing_by(run).trials[killed["trial"]]
    # the server killed mid-load is read from its log: no vLLM failure text, so "crashed" under load
    why = (f"killed pgid {killed['pgid']} (members then: {killed['members']}) of trial "
           f"{killed['trial']}; its attrs now: { {k: t.user_attrs.get(k) for k in ('server_pgid', 'server_port', 'failure', 'died_under_load', 'server_exit_code', 'throughput_tok_s')} }; "
           f"its log when killed ends: {killed['log_tail']!r}")
    assert t.state == TrialState.COMPLETE and t.user_attrs.get("failure") == "crashed_under_load", why
    assert t.user_attrs["died_under_load"] == "crashed" and t.user_attrs["server_exit_code"] != 0
    assert t.constraints["launch"] > 0
    # it was launched: its log's phases are attrs (the CPU build logs weights and init engine
    # only, and the engine's start shows in the timestamps), and the rest is launch_other_s
    a = t.user_attrs
    assert a["launch_weights_s"] > 0 and a["launch_profile_s"] > 0 and a["launch_other_s"] > 0
    assert a["launch_engine_start_s"] >= 0
    assert "launch_compile_s" not in a and "launch_graphs_s" not in a and "launch_warmup_s" not in a
    assert a["launch_engine_start_s"] + a["launch_weights_s"] + a["launch_profile_s"] + \
        a["launch_other_s"] == pytest.approx(a["launch_s"], abs=0.02)


REAL_KILLS = [("SIGINT", "launch"), ("SIGTERM", "load"), ("SIGKILL", "launch"), ("SIGKILL", "load")]


def load_existing_by(run):
    import optuna

    return optuna.load_study(study_name=run.name, storage=run.storage)
