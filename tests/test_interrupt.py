"""A signal that the tuner turns into KeyboardInterrupt stops a load test, wherever it lands.

uvloop reports an exception raised inside a protocol callback (aiohttp's data_received) and reads
on, so a KeyboardInterrupt raised by the signal handler there was lost: a SIGTERM during a load
test let the trial finish and the tuner exit 0. Real processes: the fake server streams thousands
of chunks a second, so the signal lands in the client's read path most of the time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import free_port, wait_until_serving

REPO = Path(__file__).resolve().parent.parent

CLIENT = """
import signal, sys, time
from tuner.cli import _raise_interrupt
from tuner.load.client import run_load_test
from tuner.records import Workload
signal.signal(signal.SIGTERM, _raise_interrupt)   # as `python -m tuner` sets it
w = Workload(prompt_tokens=8, output_tokens=5000, warmup_requests=0, single_stream_requests=0,
             levels=(64,), throughput_requests=1024, request_timeout_s=120)
print("loading", flush=True)
t0 = time.monotonic()
try:
    run_load_test(sys.argv[1], "fake", w, progress=False)
except KeyboardInterrupt:
    print(f"interrupted after {time.monotonic() - t0:.1f} s", flush=True)
    sys.exit(130)
print(f"finished after {time.monotonic() - t0:.1f} s", flush=True)
"""


@pytest.fixture
def streaming_server(tmp_path):
    port = free_port()
    env = {**os.environ, "FAKE_STREAM_DELAY": "0.0002"}   # 16 waves of 64 streams of 5,000 tokens: 16 s or more of streaming
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "fake_openai_server.py"), "--port", str(port)],
                                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(proc, url + "/health", 30, "the fake server", log, poll_s=0.1)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.parametrize("attempt", range(5))
def test_sigterm_mid_load_test_interrupts_it(streaming_server, attempt):
    client = subprocess.Popen([sys.executable, "-c", CLIENT, streaming_server], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    assert client.stdout.readline().strip() == "loading"
    time.sleep(2.0 + attempt * 0.37)          # well into the streams (prompts take well under that)
    client.send_signal(signal.SIGTERM)
    try:
        out, err = client.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        client.kill()
        out, err = client.communicate()
    assert client.returncode == 130, (out, err[-2000:])
    assert out.startswith("interrupted after"), out
    assert "KeyboardInterrupt" not in err      # not reported by the loop and read on
