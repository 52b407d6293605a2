"""Model resolution against real files: checkpoint layouts, weightless folders and the HF cache."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from tuner.models import checkpoint, presets
from tuner.config import parse_study
from tuner.errors import HubUnreachable, ModelNotFound, TunerError

DUMMY = ("--load-format", "dummy")


def cfg_for(model: str, extra_args=()):
    return parse_study({"study": {"name": "ckpt"}, "model": {"path": model}, "server": {"extra_args": list(extra_args)},
                        "space": {"gpu_memory_utilization": {"choices": [0.5]},
                                  "max_model_len": {"choices": [1024]},
                                  "max_num_seqs": {"choices": [1]}}},
                       "<test>", {"storage": "sqlite:///:memory:"})


def config_json(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(presets.TINY_CONFIG))
    return folder


def sharded_safetensors(folder: Path, shards: int = 2) -> None:
    """Real safetensors shards and the index json that maps tensors to them, as HF writes them."""
    weight_map = {}
    for i in range(1, shards + 1):
        name = f"model-{i:05d}-of-{shards:05d}.safetensors"
        tensor = f"model.layers.{i}.mlp.weight"
        save_file({tensor: np.ones((4, 4), dtype=np.float16)}, str(folder / name))
        weight_map[tensor] = name
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 32 * shards}, "weight_map": weight_map}))


def test_nested_safetensors_shards_are_served_from_their_folder(tmp_path, capsys):
    inner = config_json(tmp_path / "download" / "Llama-tiny")
    sharded_safetensors(inner)
    (tmp_path / "download" / "README.md").write_text("unpacked from a tarball")
    path, extra = checkpoint.resolve_model(cfg_for(str(tmp_path / "download")))
    assert (path, extra) == (str(inner), ())
    assert str(inner) in capsys.readouterr().err


@pytest.mark.parametrize("files", [["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"],
                                   ["pytorch_model-00001-of-00002.bin"],
                                   ["consolidated.00.pth"]])
def test_top_level_weights_in_any_layout_vllm_loads(tmp_path, files):
    folder = config_json(tmp_path / "m")
    for f in files:
        (folder / f).write_bytes(b"\0" * 64)
    assert checkpoint.resolve_model(cfg_for(str(folder))) == (str(folder), ())


def test_a_lone_gguf_is_served_by_its_file(tmp_path):
    (tmp_path / "q").mkdir()
    (tmp_path / "q" / "model-Q4_K_M.gguf").write_bytes(b"GGUF")
    assert checkpoint.resolve_model(cfg_for(str(tmp_path / "q")))[0] == str(tmp_path / "q" / "model-Q4_K_M.gguf")


def test_an_hf_cache_repo_folder_serves_its_main_snapshot(tmp_path):
    repo = tmp_path / "models--org--name"
    for rev in ("old", "abc123"):
        config_json(repo / "snapshots" / rev)
        (repo / "snapshots" / rev / "model.safetensors").write_bytes(b"\0" * 8)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    assert checkpoint.resolve_model(cfg_for(str(repo)))[0] == str(repo / "snapshots" / "abc123")


def test_a_weightless_folder_is_served_dummy_and_says_so_once(tmp_path, capsys):
    folder = config_json(tmp_path / "shape")
    (folder / "training_args.bin").write_bytes(b"\0")   # a trainer's leftover, no weights
    cfg = cfg_for(str(folder), ["--enforce-eager"])
    assert checkpoint.resolve_model(cfg) == (str(folder), ("--enforce-eager", *DUMMY))
    assert checkpoint.resolve_model(cfg) == (str(folder), ("--enforce-eager", *DUMMY))
    assert capsys.readouterr().err.count("--load-format dummy") == 1


def test_presets_are_weightless(tmp_path):
    assert checkpoint.resolve_model(cfg_for("preset:tiny")) == (str(presets.TINY_MODEL), DUMMY)


@pytest.mark.parametrize("make, problem", [
    (lambda p: None, "does not exist"),
    (lambda p: p.mkdir(), "no config.json"),
    (lambda p: [sharded_safetensors(config_json(p / d)) for d in ("a", "b")], "several checkpoints"),
])
def test_folders_that_are_no_model_say_why(tmp_path, make, problem):
    make(tmp_path / "m")
    with pytest.raises(ModelNotFound, match=problem):
        checkpoint.resolve_model(cfg_for(str(tmp_path / "m")))


@pytest.mark.parametrize("name, fix", [("model.json", "give the folder that holds config.json)"),
                                       ("config.json", "give the folder that holds config.json: ")])
def test_a_file_given_as_the_model_is_not_called_a_missing_folder(tmp_path, name, fix):
    path = config_json(tmp_path / "m") / name
    path.write_text("{}")
    with pytest.raises(ModelNotFound, match="is a file, not a folder") as err:
        checkpoint.resolve_model(cfg_for(str(path)))
    assert fix in str(err.value) and "does not exist" not in str(err.value)


def hf_cache(home: Path, repo_id: str, files: dict[str, bytes]) -> Path:
    """The layout huggingface_hub leaves: hub/models--org--name/{refs/main, snapshots/REV/...}."""
    repo = home / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    config_json(snapshot)
    for name, data in files.items():
        (snapshot / name).write_bytes(data)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(snapshot.name)
    return snapshot


@pytest.mark.parametrize("offline", ["1", None])
def test_a_cached_hub_id_resolves_to_its_snapshot_without_the_network(tmp_path, monkeypatch, offline):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", offline)
    else:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    snapshot = hf_cache(tmp_path / "hf", "org/name", {"model.safetensors": b"\0" * 8})
    assert checkpoint.resolve_model(cfg_for("org/name")) == (str(snapshot), ())


def test_offline_hub_id_without_cache_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubUnreachable, match="not in the local HF cache .*HF_HUB_OFFLINE") as e:
        checkpoint.resolve_model(cfg_for("org/missing"))
    assert isinstance(e.value, TunerError) and "\n" not in str(e.value)
    hf_cache(tmp_path / "hf", "org/config-only", {})       # a partial cache: config, no weights
    with pytest.raises(HubUnreachable, match="holds no weights"):
        checkpoint.resolve_model(cfg_for("org/config-only"))


def test_cli_prints_one_line_and_exits_2_for_an_offline_hub_id(tmp_path):
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-m", "tuner", "run", "--model", "org/missing",
                          "--trials", "1", "--storage", f"sqlite:///{tmp_path}/s.db",
                          "--results", str(tmp_path / "r")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.startswith("tuner: error: model 'org/missing': not in the local HF cache")
    assert len(out.stderr.strip().splitlines()) == 1


def test_doctor_never_downloads(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    cfg = cfg_for("org/uncached")
    assert checkpoint.resolve_model(cfg, fetch=False) == ("org/uncached", ())


def test_hub_fetch_takes_one_weight_format():
    files = ["config.json", "model-00001-of-00002.safetensors", "model.safetensors.index.json",
             "original/consolidated.00.pth", "pytorch_model.bin", "tokenizer.json"]
    patterns = checkpoint.hub_weight_patterns(files)
    assert "*.safetensors" in patterns and "*.bin" not in patterns and "*.pth" not in patterns
    assert "*.bin" in checkpoint.hub_weight_patterns(["config.json", "pytorch_model.bin"])
