"""The memory ballast: a smaller card emulated for real (tuner.run.ballast), without a GPU."""

from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path

import pytest

import faultkit as fk
from tuner.errors import TunerError
from tuner.records import LaunchSpec, Workload
from tuner.run import measure
from tuner.run.ballast import Ballast, hold
from tuner.search.space import ServerParams

FAKE = (sys.executable, str(Path(__file__).with_name("fake_ballast.py")))
GIB = 2**30


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is gone for our purposes
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def gone_soon(pid: int, seconds: float = 10.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_hold_leaves_exactly_the_budget_free_and_never_less():
    # a device with 80 GiB free that hands out what is asked, 2 MiB blocks at a time
    free = [80 * GIB]

    def allocate(n):
        n = -(-n // (2 << 20)) * (2 << 20) if n > free[0] - 16 * GIB else n
        free[0] -= n
        return n

    blocks = hold(int(15.77 * GIB), lambda: (free[0], 80 * GIB), allocate)
    assert int(15.77 * GIB) - (2 << 20) <= free[0] <= int(15.77 * GIB) + (2 << 20)
    assert len(blocks) == 65 and max(blocks) == GIB   # a GiB at a time, then the remainder
    # nothing to take when the device has no more free than the budget
    assert hold(16 * GIB, lambda: (10 * GIB, 80 * GIB), allocate) == []


def test_the_ballast_holds_while_the_block_runs_and_is_gone_after_it(tmp_path):
    pidfile = tmp_path / "pids"
    env = (("FAKE_BALLAST_PIDFILE", str(pidfile)),)
    with Ballast(int(15.77 * GIB), env=env, cmd=FAKE) as b:
        pid = int(pidfile.read_text())
        assert alive(pid)
        assert b.held_bytes == 80 * GIB - int(15.77 * GIB) and b.free_bytes == int(15.77 * GIB)
    assert gone_soon(pid)


def test_a_ballast_that_cannot_hold_stops_the_trial_with_a_clear_error(tmp_path):
    env = (("FAKE_BALLAST_SAY", "error: no CUDA device visible to the ballast"),
           ("FAKE_BALLAST_PIDFILE", str(tmp_path / "pids")))
    with pytest.raises(TunerError, match="no CUDA device visible to the ballast"):
        Ballast(GIB, env=env, cmd=FAKE).start()
    assert gone_soon(int((tmp_path / "pids").read_text()))


def test_a_ballast_exits_when_its_tuner_is_gone(tmp_path):
    # a tuner killed with SIGKILL runs no cleanup: its end of the ballast's stdin closes
    pidfile = tmp_path / "pids"
    b = Ballast(GIB, env=(("FAKE_BALLAST_PIDFILE", str(pidfile)),), cmd=FAKE)
    b.start()
    pid = int(pidfile.read_text())
    b._proc.stdin.close()
    assert gone_soon(pid)
    b.stop()


def test_measure_holds_the_ballast_for_the_whole_launch_and_load_test(tmp_path, monkeypatch):
    pidfile = tmp_path / "pids"
    monkeypatch.setattr(measure, "Ballast", functools.partial(Ballast, cmd=FAKE))
    spec = LaunchSpec(model=str(fk.private_model(tmp_path / "model")), params=ServerParams(0.2, 1024, 4),
                      engine_cmd=(sys.executable, str(fk.FAKE_OPENAI)),
                      env=(("FAKE_BALLAST_PIDFILE", str(pidfile)), ("FAKE_MODE", "ok")),
                      launch_timeout_s=60, log_path=str(tmp_path / "server.log"),
                      ballast_leave_bytes=int(15.77 * GIB))
    seen = []
    workload = Workload(prompt_tokens=16, output_tokens=8, warmup_requests=0,
                        single_stream_requests=2, levels=(2,), throughput_requests=4,
                        request_timeout_s=30)

    def on_started(server):   # the server starts with the ballast already holding
        seen.append(alive(int(pidfile.read_text())))

    outcome = measure.measure_config(spec, workload, on_started=on_started, progress=False)
    assert outcome.failure is None and outcome.metrics.throughput_tok_s > 0
    assert seen == [True]
    assert gone_soon(int(pidfile.read_text()))
    # no budget, no ballast
    pidfile.unlink()
    from dataclasses import replace

    measure.measure_config(replace(spec, ballast_leave_bytes=0), workload, progress=False)
    assert not pidfile.exists()


def test_ballast_mode_is_checked_where_it_cannot_work():
    from tuner.config import ConfigError, parse_study
    from tuner.search.study import Platform, memory_scale

    doc = {"model": {"path": "preset:tiny"},
           "server": {"memory_budget_gib": 8.0, "memory_budget_mode": "balast"},
           "space": {"gpu_memory_utilization": {"choices": [0.9]}, "max_model_len": {"choices": [1024]},
                     "max_num_seqs": {"choices": [4]}}}
    with pytest.raises(ConfigError, match="memory_budget_mode"):
        parse_study(doc, "s.toml", {})
    doc["server"]["memory_budget_mode"] = "ballast"
    cfg = parse_study(doc, "s.toml", {})
    cpu = Platform("cpu", "", 16 * GIB, None, (), "0.32.0")
    with pytest.raises(TunerError, match="no CUDA device"):
        memory_scale(cfg, cpu)
    h100 = Platform("cuda", "NVIDIA H100 80GB HBM3", 80 * GIB, 3352.0, ("true",), "0.24.0")
    assert memory_scale(cfg, h100) == 0.1
    from tuner.search.study import launch_spec

    spec = launch_spec(cfg, h100, "m", (), ServerParams(0.9, 1024, 4), Path("x.log"))
    assert spec.ballast_leave_bytes == 8 * GIB
    cfg = parse_study({**doc, "server": {"memory_budget_gib": 8.0}}, "s.toml", {})   # "share"
    assert launch_spec(cfg, h100, "m", (), ServerParams(0.9, 1024, 4), Path("x.log")).ballast_leave_bytes == 0


def test_the_real_ballast_says_why_it_cannot_hold_on_a_machine_without_cuda():
    # this machine's torch is the CPU build: the real child starts, finds no CUDA device, says so
    with pytest.raises(TunerError, match="no CUDA device visible to the ballast"):
        Ballast(GIB).start()
