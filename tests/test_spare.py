"""A warm spare interpreter: it imports an entry point's modules ahead, then becomes the server
with the argv it is handed, and never outlives the tuner."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tuner.run import spare
from tuner.run.process import _cmdline

# A stand-in entry point: its top-level import is slow and leaves a mark per importing process;
# run as __main__ it prints what it was given, shows its title for a moment and exits 3.
DEP = """
import os, sys, time
print("importing dep", flush=True)
with open(os.environ["MARKS"], "a") as f:
    f.write(f"{os.getpid()}\\n")
time.sleep(0.5)
"""
ENTRY = """
import os, sys, time
import standin_dep
if __name__ == "__main__":
    print("argv", sys.argv[1:], "env", os.environ.get("FLAVOUR"), "main", __name__, flush=True)
    open(os.environ["MARKS"] + ".serving", "w").write(str(os.getpid()))
    time.sleep(float(os.environ.get("SERVE_S", "0")))
    sys.exit(3)
"""


@pytest.fixture
def standin(tmp_path, monkeypatch):
    (tmp_path / "standin_dep.py").write_text(DEP)
    (tmp_path / "standin_server.py").write_text(ENTRY)
    script = tmp_path / "standin-cli"
    script.write_text(f"#!{sys.executable}\nimport standin_server\nimport runpy, sys\n"
                      "print('script argv', sys.argv[1:], flush=True)\n")
    script.chmod(0o755)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "MARKS": str(tmp_path / "marks"),
           "FLAVOUR": "a", "PYTHONUNBUFFERED": "1"}
    monkeypatch.delenv(spare.ENV_SWITCH, raising=False)
    spare.enable()
    yield tmp_path, env, script
    spare.discard()
    spare.enable(False)


def marks(tmp_path: Path) -> list[str]:
    path = tmp_path / "marks"
    return path.read_text().split() if path.exists() else []


def test_a_spare_imports_ahead_then_runs_the_module_as_main_with_the_argv_it_is_handed(standin):
    tmp_path, env, _ = standin
    cmd = (sys.executable, "-m", "standin_server")
    spare.prepare(cmd, env)
    spare.wait_imported(timeout_s=60)
    assert len(marks(tmp_path)) == 1          # imported before any argv was known
    importer = marks(tmp_path)[0]

    log = tmp_path / "server.log"
    argv = [*cmd, "--model", "m", "--port", "1234"]
    taken = spare.take(cmd, env, argv, str(log))
    assert taken is not None
    proc, imported_s = taken
    assert imported_s >= 0.5                  # the stand-in's import sleeps half a second
    assert proc.wait(timeout=60) == 3         # its exit code is the server's
    text = log.read_text()
    # the log begins with what it printed while importing, then the run as __main__
    assert text.index("importing dep") < text.index("argv ['--model', 'm', '--port', '1234']")
    assert "env a main __main__" in text
    assert marks(tmp_path) == [importer]      # the module's imports were not done again
    assert str(proc.pid) == importer


def test_a_served_spare_carries_the_servers_command_line_as_its_title(standin):
    tmp_path, env, _ = standin
    env = {**env, "SERVE_S": "3"}
    cmd = (sys.executable, "-m", "standin_server")
    spare.prepare(cmd, env)
    spare.wait_imported(timeout_s=60)
    argv = [*cmd, "--port", "4321"]
    proc, _ = spare.take(cmd, env, argv, str(tmp_path / "server.log"))
    serving = tmp_path / "marks.serving"
    deadline = time.monotonic() + 30
    while not serving.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    # the orphan reaper finds a server by "--port N" in its command line
    assert " --port 4321" in _cmdline(proc.pid)
    assert proc.wait(timeout=30) == 3


def test_a_console_script_runs_as_main_after_its_imports_and_the_engines_are_done(standin):
    tmp_path, env, script = standin
    cmd = (str(script), "serve")
    spare.prepare(cmd, env, ("json",))
    spare.wait_imported(timeout_s=60)
    assert len(marks(tmp_path)) == 1          # the script's own top-level imports, done ahead
    proc, _ = spare.take(cmd, env, [*cmd, "model", "--port", "9"], str(tmp_path / "server.log"))
    assert proc.wait(timeout=60) == 0
    assert "script argv ['serve', 'model', '--port', '9']" in (tmp_path / "server.log").read_text()
    assert len(marks(tmp_path)) == 1


def test_modules_named_in_the_environment_are_imported_ahead_too(standin, monkeypatch):
    tmp_path, env, _ = standin
    (tmp_path / "standin_more.py").write_text(
        "import os\nopen(os.environ['MARKS'] + '.more', 'a').write(f'{os.getpid()}\\n')\n")
    monkeypatch.setenv(spare.ENV_IMPORTS, " standin_more , ,")
    cmd = (sys.executable, "-m", "standin_server")
    spare.prepare(cmd, env)
    spare.wait_imported(timeout_s=60)
    more = tmp_path / "marks.more"
    assert more.exists() and more.read_text().split() == marks(tmp_path)   # by the spare, once
    proc, _ = spare.take(cmd, env, [*cmd, "--port", "5"], str(tmp_path / "server.log"))
    assert proc.wait(timeout=60) == 3
    assert more.read_text().split() == [str(proc.pid)]


def test_no_spare_serves_another_command_or_environment(standin):
    tmp_path, env, _ = standin
    cmd = (sys.executable, "-m", "standin_server")
    spare.prepare(cmd, env)
    assert spare.take(cmd, {**env, "FLAVOUR": "b"}, [*cmd], str(tmp_path / "a.log")) is None
    assert spare.take((sys.executable, "-m", "other"), env, [sys.executable], str(tmp_path / "b.log")) is None
    assert spare.take(cmd, env, [*cmd], str(tmp_path / "c.log")) is not None


def test_a_binary_gets_no_spare_and_the_switch_turns_warm_starts_off(standin, monkeypatch):
    tmp_path, env, _ = standin
    assert spare.entry_point(("/bin/sh", "-c", "true")) is None
    assert spare.entry_point((sys.executable, "-m", "standin_server"))[1:] == ("module", "standin_server", 3)
    monkeypatch.setenv(spare.ENV_SWITCH, "0")
    spare.enable()
    assert not spare.enabled()
    cmd = (sys.executable, "-m", "standin_server")
    spare.prepare(cmd, env)
    assert spare.take(cmd, env, [*cmd], str(tmp_path / "server.log")) is None
    assert marks(tmp_path) == []


def test_a_spare_exits_when_its_tuner_dies(standin):
    tmp_path, env, _ = standin
    # a tuner that starts a spare and dies at once (os._exit: no atexit, no cleanup)
    tuner = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
        from tuner.run import spare
        spare.enable()
        spare.prepare((sys.executable, "-m", "standin_server"), dict(os.environ))
        spare.wait_imported(timeout_s=60)
        print(spare._spare.proc.pid, flush=True)
        os._exit(0)
    """)
    out = subprocess.run([sys.executable, "-c", tuner], env=env, capture_output=True, text=True, timeout=120)
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 30
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")
