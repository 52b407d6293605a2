"""Shared fixtures: the embedded tiny model and one real vLLM (CPU build) server per test session."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tuner.models.presets import TINY_MODEL

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_serving(proc: subprocess.Popen, url: str, timeout_s: float, what: str,
                       log: Path, poll_s: float = 0.5) -> None:
    """Poll `url` until it answers 200 while watching `proc`: the test fails at once, with the
    tail of `log`, when the process exits first, and after `timeout_s` when it never answers."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
            pytest.fail(f"{what} exited with {proc.returncode}:\n{tail}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not answer {url} in {timeout_s:.0f} s")
        time.sleep(poll_s)


@pytest.fixture(autouse=True)
def _engine_in_use_is_vllm():
    """Each test starts with vLLM as the engine in use (a llama.cpp study or test switches it)."""
    from tuner import engines

    engines.use("vllm")
    yield
    engines.use("vllm")


@pytest.fixture(scope="session")
def tiny_model() -> str:
    return str(TINY_MODEL)


@contextlib.contextmanager
def real_vllm(model: str, log: Path, *extra: str, max_model_len: int = 1024):
    """A real vLLM server (CPU build) of `model` with dummy weights; yields its base URL."""
    port = free_port()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--load-format", "dummy", "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", str(max_model_len), "--max-num-seqs", "8", "--gpu-memory-utilization", "0.1",
            *extra]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(proc, base_url + "/health", 600, "vLLM", log)
        yield base_url
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="session")
def tiny_vllm_server(tmp_path_factory):
    """A real vLLM server (CPU build) of the tiny model; yields (base_url, served model name)."""
    with real_vllm(str(TINY_MODEL), tmp_path_factory.mktemp("vllm") / "server.log") as base_url:
        yield base_url, str(TINY_MODEL)
