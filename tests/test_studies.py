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



def test_a_relative_model_folder_is_launched_by_its_absolute_path_and_stored_as_given(tmp_path, monkeypatch):
    # best-command.sh lives in results/NAME/: `--model m/tiny` would not resolve there; the study
    # keeps the path as given, so hosts sharing it from other folders resume it
    import shutil

    from tuner.config import load_study
    from tuner.models.checkpoint import resolve_model
    from tuner.models.presets import TINY_MODEL
    from tuner.search.study import setup_changes, study_summary

    shutil.copytree(TINY_MODEL, tmp_path / "m" / "tiny")
    (tmp_path / "m" / "link").symlink_to(tmp_path / "m" / "tiny")
    monkeypatch.chdir(tmp_path)
    demo = (Path(__file__).parent.parent / "tuner" / "studies" / "demo.toml").read_text()
    study = tmp_path / "s.toml"
    study.write_text(demo.replace('path = "preset:tiny"', 'path = "m/link"'))
    cfg = load_study(study)
    assert cfg.model == "m/link"
    model, _ = resolve_model(cfg, quiet=True)
    assert model == str(tmp_path / "m" / "link")          # absolute, the symlink kept
    stored = study_summary(cfg, model, ())
    other = tmp_path / "other-host"
    other.mkdir()
    monkeypatch.chdir(other)
    assert setup_changes(stored, load_study(study)) == []
