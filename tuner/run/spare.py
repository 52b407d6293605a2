"""A warm start for the next launch: an interpreter that has already imported the engine's Python
and waits for its argv.

A vLLM launch spends 10-15 s importing torch, transformers and vLLM in the API-server process
before it reads its arguments. That work does not depend on the config, so while one server
launches, a spare interpreter is started with the same command and environment and imports what
the server's entry point imports at its top, then blocks reading one line from its stdin. The
next launch hands it the argv and the log path: it redirects its output into the log, takes the
server's command line as its process title (so `ps` and the orphan reaper see `--port N`), and
runs the entry point as `__main__` exactly as `python -m MODULE` or the console script would. The
server it becomes runs the same code with the same arguments and environment; it only did its
imports earlier. What the engine itself does after that (vLLM spawning its engine core, which
imports again) is untouched.

Only Python entry points qualify: `python -m MODULE ...`, or a script whose first line names a
Python interpreter (`vllm serve`). A spare never runs during a load test: `wait_imported` holds
the caller until its imports are done, and a spare of another command or environment is stopped,
not used. A spare whose tuner dies reads end-of-file and exits.

    spare.enable()                       # `tuner run` does this (TUNER_WARM_START=0 turns it off)
    proc = spare.take(engine_cmd, env, argv, log_path)   # a Popen, or None: start it cold
    spare.prepare(engine_cmd, env, engine.warm_imports)  # for the launch after this one
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

# Run in the engine's own interpreter (which may not have the tuner installed), as `python -c`.
# argv: kind ("module" | "script"), target (module name | script path), ready file, extra modules.
BOOTSTRAP = r'''
import ast, importlib, importlib.util, json, os, runpy, sys, time
kind, target, ready_path, extra = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
t0 = time.monotonic()

def top_imports(path, package):
    """The modules a file imports at its top level (what running it would import first)."""
    try:
        tree = ast.parse(open(path, "rb").read())
    except (OSError, SyntaxError, ValueError):
        return []
    names = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            name = "." * node.level + (node.module or "")
            try:
                names.append(importlib.util.resolve_name(name, package) if node.level else name)
            except (ImportError, ValueError):
                pass
    return names

if kind == "module":
    spec = importlib.util.find_spec(target)
    origin = spec.origin if spec is not None else None
    wanted = top_imports(origin, target.rpartition(".")[0]) if origin else []
else:
    wanted = top_imports(target, None)
for name in wanted + extra:
    if name == target:
        continue                      # the entry point itself runs once, as __main__
    try:
        importlib.import_module(name)
    except Exception:
        pass                          # the run reports what fails, as a cold start would
sys.stdout.flush(); sys.stderr.flush()
with open(ready_path + ".tmp", "w") as f:
    f.write("%.3f\n" % (time.monotonic() - t0))
os.replace(ready_path + ".tmp", ready_path)
line = sys.stdin.readline()
if not line:
    sys.exit(0)                       # the tuner is gone or stopped us: nothing to serve
request = json.loads(line)
null = os.open(os.devnull, os.O_RDONLY); os.dup2(null, 0); os.close(null)
log = os.open(request["log"], os.O_WRONLY | os.O_APPEND)
os.dup2(log, 1); os.dup2(log, 2); os.close(log)
try:
    import setproctitle
    setproctitle.setproctitle(" ".join(request["argv"]))
except Exception:
    pass
sys.argv = [target] + request["args"]
if kind == "module":
    runpy.run_module(target, run_name="__main__", alter_sys=True)
else:
    runpy.run_path(target, run_name="__main__")
'''

ENV_SWITCH = "TUNER_WARM_START"   # "0": every launch starts cold
# Comma-separated modules every spare imports too (an experiment's knob, e.g. the modules vLLM's
# forked engine core imports after the fork; one that initialises CUDA makes vLLM spawn instead,
# which its log says as "We must use the `spawn` multiprocessing start method").
ENV_IMPORTS = "TUNER_WARM_IMPORTS"
_enabled = False
_lock = threading.Lock()


def enable(on: bool = True) -> None:
    """Let launches use (and prepare) spares; the environment switch TUNER_WARM_START=0 wins."""
    global _enabled
    _enabled = on and os.environ.get(ENV_SWITCH, "1") != "0"


def enabled() -> bool:
    return _enabled


def entry_point(engine_cmd: tuple[str, ...]) -> tuple[list[str], str, str, int] | None:
    """(interpreter argv, kind, target, words of engine_cmd it replaces) for a Python entry point:
    `python -m MODULE` or a script with a Python shebang; None otherwise (a binary, a wrapper)."""
    cmd = list(engine_cmd)
    if len(cmd) >= 3 and cmd[1] == "-m" and "python" in Path(cmd[0]).name:
        return [cmd[0]], "module", cmd[2], 3
    if not cmd or not os.path.isfile(cmd[0]):
        return None
    try:
        with open(cmd[0], "rb") as f:
            first = f.readline(200).decode(errors="replace").strip()
    except OSError:
        return None
    if not first.startswith("#!") or "python" not in first:
        return None
    interpreter = first[2:].split()
    return interpreter, "script", cmd[0], 1


@dataclass
class Spare:
    """One waiting interpreter: the Popen, what it was started for, and its ready file."""

    key: tuple
    proc: subprocess.Popen
    prefix: int                       # words of the argv the entry point replaces
    ready_path: str
    output_path: str                  # what it printed while importing, for the log's head
    started_at: float = field(default_factory=time.monotonic)

    def imported_s(self) -> float | None:
        """Seconds its imports took, once done; None before (or if it died)."""
        try:
            return float(Path(self.ready_path).read_text())
        except (OSError, ValueError):
            return None

    def discard(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()        # end-of-file: it exits by itself
            except OSError:
                pass
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        _unlink(self.ready_path, self.output_path)


_spare: Spare | None = None


def _key(engine_cmd, env) -> tuple:
    return tuple(engine_cmd), tuple(sorted(env.items()))


def _unlink(*paths) -> None:
    for p in paths:
        try:
            os.unlink(p)
        except OSError:
            pass


def prepare(engine_cmd: tuple[str, ...], env: dict[str, str], extra_imports: tuple[str, ...] = ()) -> None:
    """Start a spare for the next launch of `engine_cmd` with `env` (nothing when one is ready for
    exactly that, when warm starts are off, or when the command is no Python entry point)."""
    global _spare
    if not _enabled:
        return
    entry = entry_point(engine_cmd)
    if entry is None:
        return
    key = _key(engine_cmd, env)
    with _lock:
        if _spare is not None and _spare.key == key and _spare.proc.poll() is None:
            return
        discard()
        interpreter, kind, target, prefix = entry
        extra = extra_imports if kind == "script" else ()   # a module names its own imports
        # and what the user adds: modules the engine's child processes import after a fork
        extra += tuple(m.strip() for m in os.environ.get(ENV_IMPORTS, "").split(",") if m.strip())
        fd, ready_path = tempfile.mkstemp(prefix="tuner-spare-", suffix=".ready")
        os.close(fd)
        os.unlink(ready_path)
        fd, output_path = tempfile.mkstemp(prefix="tuner-spare-", suffix=".log")
        try:
            proc = subprocess.Popen(
                [*interpreter, "-c", BOOTSTRAP, kind, target, ready_path, *extra],
                stdin=subprocess.PIPE, stdout=fd, stderr=subprocess.STDOUT, env=env,
                start_new_session=True)
        except OSError:
            _unlink(output_path)
            return
        finally:
            os.close(fd)
        _spare = Spare(key, proc, prefix, ready_path, output_path)


def take(engine_cmd: tuple[str, ...], env: dict[str, str], argv: list[str],
         log_path: str) -> tuple[subprocess.Popen, float] | None:
    """Hand `argv` to the spare started for this command and environment: (its Popen, seconds its
    imports took), the log begun with what it printed while importing. None when there is no
    live spare for exactly that (start the server cold)."""
    global _spare
    if not _enabled:
        return None
    with _lock:
        spare = _spare
        if spare is None or spare.key != _key(engine_cmd, env) or spare.proc.poll() is not None:
            return None
        _spare = None
        try:
            head = Path(spare.output_path).read_bytes()
            Path(log_path).write_bytes(head)
            request = {"argv": list(argv), "args": list(argv[spare.prefix:]), "log": str(log_path)}
            spare.proc.stdin.write((json.dumps(request) + "\n").encode())
            spare.proc.stdin.close()
        except (OSError, ValueError):
            spare.discard()
            return None
        imported = spare.imported_s()
        if imported is None:          # still importing: all it did so far was done ahead
            imported = time.monotonic() - spare.started_at
        _unlink(spare.ready_path, spare.output_path)
        return spare.proc, imported


def wait_imported(timeout_s: float = 120.0) -> None:
    """Block until the waiting spare (if any) has done its imports, so it is idle during a load
    test; a spare not done by then is stopped."""
    with _lock:
        spare = _spare
    if spare is None:
        return
    deadline = time.monotonic() + timeout_s
    while spare.imported_s() is None and spare.proc.poll() is None:
        if time.monotonic() > deadline:
            with _lock:
                discard()
            return
        time.sleep(0.1)


def discard() -> None:
    """Stop the waiting spare, if any (call with the lock held, or at exit)."""
    global _spare
    spare, _spare = _spare, None
    if spare is not None:
        spare.discard()


atexit.register(discard)
