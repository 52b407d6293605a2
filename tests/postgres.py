"""A real PostgreSQL server for the tests: Debian's binaries, data in a temporary folder, on 127.0.0.1.

Skipped on a developer machine without PostgreSQL; CI installs it (.ci/run), so there a missing
server fails the test rather than skipping it, as tests/chromium.py does for the browser.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

USER = "tuner"


def bin_dir() -> Path | None:
    """The folder of initdb and pg_ctl: on PATH, or Debian's /usr/lib/postgresql/N/bin."""
    found = shutil.which("pg_ctl")
    if found and shutil.which("initdb"):
        return Path(os.path.realpath(found)).parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"),
                      key=lambda p: int(Path(p).parent.parent.name) if Path(p).parent.parent.name.isdigit() else 0)
    return Path(versions[-1]).parent if versions else None


def missing(reason: str):
    if os.environ.get("CI"):
        pytest.fail(f"{reason}: CI installs PostgreSQL (.ci/run), so this must not happen there")
    pytest.skip(f"{reason} (apt-get install -y postgresql)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server():
    """Yield a postgresql:// URL of a fresh server; stop it and remove its data afterwards.

    PostgreSQL refuses to run as root: as root the server runs as the `postgres` user Debian's
    package creates (runuser), with its data in a folder that user owns."""
    binaries = bin_dir()
    if binaries is None:
        missing("PostgreSQL is not installed (no initdb / pg_ctl)")
    try:
        import psycopg  # noqa: F401  (SQLAlchemy 2.1's default driver for postgresql:// URLs)
    except ImportError:
        missing("psycopg is not installed (pip install 'psycopg[binary]'; it is in the test extra)")
    as_user: list[str] = []
    if os.getuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            missing("running as root and there is no postgres user to run PostgreSQL as")
        as_user = ["runuser", "-u", "postgres", "--"]
    folder = Path(tempfile.mkdtemp(prefix="tuner-pg-"))
    data = folder / "data"
    if as_user:
        shutil.chown(folder, "postgres", "postgres")
    port = _free_port()

    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([*as_user, *argv], capture_output=True, text=True, timeout=120)

    try:
        done = run(str(binaries / "initdb"), "-D", str(data), "--username", USER, "--auth", "trust",
                   "--encoding", "UTF8", "--no-sync")
        assert done.returncode == 0, done.stderr[-2000:]
        # TCP on 127.0.0.1 only, no unix socket (its default folder may not exist or be writable)
        options = f"-c listen_addresses=127.0.0.1 -p {port} -c unix_socket_directories='' -c fsync=off"
        done = run(str(binaries / "pg_ctl"), "-D", str(data), "-l", str(folder / "server.log"),
                   "-o", options, "-w", "-t", "60", "start")
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:] + _read(folder / "server.log")
        url = f"postgresql://{USER}@127.0.0.1:{port}/postgres"
        _wait_accepting(url)
        yield url
    finally:
        if (data / "postmaster.pid").exists():
            run(str(binaries / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(folder, ignore_errors=True)


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-2000:]
    except OSError:
        return ""


def _wait_accepting(url: str, timeout_s: float = 30.0) -> None:
    import sqlalchemy

    engine = sqlalchemy.create_engine(url)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                with engine.connect() as conn:
                    conn.execute(sqlalchemy.text("select 1"))
                return
            except sqlalchemy.exc.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    finally:
        engine.dispose()
