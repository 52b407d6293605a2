"""Many workers on one study: `run --parallel 2` against fake servers, on SQLite and on a real
PostgreSQL; one worker SIGKILLed mid-launch. A correctness test on a 2-core box, not a speed figure."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import optuna
import pytest
from optuna.trial import TrialState

import faultkit as fk
import postgres
from tuner.search import parallel
from tuner.search.study import DIRECTIONS, RequeueOnce

SAME = {"gpu_memory_utilization": 0.5, "max_model_len": 1024, "max_num_seqs": 2}
TRIALS = 5


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return fk.private_model(tmp_path_factory.mktemp("model"))


@pytest.fixture
def pg_url():
    with postgres.server() as url:
        yield url


def test_worker_argv_drops_the_supervisors_own_options():
    argv = ["run", "--trials", "4", "--parallel", "2", "--gpus=0,1", "--first-worker", "2", "--quiet"]
    assert parallel.worker_argv(argv, 3, range(20200, 20400)) == [
        "run", "--trials", "4", "--quiet", "--worker", "3", "--ports", "20200-20399", "--quiet"]


def test_requeue_once_keeps_the_params_and_baseline_not_the_dead_workers_marks(tmp_path):
    storage = f"sqlite:///{tmp_path}/s.db"
    study = optuna.create_study(storage=storage)
    trial = study.ask()
    trial.suggest_int("max_num_seqs", 1, 8)
    for key, value in {"baseline": "hand-tuned", "tuner_pid": 1, "server_pgid": 2}.items():
        trial.set_user_attr(key, value)
    study.tell(trial, state=TrialState.FAIL)
    again = RequeueOnce()
    again(study, study.trials[0])
    retry = study.trials[1]
    assert retry.state == TrialState.WAITING and retry.params == study.trials[0].params
    assert retry.user_attrs == {"baseline": "hand-tuned"}
    assert retry.system_attrs["failed_trial"] == 0   # Optuna's retry convention
    study.tell(study.ask(), state=TrialState.FAIL)   # the retry fails too: not queued a third time
    again(study, study.trials[1])
    assert len(study.trials) == 2


@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_two_workers_share_the_budget_and_a_killed_ones_trial_is_finished_by_the_other(
        tmp_path, model, backend, request):
    storage = (f"sqlite:///{tmp_path}/s.db" if backend == "sqlite"
               else request.getfixturevalue("pg_url"))
    holds = tmp_path / "holds"
    doc = fk.fake_engine_study(model, name="par", env={"FAKE_HOLD_DIR": str(holds)},
                               launch_timeout_s=fk.patience(300))
    doc["workload"]["request_timeout_s"] = fk.patience(300)
    study_file = fk.write_study(tmp_path, doc)
    # one config queued twice: each worker takes one at once, and one must wait for the other
    study = optuna.create_study(study_name="par", storage=storage, directions=list(DIRECTIONS))
    study.enqueue_trial(SAME)
    study.enqueue_trial(SAME, skip_if_exists=False)
    run = fk.TunerRun(study_file, storage, tmp_path / "results", "par", TRIALS, str(model),
                      hold_dir=holds)
    run.hold("launch")   # every server holds before it binds its port, until let go
    stderr = tmp_path / "tuner-stderr.log"
    with open(stderr, "ab") as out:
        proc = subprocess.Popen([*run.argv(), "--parallel", "2"], cwd=fk.REPO, stdout=out,
                                stderr=out, stdin=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=fk.terminal_signals,
                                env={**os.environ, "PYTHONPATH": str(fk.REPO)})
    try:
        victim, killed_pid = _kill_a_worker_mid_launch(run, proc, stderr)
        run.hold(None)
        code = proc.wait(timeout=fk.patience(300))
    finally:
        run.hold(None)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log = stderr.read_text(errors="replace")
    assert code == 0, log[-3000:]
    trials = fk.trials(storage, "par")
    by_number = {t.number: t for t in trials}

    # the killed worker's server is gone, and so is every other server
    pgids = {t.user_attrs["server_pgid"] for t in trials if t.user_attrs.get("server_pgid")}
    assert victim.user_attrs["server_pgid"] in pgids
    assert fk.leftovers(pgids, [str(model)]) == []
    # its trial was failed once and queued again once; the other worker finished the retry
    dead = by_number[victim.number]
    assert dead.state == TrialState.FAIL and dead.user_attrs["failure"] == "interrupted"
    retries = [t for t in trials if t.system_attrs.get("failed_trial") == victim.number]
    assert len(retries) == 1, log[-3000:]
    retry = retries[0]
    assert retry.state == TrialState.COMPLETE and retry.params == dead.params
    assert retry.user_attrs["tuner_pid"] != killed_pid
    assert retry.user_attrs.get("failure") in ("", "duplicate")   # measured, or its twin's figures
    # none lost or left half done, the budget shared exactly
    assert not [t.number for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    launches = [t for t in trials if t.user_attrs.get("launch_at")]
    measured = [t for t in launches if t.state == TrialState.COMPLETE]
    assert len(measured) == TRIALS, [(t.number, t.state, t.user_attrs.get("failure")) for t in trials]
    assert len({t.user_attrs["tuner_pid"] for t in measured}) == 2   # both workers launched
    # the config queued twice was launched once; its twin waited and took its figures
    first, second = sorted((t for t in trials if t.params == SAME and t.number < 2),
                           key=lambda t: t.number)
    assert first.user_attrs.get("launch_at") and second.user_attrs["failure"] == "duplicate"
    assert second.user_attrs["duplicate_of"] == first.number and second.values == first.values
    assert "is measuring this config; waiting for it" in log
    # no config measured twice at once: launches of one config never overlap in time
    spans = sorted((tuple(sorted(t.params.items())), t.user_attrs["launch_at"],
                    t.datetime_complete.timestamp()) for t in launches)
    for (key_a, _, end_a), (key_b, start_b, _) in zip(spans, spans[1:]):
        assert key_a != key_b or start_b >= end_a - 1.0, (key_a, spans)
    # each worker's servers bound ports of its own range
    for t in launches:
        slot = t.user_attrs["tuner_worker"]
        assert t.user_attrs["server_port"] in parallel.worker_ports(slot)


def _kill_a_worker_mid_launch(run, proc, stderr):
    """Let the first held launch go once both twins of SAME are running (so one waits for the
    other), then SIGKILL the worker of the next launch held once that one is measured."""
    holds = run.hold_dir
    released: set[int] = set()
    deadline = time.monotonic() + fk.patience(300)
    while time.monotonic() < deadline:
        assert proc.poll() is None, stderr.read_text(errors="replace")[-3000:]
        trials = fk.trials(run.storage, run.name)
        running = {t.user_attrs.get("server_pgid"): t for t in trials
                   if t.state == TrialState.RUNNING and t.user_attrs.get("server_pgid")}
        twins = [t for t in trials if t.state == TrialState.RUNNING and t.params == SAME]
        measured = [t for t in trials if t.state == TrialState.COMPLETE
                    and t.user_attrs.get("launch_at")]
        for at in holds.glob("at-launch.*"):
            pid = int(at.name.rsplit(".", 1)[1])
            t = running.get(pid)
            if t is None or pid in released:
                continue
            if measured:
                worker = t.user_attrs["tuner_pid"]
                os.kill(worker, signal.SIGKILL)
                return t, worker
            if len(twins) == 2 or released:
                released.add(pid)
                (holds / f"go.{pid}").touch()
        time.sleep(0.2)
    raise AssertionError("no launch to kill a worker in: " + stderr.read_text(errors="replace")[-3000:])
