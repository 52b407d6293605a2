"""`python -m tuner run --study demo-llamacpp` on the real llama.cpp server, then show and export, as a fresh clone runs them."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tuner import config, engines

pytestmark = pytest.mark.llamacpp

REPO = Path(__file__).resolve().parent.parent


def tuner(cwd: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tuner", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_the_embedded_llamacpp_demo_reads_as_a_llamacpp_study():
    cfg = config.load_study(str(REPO / "tuner" / "studies" / "demo-llamacpp.toml"))
    assert cfg.engine_name == "llamacpp" and cfg.engine == ()
    assert {d.name for d in cfg.dimensions} == {"ctx_size", "parallel", "kv_unified"}
    assert engines.current() == "llamacpp"
    assert (REPO / "studies" / "demo-llamacpp.toml").read_text() == \
        (REPO / "tuner" / "studies" / "demo-llamacpp.toml").read_text()


def test_demo_llamacpp_runs_shows_and_exports(tmp_path):
    run = tuner(tmp_path, "run", "--study", "demo-llamacpp", "--trials", "4", "--replicates", "0")
    assert run.returncode == 0, run.stderr[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "results" / "demo-llamacpp" / "trials.csv")))
    assert len(rows) >= 4
    measured = [r for r in rows if r["single_stream_tok_s"]]
    assert measured, [r["failure"] for r in rows]
    for r in measured:
        assert float(r["single_stream_tok_s"]) > 10 and float(r["ttft_ms"]) > 0
        assert "tuner.engines.llamacpp_server" in r["command"] and " -c " in r["command"]
    assert {r["baseline"] for r in rows} >= {"llamacpp-defaults", "hand-tuned"}
    for png in ("pareto.png", "parameters.png", "curves.png"):
        assert (tmp_path / "results" / "demo-llamacpp" / png).stat().st_size > 10_000
    show = tuner(tmp_path, "show", "--study", "demo-llamacpp")
    assert show.returncode == 0 and "ctx_size" in show.stdout
    export = tuner(tmp_path, "export", "--study", "demo-llamacpp")
    assert export.returncode == 0, export.stderr
    line = export.stdout.strip()
    assert line.startswith("llama-server -m MODEL -c ") and " -np " in line and "--port" not in line
    script = (tmp_path / "results" / "demo-llamacpp" / "best-command.sh").read_text()
    assert "llama.cpp's default port 8080" in script and 'exec llama-server -m "$MODEL"' in script
