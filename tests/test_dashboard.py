"""optuna-dashboard, as the README tells a user to start it, opens a tuner study's storage."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import optuna
import pytest

from conftest import free_port, wait_until_serving
from faultkit import patience

ROOT = Path(__file__).resolve().parents[1]


def dashboard_command() -> list[str]:
    """The `optuna-dashboard` beside this Python (the test extra installs it)."""
    exe = Path(sys.executable).parent / "optuna-dashboard"
    if not exe.exists():
        found = shutil.which("optuna-dashboard")
        if found is None:
            if os.environ.get("CI"):
                pytest.fail("optuna-dashboard is not installed: it is in the test extra")
            pytest.skip("optuna-dashboard not installed (pip install -e '.[test]')")
        exe = Path(found)
    return [str(exe)]


def get(url: str, timeout: float = 10.0) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read().decode()


@pytest.fixture
def dashboard(tmp_path):
    """optuna-dashboard on a free port against a copy of the committed H200 study."""
    db = tmp_path / "h200-full.db"
    shutil.copy(ROOT / "studies" / "h200-full.db", db)
    port = free_port()
    log = open(tmp_path / "dashboard.log", "wb")
    proc = subprocess.Popen([*dashboard_command(), f"sqlite:///{db}", "--host", "127.0.0.1",
                             "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(proc, base + "/api/studies", patience(60), "optuna-dashboard",
                           tmp_path / "dashboard.log", poll_s=0.3)
        yield base, db
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()


def test_dashboard_lists_the_study_and_its_trials(dashboard):
    base, db = dashboard
    status, body = get(base + "/api/studies")
    assert status == 200
    summaries = json.loads(body)["study_summaries"]
    assert [s["study_name"] for s in summaries] == ["h200-full"]
    assert summaries[0]["directions"] == ["maximize", "maximize", "minimize"]
    status, body = get(f"{base}/api/studies/{summaries[0]['study_id']}")
    detail = json.loads(body)
    assert detail["name"] == "h200-full"
    study = optuna.load_study(study_name="h200-full", storage=f"sqlite:///{db}")
    assert len(detail["trials"]) == len(study.trials)
    shown = {t["number"]: t["params"] for t in detail["trials"]}
    names = {p["name"] for params in shown.values() for p in params}
    assert names == {"gpu_memory_utilization", "max_model_len", "max_num_seqs"}


def test_dashboard_page_shows_the_study_in_a_browser(dashboard):
    from chromium import Page, need_chromium

    need_chromium()
    base, _ = dashboard
    status, body = get(base + "/dashboard")
    assert status == 200 and "<html" in body.lower()
    with Page() as page:
        page.open(base + "/dashboard")
        deadline = time.monotonic() + patience(30)
        while "h200-full" not in (page.eval("document.body.innerText") or ""):
            assert time.monotonic() < deadline, page.eval("document.body.innerText")[:500]
            time.sleep(0.3)
