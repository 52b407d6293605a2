"""A user's runs that go wrong, and the other engine: a tuner killed with SIGKILL, interrupted
trials queued again, launches that fail for a reason of their own (a bad flag, a broken model
folder, a taken port)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tuner.run import process
from tuner.run.process import ServerProcess, group_members

REPO = Path(__file__).resolve().parent.parent
FAKE_VLLM = str(REPO / "tests" / "fake_vllm.py")

from test_spare import _alive  # noqa: E402  (a process that is neither gone nor a zombie)


def _wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


# ---------------------------------------------------------------- no server outlives a SIGKILLed tuner

TUNER_LIKE = """
import sys, time
sys.path.insert(0, {repo!r})
from tuner.run.process import LaunchSpec, ServerProcess
from tuner.search.space import ServerParams
spec = LaunchSpec(model="tiny", params=ServerParams(), engine_cmd=({python!r}, {fake!r}),
                  env=(("FAKE_MODE", {mode!r}), ("FAKE_PIDS", {pids!r})), stop_timeout_s=1.0,
                  log_path={log!r})
server = ServerProcess(spec)
server.start()
open({pgid_file!r}, "w").write(str(server.pgid))
while True:
    time.sleep(0.1)
"""


@pytest.mark.parametrize("mode", ["silent", "stubborn"])
def test_server_of_a_sigkilled_tuner_is_stopped_by_its_watchdog(tmp_path, mode):
    """`kill -9` of the tuner ran no cleanup, so its server (its own session, so no signal of the
    tuner's reaches it) lived on, serving, until the next `run` of the same study reaped it, and
    forever when there was none. The watchdog sees its pipe close and stops the whole group, a
    member that ignores SIGTERM included."""
    pgid_file, pids = tmp_path / "pgid", tmp_path / "pids"
    code = TUNER_LIKE.format(repo=str(REPO), python=sys.executable, fake=FAKE_VLLM, mode=mode,
                             pids=str(pids), log=str(tmp_path / "server.log"), pgid_file=str(pgid_file))
    tuner = subprocess.Popen([sys.executable, "-c", code])
    try:
        assert _wait_for(pgid_file.exists, 30), "the tuner-like process never started its server"
        pgid = int(pgid_file.read_text())
        if mode == "stubborn":   # its worker, forked, ignores SIGTERM too
            assert _wait_for(lambda: pids.exists() and pids.read_text().strip(), 30)
        members = group_members(pgid)
        assert members
        tuner.send_signal(signal.SIGKILL)
        tuner.wait(10)
        # TERM at once, KILL after the spec's 1 s grace
        assert _wait_for(lambda: not group_members(pgid), 20), group_members(pgid)
        assert not any(_alive(pid) for pid in members)
    finally:
        if tuner.poll() is None:
            tuner.kill()
        if pgid_file.exists():
            try:
                os.killpg(int(pgid_file.read_text()), signal.SIGKILL)
            except OSError:
                pass


def test_a_stopped_server_releases_its_watchdog(tmp_path):
    """A server the tuner stopped itself: its watchdog exits without touching anything."""
    from tuner.records import LaunchSpec
    from tuner.search.space import ServerParams

    spec = LaunchSpec(model="tiny", params=ServerParams(), engine_cmd=(sys.executable, FAKE_VLLM),
                      env=(("FAKE_MODE", "silent"),), stop_timeout_s=1.0,
                      log_path=str(tmp_path / "server.log"))
    server = ServerProcess(spec)
    server.start()
    watchdog = server._watchdog
    assert watchdog is not None and watchdog.poll() is None
    server.stop()
    assert watchdog.poll() == 0
    assert group_members(server.pgid) == []


def test_watchdog_stops_only_a_group_leader_it_saw(tmp_path):
    """Its pipe closed without "stop": a live group leader it saw is stopped; a pid that leads no
    group (a group id the kernel could hand out again) is left alone."""
    leader = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                              start_new_session=True)
    member = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        watchdogs = [process.start_watchdog(p.pid, 0.5) for p in (leader, member)]
        time.sleep(1.0)   # both have looked at their pid
        for w in watchdogs:
            w.stdin.close()
        assert [w.wait(15) for w in watchdogs] == [0, 0]
        assert _wait_for(lambda: leader.poll() is not None, 10)
        assert member.poll() is None
    finally:
        for p in (leader, member):
            if p.poll() is None:
                p.kill()
            p.wait()


# ---------------------------------------------------------------- a fixed flag the engine refuses

VLLM_USAGE_TAIL = """\
                     [--enable-log-requests | --no-enable-log-requests]
                     [model_tag]
api_server.py: error: unrecognized arguments: --no-such-flag
"""


def test_an_unknown_fixed_flag_names_itself_in_the_failure():
    """vLLM's (and the llama.cpp wrapper's) argparse prints no exception: the root cause was ""
    and the trial said only "server exited with code 2"."""
    from tuner.engines import llamacpp
    from tuner.engines.base import root_cause

    assert root_cause(VLLM_USAGE_TAIL) == "api_server.py: error: unrecognized arguments: --no-such-flag"
    text = "usage: llama-server (xllamacpp) [-h] -m MODEL\nllama-server (xllamacpp): error: " \
           "unrecognized arguments: --bogus-flag\n"
    assert root_cause(text).endswith("unrecognized arguments: --bogus-flag")
    # an exception, when there is one, still comes first
    assert root_cause("ValueError: bad dtype\nx.py: error: later\n") == "ValueError: bad dtype"
    assert llamacpp.classify(text) is None   # no pattern: the exit and its root cause decide


PYDANTIC_TAIL = """\
(APIServer pid=4321) Traceback (most recent call last):
pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig
  Value error, The checkpoint you are trying to load has model type `foobar` but Transformers does not recognize this architecture. [type=value_error, input_value=ArgsKwargs((), {}), input_type=ArgsKwargs]
    For further information visit https://errors.pydantic.dev/2.14/v/value_error
"""


def test_a_model_folder_vllm_refuses_names_the_reason_not_just_the_validation_count():
    """A config.json whose model type vLLM does not know: every launch read
    "crashed (pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig)"."""
    from tuner.engines.base import root_cause

    cause = root_cause(PYDANTIC_TAIL)
    assert cause.startswith("pydantic_core._pydantic_core.ValidationError: 1 validation error for "
                            "ModelConfig: Value error, The checkpoint you are trying to load has "
                            "model type `foobar`"), cause


def test_a_real_llamacpp_launch_with_an_unknown_flag_says_which(tmp_path):
    from tuner.engines.llamacpp import ENGINE
    from tuner.models.presets import TINY_MODEL
    from tuner.records import LaunchFailure, LaunchSpec
    from tuner.search.space import ServerParams

    pytest.importorskip("xllamacpp")
    spec = LaunchSpec(model=str(TINY_MODEL), params=ServerParams(extra=(("ctx_size", 512), ("parallel", 1))),
                      engine="llamacpp", engine_cmd=tuple(ENGINE.default_cmd()),
                      extra_args=("-t", "1", "--bogus-flag"), launch_timeout_s=60,
                      log_path=str(tmp_path / "server.log"))
    with ServerProcess(spec) as server:
        server.start()
        failure = server.wait_ready()
    assert isinstance(failure, LaunchFailure) and failure.kind == "crashed"
    assert "unrecognized arguments: --bogus-flag" in failure.message, failure.log_tail
    assert (tmp_path / "server.log").read_text().rstrip().endswith("--bogus-flag")


def test_a_failed_launch_line_gives_its_reason():
    from types import SimpleNamespace

    from tuner.search.trial import describe

    t = SimpleNamespace(number=4, user_attrs={
        "failure": "crashed", "failure_message": "api_server.py: error: unrecognized arguments: --x"})
    assert describe(t) == "trial 4: crashed (api_server.py: error: unrecognized arguments: --x)"
    t = SimpleNamespace(number=5, user_attrs={"failure": "kv_cache_too_small",
                                              "estimated_max_model_len": 3000, "failure_message": "long"})
    assert describe(t) == "trial 5: kv_cache_too_small (fits 3000 tokens)"


class RefusedFlagDevice:
    """Every launch fails as vLLM does with a fixed flag its parser does not know (or as given)."""

    def __init__(self, kind="crashed", message="api_server.py: error: unrecognized arguments: --no-such-flag"):
        self.launches = []
        self.kind, self.message = kind, message

    def __call__(self, spec, workload, on_started=None, progress=False):
        from tuner.records import LaunchFailure, TrialOutcome

        self.launches.append(spec.params)
        return TrialOutcome(params=spec.params, argv=("vllm", "serve", spec.model), log_path=spec.log_path,
                            launch_s=1.0, failure=LaunchFailure(
                                kind=self.kind, exit_code=2, message=self.message))


def test_a_study_whose_every_launch_fails_alike_stops_after_three(tmp_path):
    """A bad fixed flag crashed every config the same way, and `--trials 40` made 40 launches
    (15-60 s each on the CPU build) before the user learnt anything."""
    from fakes import FAKE_PLATFORM, fake_config

    from tuner.errors import TunerError
    from tuner.search.study import MAX_SAME_LAUNCH_FAILURES, Tuner

    cfg = fake_config(tmp_path)
    device = RefusedFlagDevice()
    with pytest.raises(TunerError, match="unrecognized arguments: --no-such-flag") as e:
        Tuner(cfg, measure=device, platform=FAKE_PLATFORM, progress=False).run(10)
    assert len(device.launches) == MAX_SAME_LAUNCH_FAILURES == 3
    assert "--name NEW" in str(e.value)


def test_a_port_taken_three_times_says_free_it_and_resume_not_start_anew(tmp_path):
    from fakes import FAKE_PLATFORM, fake_config

    from tuner.errors import TunerError
    from tuner.search.study import Tuner

    device = RefusedFlagDevice("port_in_use", "port 8000 is in use by another process")
    with pytest.raises(TunerError, match="free the port or give --ports another range") as e:
        Tuner(fake_config(tmp_path), measure=device, platform=FAKE_PLATFORM, progress=False).run(10)
    assert len(device.launches) == 3 and "--name NEW" not in str(e.value)


def test_launches_failing_for_memory_do_not_stop_the_study(tmp_path):
    """Only config-blind failures stop it: a memory failure is what the search learns from."""
    from fakes import FAKE_PLATFORM, FakeDevice, fake_config

    from tuner.search.study import Tuner

    cfg = fake_config(tmp_path)
    device = FakeDevice(tokens_per_gmu=100)   # every config fails for KV memory, alike
    Tuner(cfg, measure=device, platform=FAKE_PLATFORM, progress=False).run(5)
    assert len(device.launches) >= 4


# ---------------------------------------------------------------- an interrupted baseline, queued again

def test_an_interrupted_baseline_keeps_where_its_values_came_from(tmp_path):
    from fakes import FAKE_PLATFORM, FakeDevice, fake_config
    from optuna.trial import TrialState

    from tuner.search.storage import load_existing
    from tuner.search.study import Tuner

    cfg = fake_config(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        Tuner(cfg, measure=FakeDevice(interrupt_at=1), platform=FAKE_PLATFORM, progress=False).run(3)
    study = load_existing(cfg)
    (failed,) = [t for t in study.trials if t.state == TrialState.FAIL]
    assert failed.user_attrs["baseline_source"]
    Tuner(cfg, measure=FakeDevice(), platform=FAKE_PLATFORM, progress=False).run(3)
    study = load_existing(cfg)
    again = [t for t in study.trials if t.state == TrialState.COMPLETE
             and t.user_attrs.get("baseline") == failed.user_attrs["baseline"]]
    assert again and again[0].user_attrs.get("baseline_source") == failed.user_attrs["baseline_source"]


# ---------------------------------------------------------------- a starved client's bunched streams

def test_a_level_whose_streams_arrived_bunched_is_not_rated_over_a_sliver_of_a_window():
    """llama.cpp, 4 slots, level c16 of 32 requests on a busy 2-core box: every stream arrived in
    one read, so the 16 first completions (and with them the 16 sends of the second wave) fell
    within 6 ms. The steady window was those 6 ms, and the level's throughput 80,894 tok/s against
    3,018 tok/s over its wall clock; the trial went to the front with it."""
    from tuner.load.metrics import summarize
    from tuner.records import PhaseResult, RequestResult, Workload

    def streamed(start, ttft, gap):
        return RequestResult(ok=True, status=200, error_kind="", error="", prompt_tokens=64,
                             output_tokens=32, start_s=start, ttft_s=ttft, itl_s=(gap,) * 31,
                             latency_s=ttft + 31 * gap)

    def level(gap):
        first = [streamed(0.0, 0.163 + i * 0.0004, gap) for i in range(16)]
        second = [streamed(r.latency_s, 0.15, gap) for r in first]
        return PhaseResult(name="c16", concurrency=16, wall_s=0.339, requests=tuple(first + second))

    bunched = summarize([level(0.0)], Workload()).levels[0]
    assert bunched.throughput_tok_s == pytest.approx(32 * 32 / 0.339)
    assert not bunched.steady and bunched.window_start_s is None
    # streamed token by token, the same level still ran in lockstep (the 16 first requests sent
    # together, each of the second wave sent as one completed): its 6 ms between the first
    # completion and the last send is no steady state either (tests/test_metrics.py, lockstep)
    timed = summarize([level(0.002)], Workload()).levels[0]
    assert not timed.steady and timed.window_start_s is None
    assert timed.throughput_tok_s == pytest.approx(32 * 32 / 0.339)


# ---------------------------------------------------------------- switching engines on one study

LLAMA_STUDY = {
    "study": {"name": "fake", "sampler": "tpe", "seed": 1, "replicates": 0},
    "model": {"path": "preset:tiny"},
    "server": {"engine": "llamacpp"},
    "space": {"ctx_size": {"choices": [512, 1024]}, "parallel": {"choices": [1, 2]}},
    "workload": {"prompt_tokens": 16, "output_tokens": 8},
}


@pytest.mark.parametrize("legacy", [False, True])
def test_a_study_begun_on_llamacpp_is_not_resumed_on_vllm(tmp_path, legacy):
    """Same study name and storage, the engine switched: it was taken on, and vLLM's memory model,
    fed the llama.cpp trial, predicted every vLLM config infeasible (20 proposals, no launch).
    `legacy`: a study stored before the engine was recorded is told by its dimensions."""
    import optuna
    from fakes import FAKE_PLATFORM, FakeDevice, fake_config

    from tuner import engines
    from tuner.config import parse_study
    from tuner.errors import TunerError
    from tuner.search.study import Tuner, study_summary

    try:
        llama = parse_study(LLAMA_STUDY, "<llama>", {"storage": f"sqlite:///{tmp_path}/fake.db",
                                                     "results_dir": str(tmp_path / "results")})
        summary = study_summary(llama, "/m", ())
    finally:
        engines.use("vllm")
    if legacy:
        summary.pop("engine")
    study = optuna.create_study(study_name="fake", storage=llama.storage,
                                directions=["maximize", "maximize", "minimize"])
    study.set_user_attr("config", summary)
    dist = optuna.distributions.CategoricalDistribution([512, 1024])
    study.add_trial(optuna.trial.create_trial(params={"ctx_size": 512}, distributions={"ctx_size": dist},
                                              values=[10.0, 10.0, 10.0], user_attrs={"failure": ""}))
    cfg = fake_config(tmp_path)
    with pytest.raises(TunerError, match="engine") as e:
        Tuner(cfg, measure=FakeDevice(), platform=FAKE_PLATFORM, progress=False).open()
    assert "--name NEW" in str(e.value)


def test_the_same_engine_resumes(tmp_path):
    from fakes import FAKE_PLATFORM, FakeDevice, fake_config

    from tuner.search.study import Tuner

    cfg = fake_config(tmp_path)
    Tuner(cfg, measure=FakeDevice(), platform=FAKE_PLATFORM, progress=False).run(2)
    study = Tuner(cfg, measure=FakeDevice(), platform=FAKE_PLATFORM, progress=False).run(3)
    assert study.user_attrs["config"]["engine"] == "vllm"


# ---------------------------------------------------------------- an interrupted replicate's log

def test_an_interrupted_replicate_keeps_its_log(tmp_path):
    """Ctrl-C during a replicate launch, then the same command: the replicate ran again under the
    same name (replicate-1.log) and its log replaced the interrupted launch's."""
    from fakes import FAKE_PLATFORM, FakeDevice, fake_config

    from tuner.search.storage import load_existing
    from tuner.search.study import Tuner

    class LoggingDevice(FakeDevice):
        def __call__(self, spec, workload, on_started=None, progress=False):
            Path(spec.log_path).write_text(f"launch {len(self.launches) + 1}\n")
            return super().__call__(spec, workload, on_started, progress)

    cfg = fake_config(tmp_path, replicates=1)
    with pytest.raises(KeyboardInterrupt):   # launch 2: trial 0's replicate
        Tuner(cfg, measure=LoggingDevice(interrupt_at=2), platform=FAKE_PLATFORM, progress=False).run(2)
    folder = cfg.results_path / "trials" / "0"
    assert (folder / "replicate-1.log").read_text() == "launch 2\n"
    Tuner(cfg, measure=LoggingDevice(), platform=FAKE_PLATFORM, progress=False).run(2)
    assert (folder / "replicate-1.log").read_text() == "launch 2\n"     # the interrupted one, kept
    (run,) = load_existing(cfg).user_attrs["runs:0"]
    assert Path(run["log_path"]).name == "replicate-1.retry-1.log" and Path(run["log_path"]).exists()


# ---------------------------------------------------------------- Ctrl-C before the first launch

def test_a_ctrl_c_while_the_baselines_are_read_does_not_lose_them(tmp_path, monkeypatch):
    """The first run reads vLLM's defaults (seconds of importing vLLM) to queue its baselines;
    interrupted there, the study had its config stored and no baseline queued, and no later run
    queued them: the study never measured vLLM's defaults or the hand-tuned config."""
    from fakes import FAKE_PLATFORM, FakeDevice, fake_config

    from tuner.search.storage import load_existing
    from tuner.search.study import Tuner

    cfg = fake_config(tmp_path)
    real = Tuner.vllm_defaults

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(Tuner, "vllm_defaults", interrupted)
    with pytest.raises(KeyboardInterrupt):
        Tuner(cfg, measure=FakeDevice(), platform=FAKE_PLATFORM, progress=False).run(3)
    monkeypatch.setattr(Tuner, "vllm_defaults", real)
    study = Tuner(cfg, measure=FakeDevice(), platform=FAKE_PLATFORM, progress=False).run(3)
    names = {t.user_attrs.get("baseline") for t in load_existing(cfg).trials}
    assert {"vllm-defaults", "hand-tuned"} <= names, names
    assert len(study.trials) >= 3


def test_a_run_started_with_sigint_ignored_still_stops_on_ctrl_c():
    # a run started with `&` from a non-interactive shell inherits SIGINT ignored, so kill -INT
    # did nothing and the run went on to the end: main puts Python's own handler back
    import signal

    from tuner import cli

    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        cli.main(["show", "--study", "/nonexistent/study.toml"])
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_baseline_that_snaps_onto_another_is_named_not_dropped(tmp_path):
    # with max_model_len and max_num_seqs each fixed to one value, the hand-tuned config snaps to
    # vLLM's defaults: it was measured once (right) and vanished from every table without a word
    from fakes import FAKE_PLATFORM, FAKE_STUDY, FakeDevice

    from tuner.config import parse_study
    from tuner.search.study import Tuner

    doc = {k: (dict(v) if isinstance(v, dict) else v) for k, v in FAKE_STUDY.items()}
    doc["space"] = {"gpu_memory_utilization": {"choices": [0.9]},
                    "max_model_len": {"choices": [4096]}, "max_num_seqs": {"choices": [8]}}
    cfg = parse_study(doc, "<fake>", {"storage": f"sqlite:///{tmp_path}/fake.db",
                                      "results_dir": str(tmp_path / "results")})
    baselines = Tuner(cfg, measure=FakeDevice(), platform=FAKE_PLATFORM, progress=False).baselines()
    assert [name for name, _, _ in baselines] == ["vllm-defaults"]
    source = baselines[0][2]["baseline_source"]
    assert source.endswith("; hand-tuned (the hand-tuned 0.92 / 4096 / 8 of a V100 story) is the "
                           "same config here"), source
