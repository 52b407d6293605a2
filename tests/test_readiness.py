"""Readiness comes from our own server, and ports are not handed out again while one may hold them."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import free_port as os_free_port, wait_until_serving
from test_launcher import FAKE_VLLM, alive, fake_spec
from tuner.errors import TunerError
from tuner.records import LaunchSpec
from tuner.run import process
from tuner.run.process import Capacity, LaunchFailure, ServerProcess, group_members
from tuner.search.space import ServerParams


@contextlib.contextmanager
def foreign_server(tmp_path: Path, port: int):
    """The fake vLLM serving /health 200 on `port` in a process group of its own: a stranger (or a
    server of an earlier trial still up) as the launcher sees it."""
    log = tmp_path / "foreign.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, FAKE_VLLM, "--host", "127.0.0.1", "--port", str(port)],
                                env={**os.environ, "FAKE_MODE": "ready"}, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until_serving(proc, f"http://127.0.0.1:{port}/health", 30, "foreign server", log, poll_s=0.05)
        yield proc
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def listening(port: int) -> list:
    return process._listeners(port)


@pytest.fixture
def fresh_ports(monkeypatch):
    """free_port's memory of this test only."""
    monkeypatch.setattr(process, "_HANDED_OUT", {})


def free_range(n: int) -> range:
    """`n` consecutive ports free now, around one the OS hands out."""
    for _ in range(100):
        low = os_free_port()
        ports = range(low, low + n)
        if ports.stop <= 65536 and all(process.port_is_free(p) for p in ports):
            return ports
    pytest.skip(f"no {n} consecutive free ports")


# --------------------------------------------------------------------------- readiness

def test_a_foreign_server_answering_on_the_port_is_port_in_use_not_ready(tmp_path):
    """Our engine (still starting, as vLLM is for seconds) has not bound its port; another process
    answers /health 200 there. Before the fix that was "ready", and the load test measured it."""
    port = os_free_port()
    with foreign_server(tmp_path, port) as foreign:
        with ServerProcess(fake_spec(tmp_path, "silent", port=port, timeout_s=20)) as server:
            server.start()
            outcome = server.wait_ready()
        assert isinstance(outcome, LaunchFailure), outcome
        assert outcome.kind == "port_in_use" and outcome.verdict_s < 10
        assert f"pid {foreign.pid}" in outcome.message
        assert group_members(server.pgid) == []     # ours stopped
        assert foreign.poll() is None               # the stranger untouched


def test_a_foreign_server_is_port_in_use_even_while_our_engine_lingers(tmp_path):
    """The same with an engine that would bind later (after 3 s): the verdict comes from the
    probe at once, not from our engine's own "Address already in use" line."""
    port = os_free_port()
    with foreign_server(tmp_path, port):
        with ServerProcess(fake_spec(tmp_path, "ready", port=port, env={"FAKE_DELAY": "3"})) as server:
            server.start()
            outcome = server.wait_ready()
    assert isinstance(outcome, LaunchFailure) and outcome.kind == "port_in_use"
    assert outcome.verdict_s < 3, outcome


def test_our_own_server_is_ready_and_its_listener_is_known(tmp_path, fresh_ports):
    with ServerProcess(fake_spec(tmp_path, "ready")) as server:
        server.start()
        outcome = server.wait_ready()
        assert isinstance(outcome, Capacity), outcome
        assert set(server.listener_pids) == {server.pid}
        assert [pid for pid, _ in listening(server.port)] == [server.pid]
    assert listening(server.port) == [] and group_members(server.pgid) == []


ESCAPING_LISTENER = """
import http.server, os, sys, time
port = int(sys.argv[sys.argv.index("--port") + 1])

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()
    def log_message(self, *args):
        pass

server = http.server.HTTPServer(("127.0.0.1", port), Health)
if os.fork() == 0:
    os.setsid()                      # a child that leaves the group, listener inherited
    open(os.environ["FAKE_PIDS"], "w").write(str(os.getpid()))
    server.serve_forever()
print("child forked", flush=True)
while True:
    time.sleep(1)
"""


def test_a_listener_that_left_the_group_is_stopped_with_the_server(tmp_path, fresh_ports):
    """A forked child in a session of its own still serves the port once the group is gone;
    stop() ends it too, so the port is not held by a server of an earlier trial."""
    pids = tmp_path / "pids"
    spec = LaunchSpec(model="tiny", params=ServerParams(), engine_cmd=(sys.executable, "-c", ESCAPING_LISTENER),
                      env=(("FAKE_PIDS", str(pids)),), launch_timeout_s=20, stop_timeout_s=1.0,
                      log_path=str(tmp_path / "server.log"))
    with ServerProcess(spec) as server:
        server.start()
        outcome = server.wait_ready()
        assert isinstance(outcome, Capacity), outcome
        deadline = time.monotonic() + 10
        while not (pids.exists() and pids.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        child = int(pids.read_text())
        assert child not in group_members(server.pgid) and child in server.listener_pids
    try:
        assert not alive(child)
        assert listening(server.port) == []
    finally:
        if alive(child):
            os.kill(child, signal.SIGKILL)


# --------------------------------------------------------------------------- the port chooser

def test_free_port_from_the_os_never_repeats_itself(fresh_ports):
    ports = [process.free_port() for _ in range(30)]
    assert len(set(ports)) == len(ports)


def test_free_port_skips_a_port_handed_out_and_still_held(tmp_path, fresh_ports, monkeypatch):
    """Two ports; a server of ours got the first and listens there. The chooser hands out the
    other one, again and again (least recently used first), never the held one."""
    monkeypatch.setattr(process, "PORT_RANGE", free_range(2))
    with ServerProcess(fake_spec(tmp_path, "ready")) as server:
        server.start()
        assert isinstance(server.wait_ready(), Capacity)
        held = server.port
        (other,) = set(process.PORT_RANGE) - {held}
        assert [process.free_port() for _ in range(5)] == [other] * 5
    assert listening(held) == []


def test_free_port_never_hands_out_the_port_of_a_server_still_starting(tmp_path, fresh_ports, monkeypatch):
    """vLLM binds its port seconds after it starts: a bind test alone finds the port free then.
    While the server is ours and alive, its port is not handed out, even when nothing else is."""
    monkeypatch.setattr(process, "PORT_RANGE", free_range(1))
    with ServerProcess(fake_spec(tmp_path, "silent")) as server:
        server.start()
        assert process.port_is_free(server.port)      # nothing bound it yet
        with pytest.raises(TunerError, match="no free port"):
            process.free_port()
    assert process.free_port() == server.port          # stopped: the port may serve again


def test_free_port_prefers_ports_not_handed_out_before(fresh_ports, monkeypatch):
    """A port handed out comes again only once every other port of the range has had its turn."""
    monkeypatch.setattr(process, "PORT_RANGE", free_range(3))
    first = [process.free_port() for _ in range(3)]
    assert sorted(first) == list(process.PORT_RANGE)
    assert [process.free_port() for _ in range(3)] == first   # oldest first


def test_free_port_skips_a_port_a_stranger_listens_on(fresh_ports, monkeypatch):
    monkeypatch.setattr(process, "PORT_RANGE", free_range(2))
    with socket.socket() as stranger:
        stranger.bind(("127.0.0.1", process.PORT_RANGE[0]))
        stranger.listen()
        assert {process.free_port() for _ in range(4)} == {process.PORT_RANGE[1]}
