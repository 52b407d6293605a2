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
