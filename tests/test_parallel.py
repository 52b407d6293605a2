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
from fakes import FAKE_PLATFORM, FakeDevice, FakeGpu, FakeNvml, fake_config
from tuner import cli
from tuner.run import devices
from tuner.search import parallel, space
from tuner.search import storage as storage_module
from tuner.search import study as study_module
from tuner.search.sampler import make_sampler
from tuner.search.storage import RequeueOnce
from tuner.search.study import Tuner
from tuner.search.trial import CONSTRAINTS, DIRECTIONS

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


# ---------------------------------------------------------------- --gpus refusals


@pytest.fixture
def fresh_nvml():
    devices.reset_nvml()
    yield
    devices.reset_nvml()


def four_gpus(monkeypatch) -> FakeNvml:
    return FakeNvml(monkeypatch, *[FakeGpu(uuid=f"GPU-{i}{i}{i}{i}-beef") for i in range(4)])


def refused_run(tmp_path, model, monkeypatch, capsys, *args: str, env: dict | None = None) -> str:
    """`run ARGS` in this process: exit code 2, one line on stderr, nothing written or launched."""
    doc = fk.fake_engine_study(model, name="gpus", env=env)
    study_file = fk.write_study(tmp_path, doc)
    monkeypatch.setattr(cli.signal, "signal", lambda *a: None)   # pytest keeps its own handlers
    code = cli.main(["run", "--study", str(study_file), "--trials", "2", "--results",
                     str(tmp_path / "results"), "--storage", f"sqlite:///{tmp_path}/db/s.db", *args])
    out, err = capsys.readouterr()
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith("model ")]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("tuner: error: --"), err
    assert out == ""
    assert not (tmp_path / "results").exists() and not (tmp_path / "db").exists()
    return lines[0]


@pytest.mark.parametrize("gpus,words", [
    ("", ["--gpus ''", "distinct GPUs separated by commas"]),
    ("0,,1", ["distinct GPUs"]),
    ("1,1", ["distinct GPUs"]),
    ("1,GPU-1111", ["'1' and 'GPU-1111' are the same GPU", "one worker per GPU"]),
    ("0,7", ["'7' is not an NVML index (NVML sees 4 GPUs)", "0 (NVIDIA H100 80GB HBM3)"]),
    ("0,GPU-9999", ["'GPU-9999' matches no device NVML sees"]),
    ("0,nvidia1", ["'nvidia1' is neither an index nor a GPU-/MIG- UUID"]),
])
def test_gpus_that_are_not_this_hosts_are_refused(tmp_path, model, monkeypatch, capsys, fresh_nvml,
                                                   gpus, words):
    four_gpus(monkeypatch)
    line = refused_run(tmp_path, model, monkeypatch, capsys, "--gpus", gpus)
    for w in words:
        assert w in line, line


def test_gpus_on_a_host_without_gpus_are_refused(tmp_path, model, monkeypatch, capsys, fresh_nvml):
    fake = four_gpus(monkeypatch)
    fake.devices = []
    line = refused_run(tmp_path, model, monkeypatch, capsys, "--gpus", "0,1")
    assert "NVML sees no GPU on this host" in line and "--parallel N" in line


def test_gpus_disagreeing_with_parallel_or_the_study_env_are_refused(tmp_path, model, monkeypatch,
                                                                      capsys, fresh_nvml):
    four_gpus(monkeypatch)
    line = refused_run(tmp_path, model, monkeypatch, capsys, "--gpus", "0,1", "--parallel", "3")
    assert "--parallel 3 with 2 GPUs" in line
    line = refused_run(tmp_path, model, monkeypatch, capsys, "--gpus", "0,1",
                       env={"CUDA_VISIBLE_DEVICES": "2"})
    assert "both choose the GPU" in line


def test_gpus_refused_by_the_real_command_on_this_host(tmp_path, model):
    """Through `python -m tuner` with this host's own NVML (none here: no NVIDIA driver)."""
    if devices.all_gpus():
        pytest.skip("this host has GPUs: the fake-NVML tests above cover the refusals")
    study_file = fk.write_study(tmp_path, fk.fake_engine_study(model, name="gpus"))
    p = subprocess.run([sys.executable, "-m", "tuner", "run", "--study", str(study_file),
                        "--trials", "2", "--gpus", "0,1", "--results", str(tmp_path / "results"),
                        "--storage", f"sqlite:///{tmp_path}/db/s.db"], cwd=fk.REPO,
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(fk.REPO)})
    lines = [ln for ln in p.stderr.strip().splitlines() if not ln.startswith("model ")]
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert lines[0].startswith("tuner: error: --gpus 0,1: NVML sees no GPU on this host")
    assert not (tmp_path / "results").exists() and not (tmp_path / "db").exists()


# ---------------------------------------------------------------- the workers' lines


def test_slot_labels():
    assert parallel.slot_label(0, None) == "[w0] "
    assert parallel.slot_label(1, "1") == "[w1 gpu1] "
    assert parallel.slot_label(5, "GPU-1234567890abcdef") == "[w5 gpuGPU-12345678…] "


def test_every_line_of_a_worker_comes_out_behind_its_label(tmp_path):
    """A real child's stdout and stderr through the pipe `run --parallel` gives each worker:
    every line labelled, whole (two writers never mix within a line), the last one without its
    newline too."""
    import io
    import threading

    script = ("import sys\n"
              "for i in range(200):\n"
              "    print(f'trial {i}: out', flush=True)\n"
              "    print(f'trial {i}: err', file=sys.stderr, flush=True)\n"
              "sys.stderr.write('Traceback: the end, no newline')\n")
    out, lock = io.StringIO(), threading.Lock()
    readers = []
    for index in (0, 1):
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace")
        t = threading.Thread(target=parallel.forward_lines,
                             args=(proc.stdout, parallel.slot_label(index, str(index)), out, lock))
        t.start()
        readers.append((proc, t))
    for proc, t in readers:
        proc.wait(60)
        t.join(60)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 * 401
    for index in (0, 1):
        mine = [ln for ln in lines if ln.startswith(f"[w{index} gpu{index}] ")]
        assert len(mine) == 401
        body = [ln[len(f"[w{index} gpu{index}] "):] for ln in mine]
        assert body[-1] == "Traceback: the end, no newline"
        assert sorted(body[:-1]) == sorted(f"trial {i}: {s}" for i in range(200) for s in ("out", "err"))


# ---------------------------------------------------------------- the shared study, in this process


def test_grid_workers_share_one_grid_order_and_pick_on_their_own(tmp_path):
    """GridSampler's seed shuffles the grid and its ids number that order; workers on one study
    read each other's ids, so with seed + k each would take the others' ids for other configs."""
    cfg = fake_config(tmp_path, sampler="grid", seed=3)
    samplers = [make_sampler(cfg, worker=k) for k in range(3)]
    assert samplers[0]._all_grids == samplers[1]._all_grids == samplers[2]._all_grids
    picks = [s._rng.rng.randint(10**9) for s in samplers]
    assert len(set(picks)) == 3


def measured_twice(tmp_path):
    """A shared study of `fake_config` with one config queued twice: the first trial asked (not
    yet claimed), and the second, measured (by another worker, say) in the meantime."""
    cfg = fake_config(tmp_path)
    tuner = Tuner(cfg, measure=FakeDevice(), platform=FAKE_PLATFORM, progress=False, worker=1)
    study = optuna.create_study(study_name=cfg.name, storage=tuner.storage,
                                directions=list(DIRECTIONS))
    config = {d.name: d.grid()[1] for d in cfg.dimensions}
    study.enqueue_trial(config)
    study.enqueue_trial(config, skip_if_exists=False)
    asked, other = study.ask(), study.ask()
    space.suggest(asked, cfg.dimensions)
    space.suggest(other, cfg.dimensions)
    for key in CONSTRAINTS:
        other.set_constraint(key, 0.0)
    other.set_user_attr("failure", "")
    study.tell(other, [100.0, 900.0, 50.0])
    return tuner, study, asked, other


def test_a_claim_tells_the_figures_of_a_config_measured_since_it_was_asked(tmp_path):
    """The race the replay bench found: worker B asks config X while A measures it, A finishes
    before B claims; B must not launch X again."""
    tuner, study, asked, other = measured_twice(tmp_path)
    assert tuner.claim(study, asked, n_target=10) == "duplicate"
    told = study.trials[asked.number]
    assert told.user_attrs["failure"] == "duplicate"
    assert told.user_attrs["duplicate_of"] == other.number and told.values == [100.0, 900.0, 50.0]


def test_a_queued_config_asked_once_the_budget_is_spent_is_queued_again(tmp_path):
    """A worker that asked a queued config (a baseline, a retry) while the others' launches spent
    the budget ends its trial unlaunched, and the config waits in the queue for a larger budget."""
    tuner, study, asked, other = measured_twice(tmp_path)
    study.enqueue_trial({**asked.params, "max_num_seqs": 64}, user_attrs={"baseline": "hand-tuned"})
    late = study.ask()
    space.suggest(late, tuner.cfg.dimensions)
    assert tuner.claim(study, late, n_target=1) == "budget_spent"
    trials = study.get_trials(deepcopy=False)
    assert trials[late.number].state == TrialState.FAIL
    assert trials[late.number].user_attrs["failure"] == "budget_spent"
    again = [t for t in trials if t.state == TrialState.WAITING]
    assert len(again) == 1 and again[0].system_attrs["fixed_params"] == trials[late.number].params
    assert again[0].user_attrs == {"baseline": "hand-tuned"}


@pytest.mark.timeout(120)
def test_a_trial_whose_heart_stopped_on_another_host_is_failed_and_finished_here(tmp_path,
                                                                                 monkeypatch):
    """The cross-host path, in this process: a trial of a worker on another host (its pid cannot
    be checked from here) that beat once and went silent. This worker's stale check fails it after
    the grace period (Optuna's fail_stale_trials, shortened to 2 s here), queues it again once
    (RequeueOnce), and measures the retry; the budget is met exactly."""
    monkeypatch.setattr(storage_module, "HEARTBEAT_INTERVAL_S", 1)
    monkeypatch.setattr(storage_module, "HEARTBEAT_GRACE_S", 2)
    monkeypatch.setattr(study_module, "WAIT_POLL_S", 0.1)
    cfg = fake_config(tmp_path)
    elsewhere = Tuner(cfg, measure=FakeDevice(), platform=FAKE_PLATFORM, progress=False, worker=0)
    study = elsewhere.open()
    silent = study.ask()
    space.suggest(silent, cfg.dimensions)
    for key, value in {"tuner_pid": 1, "tuner_host": "another-host", "tuner_worker": 0,
                       "launching": True, "launch_at": time.time(), "server_pgid": 4343}.items():
        silent.set_user_attr(key, value)
    elsewhere.storage.record_heartbeat(silent._trial_id)   # one beat, then silence
    started = time.monotonic()

    device = FakeDevice()
    here = Tuner(cfg, measure=device, platform=FAKE_PLATFORM, progress=False, worker=1,
                 report_at_end=False)
    here.run(3)
    took = time.monotonic() - started
    trials = optuna.load_study(study_name=cfg.name, storage=cfg.storage).trials
    dead = trials[silent.number]
    assert dead.state == TrialState.FAIL
    retries = [t for t in trials if t.system_attrs.get("failed_trial") == silent.number]
    assert len(retries) == 1
    retry = retries[0]
    assert retry.state == TrialState.COMPLETE and retry.params == dead.params
    assert retry.user_attrs["tuner_pid"] == os.getpid() and retry.user_attrs["tuner_worker"] == 1
    assert retry.user_attrs.get("baseline") == dead.user_attrs.get("baseline")   # kept
    assert space.params_from(retry.params) in device.launches
    assert len(device.launches) == 3 and here.launched_count(study) == 3
    assert not [t.number for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    assert took >= 2.0   # not before its grace ran out


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
    # no --gpus: one line says the workers share the device, so their figures skew each other
    assert log.count("--parallel 2 without --gpus: the workers share") == 1
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
    # both workers launched: the killed one at least its dead trial (its first may have been the
    # twin that took the other's figures), the survivor every measured one after the kill
    assert {t.user_attrs["tuner_pid"] for t in launches} == {killed_pid, retry.user_attrs["tuner_pid"]}
    # the config queued twice was launched once; its twin waited and took its figures
    # (either twin may claim first: each worker asks one, and the claims race)
    twins = [t for t in trials if t.params == SAME and t.number < 2]
    launched_twins = [t for t in twins if t.user_attrs.get("launch_at")]
    assert len(twins) == 2 and len(launched_twins) == 1, [(t.number, t.user_attrs) for t in twins]
    first = launched_twins[0]
    second = next(t for t in twins if t is not first)
    assert second.user_attrs["failure"] == "duplicate"
    assert second.user_attrs["duplicate_of"] == first.number and second.values == first.values
    assert "is measuring this config; waiting for it" in log
    # every line a worker printed is behind its slot's label; both workers printed
    worker_lines = [ln for ln in log.splitlines()
                    if "[trial " in ln or "is measuring this config" in ln or ln.lstrip().startswith("trial ")
                    and (": single-stream" in ln or ": duplicate" in ln)]
    assert worker_lines and all(ln.startswith(("[w0] ", "[w1] ")) for ln in worker_lines), worker_lines
    assert {ln[:5] for ln in worker_lines} == {"[w0] ", "[w1] "}
    assert [ln for ln in log.splitlines() if ln.startswith("[w0] [trial ")]
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
