"""Shared by the benchmarks: wait until a server process listens on a local port."""

from __future__ import annotations

import socket
import subprocess
import time


def wait_for_port(port: int, proc: subprocess.Popen, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit(f"{what} did not start")
            time.sleep(0.1)
