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
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vLLM exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(base_url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("vLLM did not become ready in 600 s")
            time.sleep(0.5)
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
