"""Launcher against real vLLM (CPU build) serving the embedded tiny model; one server at a time."""

from __future__ import annotations

from pathlib import Path

import pytest

from tuner.launcher import Capacity, LaunchFailure, LaunchSpec, ServerProcess, group_members
from tuner.presets import TINY_MODEL
from tuner.space import ServerParams

pytestmark = pytest.mark.vllm

DUMMY = ("--load-format", "dummy")


def spec(tmp_path: Path, params: ServerParams, env: tuple[tuple[str, str], ...] = ()) -> LaunchSpec:
    # the box is shared and small: generous launch timeout
    return LaunchSpec(model=str(TINY_MODEL), params=params, extra_args=DUMMY, env=env,
                      launch_timeout_s=600, log_path=str(tmp_path / "server.log"))


def test_config_that_fits_starts_and_reports_capacity(tmp_path):
    params = ServerParams(gpu_memory_utilization=0.1, max_model_len=2048, max_num_seqs=4)
    with ServerProcess(spec(tmp_path, params)) as server:
        server.start()
        outcome = server.wait_ready()
        assert isinstance(outcome, Capacity), getattr(outcome, "log_tail", outcome)
        pgid = server.pgid
    assert outcome.kv_cache_tokens and outcome.kv_cache_tokens >= 2048
    assert outcome.kv_cache_gib and outcome.kv_cache_gib > 0
    assert outcome.max_concurrency and outcome.max_concurrency >= 1
    assert outcome.num_gpu_blocks and outcome.block_size
    assert dict(outcome.cache_config)["gpu_memory_utilization"] == "0.1"
    assert 0 < outcome.ready_s < 600
    assert group_members(pgid) == []
    assert "KV cache size" in Path(server.log_path).read_text()


def test_max_model_len_that_does_not_fit_is_kv_cache_too_small(tmp_path):
    # 131072 tokens of the tiny model need ~0.5 GiB of KV cache; gmu 0.11 of this box's ~10 GiB
    # leaves ~0.3 GiB after ~0.75 GiB of runtime, so the length fails by a wide margin either side
    params = ServerParams(gpu_memory_utilization=0.11, max_model_len=131072, max_num_seqs=4)
    env = (("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1"),)   # the tiny model's own limit is 32768
    with ServerProcess(spec(tmp_path, params, env)) as server:
        server.start()
        outcome = server.wait_ready()
        pgid = server.pgid
    assert isinstance(outcome, LaunchFailure)
    assert outcome.kind == "kv_cache_too_small", outcome.log_tail
    assert outcome.needed_gib > outcome.available_gib > 0
    assert 2048 < outcome.estimated_max_model_len < 131072
    assert group_members(pgid) == []
