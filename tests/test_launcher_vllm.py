"""Launcher against real vLLM (CPU build) serving the embedded tiny model; one server at a time."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from tuner.run.process import Capacity, LaunchFailure, LaunchSpec, ServerProcess, group_members
from tuner.models.presets import TINY_MODEL
from tuner.search.space import ServerParams

pytestmark = pytest.mark.vllm

DUMMY = ("--load-format", "dummy")


def spec(tmp_path: Path, params: ServerParams, env: tuple[tuple[str, str], ...] = ()) -> LaunchSpec:
    # the box is shared and small: generous launch timeout
    return LaunchSpec(model=str(TINY_MODEL), params=params, extra_args=DUMMY, env=env,
                      launch_timeout_s=600, log_path=str(tmp_path / "server.log"))


def complete(server: ServerProcess, model: str, prompt: str, max_tokens: int) -> dict:
    """The answer of one /v1/completions request of exactly `max_tokens` tokens."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "ignore_eos": True}).encode()
    request = urllib.request.Request(server.base_url + "/v1/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.load(reply)


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
    print(f"\nready in {outcome.ready_s:.1f} s: {outcome}")
    assert group_members(pgid) == []
    text = Path(server.log_path).read_text()
    assert "KV cache size" in text
    # the CPU build logs model initialization and init engine (its compile happens in the warmup),
    # and its lines' timestamps give the engine process's start
    phases = server.engine.launch_phases(text)
    print(f"launch phases: {phases}")
    assert set(phases) == {"engine_start", "weights", "profile"}
    assert phases["engine_start"] >= 0
    assert 0 < phases["weights"] < phases["profile"] and sum(phases.values()) < outcome.ready_s


def test_a_warm_start_serves_the_same_as_a_cold_one_and_leaves_nothing_behind(tmp_path):
    """The second launch is a spare that imported vLLM while the first started: it reports the
    same KV cache, answers a request, and no spare or server is left once the tuner is done."""
    from tuner.run import spare, process

    params = ServerParams(gpu_memory_utilization=0.1, max_model_len=2048, max_num_seqs=4)
    spare.enable()
    try:
        capacities, warm, cmdlines = [], [], []
        for i in range(2):
            launch = LaunchSpec(**{**spec(tmp_path, params).__dict__, "log_path": str(tmp_path / f"{i}.log")})
            with ServerProcess(launch) as server:
                server.start()
                outcome = server.wait_ready()
                assert isinstance(outcome, Capacity), getattr(outcome, "log_tail", outcome)
                answer = complete(server, str(TINY_MODEL), "hi", 3)
                assert answer["usage"]["completion_tokens"] == 3
                capacities.append(outcome.kv_cache_tokens)
                warm.append(server.warm_imported_s)
                cmdlines.append(process._cmdline(server.pid))
        assert warm[0] is None and warm[1] is not None and warm[1] > 0
        # the CPU build sizes its cache from memory it measures: two cold launches differ by a few
        # blocks too
        assert capacities[1] == pytest.approx(capacities[0], rel=0.01)
        # the spare took the server's command line: the orphan reaper's "--port N" is in it
        assert f"--port {server.port}" in cmdlines[1]
        text = Path(tmp_path / "1.log").read_text()
        assert "non-default args" in text and "KV cache size" in text
        waiting = spare._spare.proc
    finally:
        spare.discard()
        spare.enable(False)
    assert waiting.poll() is not None   # the spare prepared for a third launch is gone


def kv_too_small_params() -> ServerParams:
    """A max-model-len whose KV cache cannot fit, at a gmu that leaves ~0.35 GiB for KV cache.

    On the CPU build gmu is a fraction of the memory node's total, which moves on this (virtual,
    shared) box between 9 and 14 GiB, so gmu is derived from the total vLLM will see: ~0.75 GiB of
    runtime + ~0.35 GiB of KV cache. 262144 tokens of the tiny model need 1 GiB, so the launch fails
    by a wide margin either way and the estimated length (~90k) lies well inside (2048, 262144)."""
    from vllm.utils.cpu_resource_utils import get_memory_node_info
    total_gib = get_memory_node_info(0).total_memory / 2**30
    return ServerParams(gpu_memory_utilization=round(1.1 / total_gib, 3), max_model_len=262144, max_num_seqs=4)


LONG_LEN_ENV = (("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1"),)   # the tiny model's own limit is 32768


def test_max_model_len_that_does_not_fit_is_kv_cache_too_small(tmp_path):
    with ServerProcess(spec(tmp_path, kv_too_small_params(), LONG_LEN_ENV)) as server:
        server.start()
        outcome = server.wait_ready()
        pgid = server.pgid
    assert isinstance(outcome, LaunchFailure), outcome
    assert outcome.kind == "kv_cache_too_small", outcome.log_tail
    assert outcome.needed_gib > outcome.available_gib > 0
    assert 2048 < outcome.estimated_max_model_len < 262144
    assert group_members(pgid) == []
    print(f"\nverdict after {outcome.verdict_s:.1f} s: {outcome.kind}, "
          f"estimated max model len {outcome.estimated_max_model_len}")


def test_an_awq_model_with_dummy_weights_serves_on_the_cpu_build(tmp_path):
    """The layout of the seed's model (AWQ 4-bit, fp16; the qwen2.5-32b-awq preset) at the tiny
    shape: vLLM's dummy loader serves it (its 4-bit tensors are left uninitialised, the scales are
    random), and the memory model reads its weights as 4-bit."""
    from tuner.models.presets import PRESETS, TINY_CONFIG, write_model_folder
    from tuner.search.feasibility import model_shape

    quant = PRESETS["qwen2.5-32b-awq"]["quantization_config"]
    folder = write_model_folder({**TINY_CONFIG, "torch_dtype": "float16", "quantization_config": quant},
                                tmp_path / "tiny-awq")
    shape = model_shape(str(folder))
    plain = model_shape(str(TINY_MODEL))
    assert shape.quantization == "awq" and shape.weights_bytes < plain.weights_bytes
    params = ServerParams(gpu_memory_utilization=0.1, max_model_len=2048, max_num_seqs=4)
    launch = LaunchSpec(model=str(folder), params=params, extra_args=(*DUMMY, "--dtype", "float16"),
                        launch_timeout_s=600, log_path=str(tmp_path / "server.log"))
    with ServerProcess(launch) as server:
        server.start()
        outcome = server.wait_ready()
        assert isinstance(outcome, Capacity), getattr(outcome, "log_tail", outcome)
        answer = complete(server, str(folder), "w10 w11 w12", 8)
        pgid = server.pgid
    assert answer["usage"]["completion_tokens"] == 8
    text = Path(server.log_path).read_text()
    assert "'quantization': 'awq'" in text or "quantization=awq" in text, text[-3000:]
    assert group_members(pgid) == []
