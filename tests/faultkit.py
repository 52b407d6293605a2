"""Fault scenarios shared by tests/test_faults.py and bench/faults.py: studies on fake or real
engines, a real `python -m tuner run` killed at a chosen moment, and the figures that say whether
anything was orphaned or lost.

Processes are told apart by what this kit started, never by a broad name: the process groups the
study recorded (`server_pgid` of every trial) and command lines holding this run's unique model
folder (a private copy of the tiny model).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from tuner.run.process import _cmdline, _stat_fields

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"
FAKE_OPENAI = TESTS / "fake_openai_server.py"
FAKE_VLLM = TESTS / "fake_vllm.py"
LOGS = TESTS / "data" / "logs"


def patience(seconds: float) -> float:
    """`seconds` of waiting on an idle machine, stretched for a busy one: by the load per core
    right now (at most 5 times), or by TUNER_TEST_PATIENCE when set. For waits that end on an
    observed fact, so a longer one costs time only when something is really wrong."""
    factor = os.environ.get("TUNER_TEST_PATIENCE")
    if factor:
        return seconds * float(factor)
    try:
        busy = os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:
        busy = 1.0
    return seconds * min(5.0, max(1.0, busy))


def terminal_signals() -> None:
    """Run in a child before exec: SIGINT as at a terminal. A job started in the background of a
    non-interactive shell (`pytest ... &`, CI runners) inherits SIGINT ignored, and Python keeps
    an ignored SIGINT ignored, so a tuner started from such a test would never see its Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def private_model(folder: Path) -> Path:
    """A copy of the embedded tiny model under a unique name: its path marks our servers' argv."""
    from tuner.models.presets import TINY_MODEL

    dest = Path(folder) / f"fault-model-{uuid.uuid4().hex[:8]}"
    shutil.copytree(TINY_MODEL, dest)
    return dest


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(v)


def to_toml(doc: dict) -> str:
    out = []
    for table, body in doc.items():
        out.append(f"[{table}]")
        out += [f"{k} = {toml_value(v)}" for k, v in body.items()]
        out.append("")
    return "\n".join(out)


def fake_engine_study(model: Path, mode: str = "ok", name: str = "faults", trials_space: str = "small",
                      env: dict | None = None, launch_timeout_s: float = 30.0,
                      engine: tuple[str, ...] | None = None, output_tokens: int = 4) -> dict:
    """A study document whose engine is the fake OpenAI server (or `engine`)."""
    return {
        "study": {"name": name, "sampler": "random", "seed": 1, "memory_model": False,
                  "replicates": 0},
        "model": {"path": str(model)},
        "server": {"engine": list(engine or (sys.executable, str(FAKE_OPENAI))),
                   "env": {"FAKE_MODE": mode, **(env or {})}, "launch_timeout_s": launch_timeout_s},
        "space": {"gpu_memory_utilization": {"low": 0.1, "high": 0.9, "step": 0.1},
                  "max_model_len": {"choices": [1024, 2048]},
                  "max_num_seqs": {"choices": [1, 2, 4]}},
        "workload": {"prompt_tokens": 8, "output_tokens": output_tokens, "warmup_requests": 1,
                     "single_stream_requests": 2, "throughput_requests": 4, "max_concurrency": 4,
                     "request_timeout_s": 10.0},
    }


def real_vllm_study(model: Path, name: str = "faults-vllm") -> dict:
    """The tiny model on the real CPU build, in a corner of the space where every config fits."""
    return {
        "study": {"name": name, "sampler": "random", "seed": 3, "memory_model": False,
                  "replicates": 0},
        "model": {"path": str(model)},
        "server": {"extra_args": ["--enforce-eager"], "launch_timeout_s": 300.0},
        "space": {"gpu_memory_utilization": {"low": 0.1, "high": 0.12, "step": 0.01},
                  "max_model_len": {"choices": [1024]},
                  "max_num_seqs": {"choices": [4, 8]}},
        # each load level runs at least 6 s: a signal meant for the load test must not arrive
        # after it (4 waves of 32 tokens last under a second each here; CI saw the tuner finish
        # its last trial before a "SIGTERM during load" reached it)
        "workload": {"prompt_tokens": 32, "output_tokens": 32, "warmup_requests": 2,
                     "single_stream_requests": 3, "throughput_requests": 24, "max_concurrency": 8,
                     "level_seconds": 6.0, "request_timeout_s": 120.0},
    }


# ---------------------------------------------------------------- processes


def leftovers(pgids, markers, exclude=()) -> list[tuple[int, str]]:
    """Live processes in one of `pgids`, or whose command line holds one of `markers`."""
    pgids = {str(int(p)) for p in pgids if p}
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in exclude or int(entry) == os.getpid():
            continue
        st = _stat_fields(int(entry))
        if not st or st[0] in ("Z", "X"):
            continue
        line = _cmdline(int(entry))
        if st[2] in pgids or any(m and m in line for m in markers):
            found.append((int(entry), _describe(st) + line[:160]))
    return found


def _describe(st: list[str]) -> str:
    """State, parent, group, session and age of a process (its /proc stat fields after comm), so a
    leftover can be traced to what started it."""
    try:
        ticks = os.sysconf("SC_CLK_TCK")
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        age = f"{uptime - int(st[19]) / ticks:.1f}s"
    except (OSError, ValueError, IndexError):
        age = "?"
    return f"[state {st[0]} ppid {st[1]} pgid {st[2]} sid {st[3]} age {age}] "


# ---------------------------------------------------------------- the study in storage


def trials(storage: str, name: str) -> list:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    for _ in range(20):
        try:
            return optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)
        except KeyError:
            return []
        except Exception:  # the tuner is writing: sqlite says "locked" now and then
            time.sleep(0.2)
    return []


def recorded_pgids(storage: str, name: str) -> set[int]:
    return {int(t.user_attrs["server_pgid"]) for t in trials(storage, name)
            if t.user_attrs.get("server_pgid")}


def completed(storage: str, name: str) -> dict[int, tuple]:
    from optuna.trial import TrialState

    return {t.number: tuple(t.values) for t in trials(storage, name) if t.state == TrialState.COMPLETE}


def launched(storage: str, name: str) -> int:
    from optuna.trial import TrialState

    return sum(1 for t in trials(storage, name) if t.state == TrialState.COMPLETE
               and t.user_attrs.get("failure") not in ("duplicate", "predicted_infeasible"))


# ---------------------------------------------------------------- a real tuner, killed on cue


@dataclass
class TunerRun:
    study_file: Path
    storage: str
    results: Path
    name: str
    trials: int
    marker: str                        # our model folder: in every server argv we start
    timeout_s: float = 600.0
    hold_dir: Path | None = None       # FAKE_HOLD_DIR of a fake engine: phases are held, not raced
    log: list[str] = field(default_factory=list)

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "tuner", "run", "--study", str(self.study_file), "--trials",
                str(self.trials), "--name", self.name, "--storage", self.storage, "--results",
                str(self.results), "--quiet"]

    def start(self, stderr_path: Path) -> subprocess.Popen:
        out = open(stderr_path, "ab")
        # its own session: a signal meant for it reaches it alone (as one typed at its terminal
        # would reach it, its servers being in sessions of their own)
        return subprocess.Popen(self.argv(), cwd=REPO, stdout=out, stderr=out,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=terminal_signals, env={**os.environ, "PYTHONPATH": str(REPO)})

    def running_trial(self, pid: int | None = None):
        """The trial the tuner `pid` is working on (a SIGKILLed tuner leaves its own RUNNING)."""
        from optuna.trial import TrialState

        running = [t for t in trials(self.storage, self.name) if t.state == TrialState.RUNNING
                   and (pid is None or t.user_attrs.get("tuner_pid") == pid)]
        return running[-1] if running else None

    def server_log_path(self, trial) -> Path:
        return self.results / self.name / "trials" / str(trial.number) / "server.log"

    def server_log(self, trial) -> str:
        try:
            return self.server_log_path(trial).read_text(errors="replace")
        except OSError:
            return ""

    def hold(self, phase: str | None) -> None:
        """Fake servers hold at `phase` from now on (None: at no phase); held ones are let go."""
        if self.hold_dir is None:
            return
        self.hold_dir.mkdir(parents=True, exist_ok=True)
        for f in self.hold_dir.glob("hold-*"):
            if f.name != f"hold-{phase}":
                f.unlink()
        if phase is not None:
            (self.hold_dir / f"hold-{phase}").touch()

    def wait_phase(self, proc: subprocess.Popen, phase: str, min_completed: int,
                   timeout_s: float) -> bool:
        """Until the tuner is launching a server (`launch`) or load-testing it (`load`), with at
        least `min_completed` trials finished and the server's process group recorded in storage.
        False when the tuner exited or time ran out.

        With `hold_dir` the server holds at the phase until told to go (see fake_openai_server),
        so the phase cannot pass before the fault; servers of trials before `min_completed` are let
        go. Without it (real vLLM) the trial's log is watched closely once the trial is found."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return False
            t = self.running_trial(proc.pid)
            pgid = t.user_attrs.get("server_pgid") if t is not None else None
            enough = len(completed(self.storage, self.name)) >= min_completed
            if self.hold_dir is not None:
                for at in self.hold_dir.glob(f"at-{phase}.*"):
                    pid = int(at.name.rsplit(".", 1)[1])
                    if pgid is None:        # the tuner has not recorded its server yet
                        break
                    if pid == pgid and enough:
                        return True
                    (self.hold_dir / f"go.{pid}").touch()    # not the trial to fault: let it go
            elif pgid and enough and self._watch_log(proc, t, phase, deadline):
                return True
            time.sleep(0.2)
        return False

    def _watch_log(self, proc, trial, phase: str, deadline: float) -> bool:
        """Poll one trial's server log every 50 ms until it shows `phase`, or the trial ends."""
        seen_at = None
        next_check = time.monotonic() + 1.0
        while time.monotonic() < deadline and proc.poll() is None:
            text = self.server_log(trial)
            ready = "Application startup complete" in text
            if phase == "launch" and text and not ready:
                seen_at = seen_at or time.monotonic()
                if time.monotonic() - seen_at > 1.0:      # the server is well into its start
                    return True
            if phase == "launch" and ready or phase == "load" and "POST /v1/completions" in text:
                return phase == "load"                    # a launch already over: the next trial's
            if time.monotonic() > next_check:             # storage is slow to read: now and then
                next_check = time.monotonic() + 1.0
                t = self.running_trial(proc.pid)
                if t is None or t.number != trial.number:
                    return False
            time.sleep(0.05)
        return False


@dataclass
class Figures:
    scenario: str
    exit_code: int | None
    orphans: int                 # processes of ours alive once the dust settled
    lost_completed: int          # trials COMPLETE before the fault and not COMPLETE (same values) after
    left_behind: int = 0         # servers alive right after a SIGKILLed tuner (the next run must stop them)
    reaped_by_next_run: bool | None = None
    note: str = ""


SIGNALS = {"SIGINT": signal.SIGINT, "SIGTERM": signal.SIGTERM, "SIGKILL": signal.SIGKILL}


def kill_chain(run: TunerRun, scenarios: list[tuple[str, str]], workdir: Path,
               on_final_load=None) -> tuple[list[Figures], dict]:
    """Run the same `python -m tuner run` command again and again, killing it with each
    (signal, phase) in turn, then once more to the end. Returns the figures per scenario and a
    summary of the final run (exit code, launched trials, orphans, reached).

    `on_final_load(trial, run)` is called once the final run is load-testing (e.g. to SIGKILL the
    server itself mid-load)."""
    figures: list[Figures] = []
    stderr_path = workdir / "tuner-stderr.log"
    pending_reap: list[Figures] = []          # SIGKILL scenarios whose servers the next run must stop
    pending_pgids: set[int] = set()
    for i, (sig_name, phase) in enumerate(scenarios):
        before = completed(run.storage, run.name)
        run.hold(phase)
        proc = run.start(stderr_path)
        ok = run.wait_phase(proc, phase, min_completed=1, timeout_s=patience(run.timeout_s))
        if pending_reap:
            # the run has launched a new server (or ended): the old one must be gone by now
            alive = leftovers(pending_pgids, [])
            for f in pending_reap:
                f.reaped_by_next_run = not alive
                f.note += f"alive when the next run launched: {alive}" if alive else ""
            pending_reap, pending_pgids = [], set()
        if not ok:
            proc.kill()
            proc.wait()
            figures.append(Figures(f"{sig_name} during {phase}", proc.returncode, -1, -1,
                                   note="phase not reached: " + _tail(stderr_path)))
            continue
        sig_pgids = recorded_pgids(run.storage, run.name)
        os.kill(proc.pid, SIGNALS[sig_name])
        try:
            code = proc.wait(timeout=patience(120))
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        pgids = recorded_pgids(run.storage, run.name) | sig_pgids
        after = completed(run.storage, run.name)
        lost = sum(1 for n, v in before.items() if after.get(n) != v)
        if sig_name == "SIGKILL":
            time.sleep(0.5)
            behind = leftovers(pgids, [run.marker])
            f = Figures(f"{sig_name} during {phase}", code, 0, lost, left_behind=len(behind))
            pending_reap.append(f)
            pending_pgids |= {pid for pid, _ in behind} | pgids
        else:
            alive = leftovers(pgids, [run.marker])
            f = Figures(f"{sig_name} during {phase}", code, len(alive), lost,
                        note=f"alive: {alive}" if alive else "")
        figures.append(f)

    before = completed(run.storage, run.name)
    run.hold("load" if on_final_load is not None else None)
    proc = run.start(stderr_path)
    if on_final_load is not None:
        if run.wait_phase(proc, "load", min_completed=0, timeout_s=patience(run.timeout_s)):
            on_final_load(run.running_trial(proc.pid), run)
        run.hold(None)
    try:
        code = proc.wait(timeout=patience(run.timeout_s))
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    for f in pending_reap:
        f.reaped_by_next_run = not leftovers(pending_pgids, [])
    after = completed(run.storage, run.name)
    pgids = recorded_pgids(run.storage, run.name)
    final = {"exit_code": code, "launched": launched(run.storage, run.name), "requested": run.trials,
             "orphans": len(left := leftovers(pgids, [run.marker])), "orphan_lines": left,
             "lost_completed": sum(1 for n, v in before.items() if after.get(n) != v),
             "stderr_tail": _tail(stderr_path)}
    final["reached"] = final["launched"] >= run.trials
    # the orphans of the SIGKILL scenarios are counted once the next run had its chance
    for f in figures:
        if f.reaped_by_next_run is not None:
            f.orphans = 0 if f.reaped_by_next_run else f.left_behind
    return figures, final


def _tail(path: Path, n: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def write_study(folder: Path, doc: dict, name: str = "study.toml") -> Path:
    path = Path(folder) / name
    path.write_text(to_toml(doc))
    return path
