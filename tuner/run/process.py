"""Server lifecycle, engine-neutral: start an engine's argv in its own process group, watch its log with the engine's classifier, probe readiness, stop."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import http.client
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from tuner.engines.base import log_tail, root_cause as _root_cause
# vLLM's log knowledge lives in its engine; importers of tuner.run.process still find it here
from tuner.engines.vllm_logs import (FAILURE_PATTERNS, FailurePattern, classify,  # noqa: F401
                                     parse_cache_config_info, parse_capacity)
from tuner.errors import TunerError
from tuner.run import spare
# the records moved to tuner.records; importers of tuner.run.process still find them here
from tuner.records import MEMORY_FAILURES, Capacity, LaunchFailure, LaunchSpec  # noqa: F401


class EngineNotFound(TunerError):
    """The configured engine command cannot be run on this machine."""

    def __init__(self, engine_cmd: tuple[str, ...], label: str = "vLLM"):
        self.engine_cmd = engine_cmd
        program = engine_cmd[0] if engine_cmd else ""
        where = ("is not an executable file" if os.sep in program else "is not on PATH")
        super().__init__(f"engine command {' '.join(engine_cmd)!r} is not installed: "
                         f"{program!r} {where} (set the study's engine command "
                         f"or install {label})")


# ---------------------------------------------------------------------------------------------
# Engine command and argv.

def _engine(spec: LaunchSpec | None = None):
    from tuner import engines

    return engines.get(spec.engine if spec is not None else None)


def default_engine_cmd(engine: str | None = None) -> tuple[str, ...]:
    """The engine's command when the study names none (vLLM: `vllm serve` or its API module)."""
    from tuner import engines

    return tuple(engines.get(engine).default_cmd())


def check_engine_cmd(engine_cmd: tuple[str, ...], label: str = "vLLM") -> None:
    """Raise `EngineNotFound` when the engine's program cannot be found."""
    program = engine_cmd[0] if engine_cmd else ""
    if not program:
        raise EngineNotFound(("",), label)
    if os.sep in program:
        if not (os.path.isfile(program) and os.access(program, os.X_OK)):
            raise EngineNotFound(engine_cmd, label)
    elif shutil.which(program) is None:
        raise EngineNotFound(engine_cmd, label)


def build_argv(spec: LaunchSpec, engine_cmd: tuple[str, ...], port: int) -> list[str]:
    """The server's argv, as the spec's engine writes it."""
    return _engine(spec).argv(engine_cmd, spec.model, spec.params.values(), spec.extra_args,
                              spec.host, port)


# The ports this process's servers bind (a worker of `run --parallel` gets its own range, so two
# workers never race for one port); None: any free port the OS hands out.
PORT_RANGE: range | None = None

# Every port this process handed out, least recently handed out first. A server binds its port
# seconds after it is chosen (vLLM imports first), and one being stopped, or a child it forked,
# may hold it a while longer: so a port is handed out again only when no fresh one is free, and
# never while a live server of ours has it.
_HANDED_OUT: dict[int, None] = {}
_PORT_LOCK = threading.Lock()


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Nothing holds `port` on `host` now. The test bind sets no SO_REUSEADDR, so a listener, a
    connection or a TIME_WAIT left by a server that just closed all count as holding it."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _os_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now and not handed out before by this process (unless no other is free): from
    PORT_RANGE when set (a random one, so a retry moves on), else the OS's."""
    with _PORT_LOCK:
        taken = {s.port for s in live_servers() if s.port}
        if PORT_RANGE is None:
            # the OS hands out any free port, one of ours just released included: ask again
            for _ in range(50):
                port = _os_port(host)
                if port not in _HANDED_OUT:
                    break
        else:
            import random

            ports = list(PORT_RANGE)
            start = random.randrange(len(ports))
            fresh = [p for p in ports[start:] + ports[:start] if p not in _HANDED_OUT]
            again = [p for p in _HANDED_OUT if p in PORT_RANGE]    # oldest first
            port = next((p for p in fresh + again if p not in taken and port_is_free(p, host)), None)
            if port is None:
                raise TunerError(f"no free port in {PORT_RANGE.start}-{PORT_RANGE.stop - 1} on {host}: "
                                 "pass --ports LOW-HIGH")
        _HANDED_OUT.pop(port, None)
        _HANDED_OUT[port] = None
        return port


def _host_addresses(host: str) -> set[str]:
    """The local addresses a listener may have for a connection to `host` to reach it."""
    try:
        ip = socket.gethostbyname(host)
    except OSError:
        ip = host
    if ip in ("0.0.0.0", ""):
        ip = "127.0.0.1"      # a client's connect to 0.0.0.0 lands on the loopback
    return {ip, f"::ffff:{ip}", "0.0.0.0", "::"}


def _listeners(port: int, pids: list[int] | None = None) -> list[tuple[int | None, str]]:
    """(pid, address) of the TCP sockets listening on `port`: those of `pids` when given, else of
    the whole machine, where the pid of another user's socket is None (its fds are not ours to
    read). A socket a process inherited (vLLM forks its engine core) counts once per process."""
    import psutil

    def listening(conns) -> list[tuple[int | None, str]]:
        return [(getattr(c, "pid", None), c.laddr.ip) for c in conns
                if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port]

    if pids is None:
        return listening(psutil.net_connections(kind="tcp"))
    found = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            conns = (getattr(proc, "net_connections", None) or proc.connections)(kind="tcp")
        except psutil.Error:
            continue
        found += [(pid, ip) for _, ip in listening(conns)]
    return found


# ---------------------------------------------------------------------------------------------
# Process groups, straight from /proc (Linux).

def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # comm may contain spaces and parentheses; the fields after its last ')' are fixed
    return raw[raw.rfind(")") + 2:].split()


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is `pgid`."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = _stat_fields(int(entry))
        # fields[0] is state, fields[2] is pgrp
        if fields and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            members.append(int(entry))
    return members


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _wait_group_gone(pgid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while group_members(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def kill_group(pgid: int, term_timeout_s: float = 30.0) -> None:
    """SIGTERM the group, wait, SIGKILL it, and wait until no member is left."""
    _signal_group(pgid, signal.SIGTERM)
    if _wait_group_gone(pgid, term_timeout_s):
        return
    _signal_group(pgid, signal.SIGKILL)
    if not _wait_group_gone(pgid, 10.0):
        # a member killpg missed (e.g. the group emptied and refilled): one by one
        for pid in group_members(pgid):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        _wait_group_gone(pgid, 10.0)


def reap_process_group(pgid: int, cmdline_marker: str, term_timeout_s: float = 30.0) -> list[int]:
    """Stop a server an earlier (SIGKILLed) tuner left behind; the pids it stopped.

    The group is ours only if one of its members' command line contains `cmdline_marker`
    (e.g. "--port 8123"), so a recycled process-group id never costs a stranger its processes.
    vLLM renames its children (`VLLM::EngineCore`), so the marker is looked for in any member
    (in practice the API server, the group leader) and then the whole group is stopped.
    """
    members = [pid for pid in group_members(pgid) if _owned_by_us(pid)]
    # whole argv items only: "--port 800" must not match "--port 8000"
    if not members or not any(f" {cmdline_marker} " in f" {_cmdline(pid)} " for pid in members):
        return []
    kill_group(pgid, term_timeout_s)
    return members


def _owned_by_us(pid: int) -> bool:
    try:
        return os.stat(f"/proc/{pid}").st_uid == os.getuid()
    except OSError:
        return False


def _create_times(pids) -> dict[int, float]:
    import psutil

    times = {}
    for pid in pids:
        try:
            times[pid] = psutil.Process(pid).create_time()
        except psutil.Error:
            pass
    return times


def _kill_processes(create_times: dict[int, float], timeout_s: float = 10.0) -> None:
    """SIGKILL each process still alive with the same create time (a recycled pid is left
    alone), and wait until they are gone."""
    if not create_times:
        return
    import psutil

    procs = []
    for pid, created in create_times.items():
        try:
            proc = psutil.Process(pid)
            if proc.create_time() == created and proc.status() != psutil.STATUS_ZOMBIE:
                proc.kill()
                procs.append(proc)
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=timeout_s)


# ---------------------------------------------------------------------------------------------
# Live servers, so that Ctrl-C / SIGTERM to the tuner can stop them.

_LIVE: set["ServerProcess"] = set()
_LIVE_LOCK = threading.Lock()


_BALLASTS: set = set()   # tuner.run.ballast.Ballast: memory held for a server, stopped with it


def live_servers() -> list["ServerProcess"]:
    with _LIVE_LOCK:
        return list(_LIVE)


def register_ballast(ballast) -> None:
    with _LIVE_LOCK:
        _BALLASTS.add(ballast)


def unregister_ballast(ballast) -> None:
    with _LIVE_LOCK:
        _BALLASTS.discard(ballast)


def stop_all() -> None:
    """Stop every server this process started and has not stopped, the memory ballasts and the
    waiting spare. Safe from a signal handler."""
    for server in live_servers():
        server.stop()
    with _LIVE_LOCK:
        ballasts = list(_BALLASTS)
    for ballast in ballasts:
        ballast.stop()
    spare.discard()


DEFERRED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def signals_deferred():
    """Hold Ctrl-C, SIGTERM and SIGHUP until the block ends, then deliver them to the handlers
    they would have met, in the order they came. Main thread only (elsewhere a plain block).
    Handlers, not the signal mask: a mask would be inherited by the processes the block starts."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous = {sig: signal.getsignal(sig) for sig in DEFERRED_SIGNALS}
    for sig in DEFERRED_SIGNALS:
        signal.signal(sig, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        for signum in pending:
            signal.raise_signal(signum)


def install_signal_handlers() -> None:
    """SIGTERM and SIGHUP raise SystemExit in the main thread, so `with ServerProcess(...)` blocks
    unwind and stop their servers exactly as Ctrl-C (KeyboardInterrupt) does; `stop_all` runs at
    exit as a last resort. Call once from the CLI's main thread."""
    def _exit(signum, frame):
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, _exit)
    signal.signal(signal.SIGHUP, _exit)


atexit.register(stop_all)


# ---------------------------------------------------------------------------------------------
# A watchdog per server, so that no server outlives a tuner killed with SIGKILL.

# Run as `python -I -S -c WATCHDOG PGID GRACE_S` in a session of its own. Its stdin is a pipe the
# tuner alone holds: "stop" then end-of-file means the tuner stopped the server itself; end-of-file
# without it means the tuner died (SIGKILL, the OOM killer) with the server still up. Then it stops
# the server's group as `kill_group` does: TERM, a grace, KILL. The group is the server's while
# its leader has the start time it had when the watchdog began, or while members are left without
# the leader (the kernel hands out no pid still in use as a group id): a group id reused after the
# server ended costs no stranger its processes. No command-line marker is needed, so a warm spare
# that could not retitle itself is guarded too.
WATCHDOG = r"""
import os, signal, sys, time
pgid, grace = int(sys.argv[1]), float(sys.argv[2])

def stat(pid):
    try:
        raw = open("/proc/%d/stat" % pid).read()
    except OSError:
        return None
    return raw[raw.rfind(")") + 2:].split()

def members():
    found = []
    for entry in os.listdir("/proc"):
        fields = stat(int(entry)) if entry.isdigit() else None
        if fields and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            found.append(int(entry))
    return found

leader = stat(pgid)
if leader is None or leader[2] != str(pgid):
    sys.exit(0)                       # gone already, or not a group leader: nothing to guard
born = leader[19]
if sys.stdin.buffer.read().startswith(b"stop"):
    sys.exit(0)
now = stat(pgid)
if now is not None and now[19] != born:
    sys.exit(0)                       # the pid was reused: not the server any more
for sig, wait_s in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
    if not members():
        sys.exit(0)
    try:
        os.killpg(pgid, sig)
    except OSError:
        sys.exit(0)
    deadline = time.monotonic() + wait_s
    while members() and time.monotonic() < deadline:
        time.sleep(0.1)
"""
# A dead tuner's server gets this SIGTERM grace from its watchdog: a server still starting ignores
# SIGTERM for a while (see `ServerProcess.stop`), and nobody waits for a graceful end.
WATCHDOG_GRACE_S = 10.0


def start_watchdog(pgid: int, grace_s: float) -> subprocess.Popen | None:
    """A watchdog for the process group `pgid` (see WATCHDOG), with `grace_s` of SIGTERM before
    SIGKILL; None when it cannot start."""
    import sys

    try:
        return subprocess.Popen([sys.executable, "-I", "-S", "-c", WATCHDOG, str(pgid),
                                 f"{grace_s:g}"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
    except OSError:
        return None


def release_watchdog(watchdog: subprocess.Popen | None) -> None:
    """Tell a watchdog its server was stopped by the tuner, and let it exit."""
    if watchdog is None:
        return
    try:
        watchdog.stdin.write(b"stop\n")
        watchdog.stdin.close()
    except (OSError, ValueError):
        pass
    try:
        watchdog.wait(timeout=5)
    except subprocess.TimeoutExpired:
        watchdog.kill()


# ---------------------------------------------------------------------------------------------

def _http_get(host: str, port: int, path: str, headers: dict[str, str], timeout_s: float = 2.0
              ) -> tuple[int, str]:
    """(status, body) of a GET, or (0, "") when nothing answers."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request("GET", path, headers=headers)
        response = conn.getresponse()
        return response.status, response.read().decode(errors="replace")
    except (OSError, http.client.HTTPException):
        return 0, ""
    finally:
        conn.close()


class ServerProcess:
    """One server of the spec's engine, which gives its argv, readiness paths, log classifier and
    capacity parser. Use as a context manager: leaving it always stops the whole process group.

        with ServerProcess(spec) as server:
            server.start()                    # sets server.pid, server.pgid, server.base_url
            outcome = server.wait_ready()     # Capacity | LaunchFailure
    """

    poll_interval_s = 0.1
    failed_stop_timeout_s = 2.0   # SIGTERM grace for a server that failed to start
    crash_grace_s = 1.0   # wait this long after a generic fatal marker for the named cause

    def __init__(self, spec: LaunchSpec):
        self.spec = spec
        self.engine = _engine(spec)
        self.classify = self.engine.classify
        self.pid: int | None = None
        self.pgid: int | None = None
        self.port: int | None = None
        self.base_url: str = ""
        self.argv: list[str] = []
        self.log_path: str = spec.log_path
        self.capacity: Capacity | None = None
        self.failure: LaunchFailure | None = None
        self.started_at: float = 0.0            # time.monotonic() at start
        self.warm_imported_s: float | None = None  # a warm start: seconds its spare spent importing
        self.verdict_at: float | None = None     # time.time() of the verdict (ready or failure)
        self._proc: subprocess.Popen | None = None
        self._log_file = None
        self._log_reader = None
        self._log_text: list[str] = []
        self._scan_from = 0                      # offset of the first line not yet checked for fatal lines
        self._marker_seen_at: float | None = None
        self.listener_pids: dict[int, float] = {}  # pid: create time of ours listening on the port
        self._stopped = False
        self._stop_lock = threading.RLock()
        self._watchdog: subprocess.Popen | None = None

    @property
    def returncode(self) -> int | None:
        return self._proc.poll() if self._proc else None

    def start(self) -> None:
        if self._proc is not None:
            raise RuntimeError("server already started")
        engine_cmd = tuple(self.spec.engine_cmd) or tuple(self.engine.default_cmd())
        check_engine_cmd(engine_cmd, self.engine.label)
        self.port = self.spec.port or free_port(self.spec.host)
        self.argv = build_argv(self.spec, engine_cmd, self.port)
        self.base_url = f"http://{self.spec.host}:{self.port}"
        if not self.log_path:
            fd, self.log_path = tempfile.mkstemp(prefix=f"{self.engine.name}-", suffix=".log")
            os.close(fd)
        Path(self.log_path).parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.engine.env(), **dict(self.spec.env), "PYTHONUNBUFFERED": "1"}
        self.started_at = time.monotonic()
        # Ctrl-C between the process existing and its registration would leave a server no stop
        # reaches: the signal waits until it is registered, then stops it as anywhere else
        with signals_deferred():
            # a spare interpreter that already imported the engine's Python becomes the server
            warm = spare.take(engine_cmd, env, self.argv, self.log_path)
            if warm is not None:
                self._proc, self.warm_imported_s = warm
            else:
                # the child writes the log file itself: the log is complete even if the tuner dies
                self._log_file = open(self.log_path, "wb")
                self._proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL,
                                              stdout=self._log_file, stderr=subprocess.STDOUT,
                                              env=env, start_new_session=True)
            self.pid = self.pgid = self._proc.pid
            with _LIVE_LOCK:
                _LIVE.add(self)
        self._log_reader = open(self.log_path, "rb")
        # stops the server should this tuner be killed without a chance to (SIGKILL)
        self._watchdog = start_watchdog(self.pgid, min(self.spec.stop_timeout_s, WATCHDOG_GRACE_S))
        # and one for the launch after this one imports while this server starts
        spare.prepare(engine_cmd, env, getattr(self.engine, "warm_imports", ()))

    def log_text(self) -> str:
        """The log read so far (call `read_log` for what arrived since)."""
        return "".join(self._log_text)

    def read_log(self) -> str:
        """Take in what the server wrote since the last call; the whole log so far."""
        if self._log_reader is not None:
            chunk = self._log_reader.read()
            if chunk:
                self._log_text.append(chunk.decode(errors="replace"))
        return self.log_text()

    def _fatal_so_far(self, text: str) -> LaunchFailure | None:
        # only complete lines count: vLLM writes an exception line in one go, but a read may split it
        end = text.rfind("\n") + 1
        if end <= self._scan_from:
            return None
        # re-scan from a little before, so a message that spans lines is seen whole
        window_start = max(0, self._scan_from - 4000)
        self._scan_from = end
        if self._marker_seen_at is None and self.classify(text[window_start:end]) is None:
            return None
        failure = self.classify(text[:end])
        if failure is None or failure.kind != "crashed":
            return failure
        # vLLM logs "EngineCore failed to start." just before the traceback that names the cause:
        # give the cause a moment to land before settling for "crashed"
        if self._marker_seen_at is None:
            self._marker_seen_at = time.monotonic()
        if time.monotonic() - self._marker_seen_at < self.crash_grace_s:
            self._scan_from = window_start  # look again next loop
            return None
        return failure

    def _fail(self, failure: LaunchFailure) -> LaunchFailure:
        self.verdict_at = time.time()
        verdict_s = time.monotonic() - self.started_at
        # nothing to shut down gracefully: vLLM's API server, blocked waiting for its dead engine
        # core, ignores SIGTERM for tens of seconds
        self.stop(term_timeout_s=self.failed_stop_timeout_s)
        text = self.read_log()
        failure = dataclasses.replace(
            failure, verdict_s=verdict_s, log_tail=log_tail(text),
            exit_code=failure.exit_code if failure.exit_code is not None else self.returncode)
        self.failure = failure
        return failure

    def _headers(self) -> dict[str, str]:
        name = self.engine.api_key_env
        key = dict(self.spec.env).get(name) or os.environ.get(name)
        return {"Authorization": f"Bearer {key}"} if key else {}

    def wait_ready(self) -> Capacity | LaunchFailure:
        """Block until the server answers (Capacity) or shows it never will (LaunchFailure, server
        stopped). A fatal line in the log decides at once, even while the API server lingers."""
        if self._proc is None:
            raise RuntimeError("start() first")
        deadline = self.started_at + self.spec.launch_timeout_s
        host, port, headers = self.spec.host, self.port, self._headers()
        while True:
            text = self.read_log()
            if (failure := self._fatal_so_far(text)) is not None:
                return self._fail(failure)
            code = self._proc.poll()
            if code is not None:
                time.sleep(0.2)  # let the last lines land
                text = self.read_log()
                failure = self.classify(text) or LaunchFailure(
                    kind="crashed", message=_root_cause(text) or f"server exited with code {code}")
                return self._fail(dataclasses.replace(failure, exit_code=code))
            if self._serving(host, port, headers):
                answered = self._answered_by_us()
                if isinstance(answered, LaunchFailure):
                    return self._fail(answered)
                if answered:
                    return self._ready()
            if time.monotonic() > deadline:
                return self._fail(LaunchFailure(
                    kind="startup_timeout",
                    message=f"not ready after {self.spec.launch_timeout_s:g} s"))
            time.sleep(self.poll_interval_s)

    def _serving(self, host: str, port: int, headers: dict[str, str]) -> bool:
        """Every readiness path of the engine answers 200 (llama.cpp's /health is 503 while loading)."""
        for i, path in enumerate(self.engine.readiness_paths):
            status, _ = _http_get(host, port, path, headers if i else {}, timeout_s=2.0 if not i else 5.0)
            if status != 200:
                return False
        return True

    def _answered_by_us(self) -> bool | LaunchFailure:
        """Whether the server that answered the readiness probe is this one: a process of our
        group (or one it forked) listens on the port, and no other process does. Another
        listener, such as a server still shutting down on a port just released or a stranger,
        is "port_in_use": our server cannot bind there, and that server must not be measured.
        False while nobody visible listens yet (the answer came from a socket just closed).

        Needs the engine's listener to be one of its own processes (vLLM, SGLang and llama.cpp
        all listen in the launched process), not a proxy outside the group."""
        if self._proc.poll() is not None:
            return False         # the readiness loop reads the exit next
        try:
            import psutil
        except ImportError:      # our process being alive must do
            return True
        try:
            ours_pids = set(group_members(self.pgid))
            try:
                ours_pids |= {c.pid for c in psutil.Process(self.pid).children(recursive=True)}
            except psutil.Error:
                pass
            ours = {pid for pid, _ in _listeners(self.port, sorted(ours_pids))}
            reaching = _host_addresses(self.spec.host)
            # a socket psutil cannot map to a pid is another user's, or ours in a race: a
            # stranger only when none of ours listens
            strangers = [(pid, ip) for pid, ip in _listeners(self.port)
                         if pid not in ours_pids and ip in reaching and (pid is not None or not ours)]
        except (psutil.Error, OSError):     # no /proc/net to read: our process being alive must do
            return True
        if strangers:
            pid, ip = strangers[0]
            who = f"pid {pid} ({_cmdline(pid)[:120] or '?'})" if pid else "another user's process"
            return LaunchFailure(
                kind="port_in_use",
                message=f"port {self.port} answered, but {who} listens on {ip}:{self.port}, not "
                        f"the server's process group {self.pgid}")
        if not ours:
            return False
        self.listener_pids = _create_times(ours)
        return True

    def _ready(self) -> Capacity:
        ready_s = time.monotonic() - self.started_at
        self.verdict_at = time.time()
        spare.wait_imported()   # the next launch's spare is idle before any request is measured
        _, metrics = _http_get(self.spec.host, self.port, "/metrics", self._headers(), timeout_s=10.0)
        self.capacity = self.engine.parse_capacity(self.read_log(), metrics, ready_s)
        return self.capacity

    def stop(self, term_timeout_s: float | None = None) -> None:
        """Stop the whole process group, survivors included. Idempotent.

        `term_timeout_s` (default `spec.stop_timeout_s`) is the SIGTERM grace before SIGKILL."""
        # RLock: a signal handler calling stop_all() may interrupt a stop() of the same thread.
        # `_stopped` is set only once the group is gone, so an interrupted stop is retried by
        # stop_all() (atexit) instead of leaving the server unregistered and alive.
        with self._stop_lock:
            if self._stopped or self._proc is None:
                return
            if term_timeout_s is None:
                # a server still starting (no verdict yet) ignores SIGTERM until its handlers are in
                # (vLLM: ~30 s of waiting for nothing on Ctrl-C during a launch), and has measured
                # nothing: it gets the short grace of a failed start
                term_timeout_s = (self.spec.stop_timeout_s if self.verdict_at is not None
                                  else min(self.spec.stop_timeout_s, self.failed_stop_timeout_s))
            kill_group(self.pgid, term_timeout_s)
            # a listener that left the group (setsid) would keep the port after it: it goes too
            _kill_processes(self.listener_pids)
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            self._stopped = True
            release_watchdog(self._watchdog)
            self._watchdog = None
            if self._log_file is not None:
                self._log_file.close()
            with _LIVE_LOCK:
                _LIVE.discard(self)

    def close(self) -> None:
        self.stop()
        if self._log_reader is not None:
            self.read_log()
            self._log_reader.close()
            self._log_reader = None

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
