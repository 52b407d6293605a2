"""The committed study templates load and say what they promise."""

from __future__ import annotations

from pathlib import Path

from tuner.config import load_study

STUDIES = Path(__file__).resolve().parents[1] / "studies"


def test_gpu_template_loads_and_keeps_cuda_graphs():
    cfg = load_study(STUDIES / "gpu.toml")
    assert "--enforce-eager" not in cfg.extra_args
    space = {d.name: d for d in cfg.dimensions}
    gmu = space["gpu_memory_utilization"]
    assert (gmu.low, gmu.high) == (0.5, 0.95)
    assert min(space["max_num_seqs"].choices) == 1 and max(space["max_num_seqs"].choices) == 256
    assert max(space["max_model_len"].choices) <= 131072
    assert cfg.workload.prompt_tokens >= 512 and cfg.workload.max_concurrency >= 256


def test_a_relative_model_folder_is_made_absolute_so_exports_and_resumes_name_it(tmp_path, monkeypatch):
    # an exported best-command.sh lives in results/NAME/: `--model m/mistral` would not resolve there
    from tuner.config import load_study, local_model_path

    (tmp_path / "m" / "mistral").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert local_model_path("m/mistral") == str(tmp_path / "m" / "mistral")
    assert local_model_path("meta-llama/Llama-3.1-8B") == "meta-llama/Llama-3.1-8B"   # an HF id
    assert local_model_path("preset:tiny") == "preset:tiny"
    study = tmp_path / "s.toml"
    demo = (Path(__file__).parent.parent / "tuner" / "studies" / "demo.toml").read_text()
    study.write_text(demo.replace('path = "preset:tiny"', 'path = "m/mistral"'))
    assert 'path = "m/mistral"' in study.read_text()
    assert load_study(study).model == str(tmp_path / "m" / "mistral")
