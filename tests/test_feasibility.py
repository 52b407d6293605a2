"""The memory model against numbers vLLM logged (CPU build 0.32 here, GPU 0.24 on an H200)."""

from __future__ import annotations

import json

import pytest

from tuner.search.feasibility import (GIB, MIB, PCIE_FALLBACK_GBPS, MemoryModel, ModelShape,
                               device_memory_bytes, model_shape, roofline_shortfall, roofline_tok_s)
from tuner.run.process import Capacity, LaunchFailure
from tuner.models.presets import PRESETS, TINY_MODEL, write_model_folder
from tuner.search.space import ServerParams

H200_BYTES = 143771 * MIB   # NVML's total on an H200

# Real CPU-build log lines of the tiny model (gmu 0.1, max-model-len 2048, max-num-seqs 4).
CPU_READY_LOG = """\
(Worker pid=5506) INFO [cpu_worker.py:260] Auto set (0.23/10.21) GiB for KV cache on node 0, with 1.01 GiB requested memory for the worker. 0.78 GiB memory was consumed by non-kv usages.
(EngineCore pid=5422) INFO [kv_cache_utils.py:2327] CPU KV cache size: 59,264 tokens, Maximum concurrency for 2,048 tokens per request: 28.94x
"""
CPU_TOTAL = int(10.21 * GIB)
# What tuner.run.process.parse_capacity reads from those lines (built here so this file does not
# depend on the launcher's parsing).
CPU_READY = Capacity(kv_cache_gib=0.23, kv_cache_tokens=59264, max_concurrency=28.94)


@pytest.fixture(scope="module")
def tiny() -> ModelShape:
    return model_shape(str(TINY_MODEL))


@pytest.fixture(scope="module")
def llama8b(tmp_path_factory) -> ModelShape:
    return model_shape(str(write_model_folder(PRESETS["llama-3.1-8b"], tmp_path_factory.mktemp("8b"))))


def test_kv_bytes_per_token_is_two_layers_heads_dim_bytes(tiny, llama8b):
    assert tiny.kv_bytes_per_token() == 2 * 4 * 4 * 64 * 2 == 4096
    assert llama8b.kv_bytes_per_token() == 2 * 32 * 8 * 128 * 2
    assert llama8b.kv_bytes_per_token(kv_dtype_bytes=1) == llama8b.kv_bytes_per_token() / 2


@pytest.mark.parametrize("name, published", [("llama-3.1-8b", 8.03e9), ("qwen2.5-32b", 32.76e9),
                                              ("llama-3.1-70b", 70.55e9)])
def test_param_count_of_presets_matches_published(tmp_path, name, published):
    shape = model_shape(str(write_model_folder(PRESETS[name], tmp_path)))
    assert shape.param_count == pytest.approx(published, rel=0.01)
    assert shape.weights_bytes == shape.param_count * 2 and not shape.weights_from_files


def test_weights_come_from_safetensors_sizes_when_present(tmp_path):
    folder = write_model_folder(PRESETS["llama-3.1-8b"], tmp_path)
    (folder / "model-00001.safetensors").write_bytes(b"\0" * 1000)
    (folder / "model-00002.safetensors").write_bytes(b"\0" * 500)
    shape = model_shape(str(folder))
    assert shape.weights_bytes == 1500 and shape.weights_from_files


def test_quantized_config_shrinks_weights(tmp_path):
    config = dict(PRESETS["llama-3.1-8b"], quantization_config={"quant_method": "fp8"})
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = model_shape(str(tmp_path))
    assert shape.quantization == "fp8"
    assert 8.0 * GIB < shape.weights_bytes < 9.0 * GIB


def test_missing_config_is_a_tuner_error(tmp_path):
    from tuner.errors import TunerError
    with pytest.raises(TunerError, match="config.json"):
        model_shape(str(tmp_path))


def test_vllm_defaults_fill_none_fields(tiny, llama8b):
    cpu = MemoryModel(tiny, CPU_TOTAL, "cpu").resolve(ServerParams())
    assert (cpu.gpu_memory_utilization, cpu.max_model_len, cpu.max_num_seqs,
            cpu.max_num_batched_tokens) == (0.9, 32768, 128, 2048)
    gpu = MemoryModel(llama8b, H200_BYTES, "cuda").resolve(ServerParams(max_model_len=4096))
    assert (gpu.max_num_seqs, gpu.max_num_batched_tokens, gpu.enforce_eager) == (1024, 8192, False)
    small = MemoryModel(llama8b, 24 * GIB, "cuda").resolve(ServerParams(max_num_seqs=8, max_model_len=128))
    assert (small.max_num_seqs, small.max_num_batched_tokens) == (8, 1024)


def test_uncalibrated_gpu_prior_is_near_the_logged_failure(llama8b):
    # vLLM 0.24, H200: gmu 0.13, max-model-len 131072 -> "16.0 GiB KV cache is needed ... available
    # KV cache memory (2.07 GiB) ... the estimated maximum model length is 16944".
    model = MemoryModel(llama8b, H200_BYTES, "cuda")
    p = model.predict(ServerParams(gpu_memory_utilization=0.13, max_model_len=131072))
    assert not p.fits and p.uncertain and "uncalibrated" in p.reason
    assert p.needed_gib == pytest.approx(16.0)
    assert p.max_model_len_fit == pytest.approx(16944, rel=0.15)


def test_a_failure_calibrates_the_overhead_exactly(llama8b):
    model = MemoryModel(llama8b, H200_BYTES, "cuda")
    failed = ServerParams(gpu_memory_utilization=0.13, max_model_len=131072)
    model.observe_failure(failed, LaunchFailure(kind="kv_cache_too_small", message="", needed_gib=16.0,
                                                available_gib=2.07, estimated_max_model_len=16944))
    again = model.predict(failed)
    assert again.max_model_len_fit == 16944
    assert again.available_gib == pytest.approx(2.07, abs=0.005)
    assert not again.fits and not again.uncertain
    just_under = model.predict(ServerParams(gpu_memory_utilization=0.13, max_model_len=16384))
    assert just_under.fits
    roomy = model.predict(ServerParams(gpu_memory_utilization=0.3, max_model_len=32768))
    assert roomy.fits and not roomy.uncertain


def test_a_ready_launch_calibrates_kv_tokens_on_cpu(tiny):
    capacity = CPU_READY
    params = ServerParams(gpu_memory_utilization=0.1, max_model_len=2048, max_num_seqs=4)
    model = MemoryModel(tiny, CPU_TOTAL, "cpu")
    model.observe_ready(params, capacity)
    p = model.predict(params)
    assert p.kv_cache_tokens == 59264
    assert p.max_concurrency == pytest.approx(28.94, abs=0.01)
    # "0.78 GiB ... non-kv usages" against "1.01 GiB requested": the node's MemTotal drifted from
    # 10.1 to 10.21 GiB between the worker's start and its KV sizing, hence the wider tolerance.
    assert p.overhead_gib == pytest.approx(0.78, abs=0.02)
    # The same overhead at another gmu: 0.08 x 10.21 - 0.795 = 0.022 GiB, about 5.8k tokens.
    lower = model.predict(ServerParams(gpu_memory_utilization=0.08, max_model_len=2048, max_num_seqs=4))
    assert lower.kv_cache_tokens == pytest.approx((0.08 * CPU_TOTAL - p.overhead_gib * GIB) / 4096, abs=128)
    too_long = model.predict(ServerParams(gpu_memory_utilization=0.08, max_model_len=32768, max_num_seqs=4))
    assert not too_long.fits and not too_long.uncertain


def test_cpu_gmu_under_the_worker_rss_is_learned_from_its_failure(tiny):
    # "less than requested memory for kv (-0.10/0.71 GiB)": requested 0.71, non-KV use 0.81.
    params = ServerParams(gpu_memory_utilization=0.07, max_model_len=2048)
    model = MemoryModel(tiny, CPU_TOTAL, "cpu")
    model.observe_failure(params, LaunchFailure(kind="no_cache_blocks", message="", needed_gib=-0.10,
                                                available_gib=6.0))
    p = model.predict(params)
    assert not p.fits and p.kv_budget_gib == pytest.approx(-0.10, abs=0.01)
    assert p.overhead_gib == pytest.approx(0.07 * 10.21 + 0.10, abs=0.01)


def test_a_miss_widens_the_margin(tiny):
    model = MemoryModel(tiny, CPU_TOTAL, "cpu")
    model.observe_ready(ServerParams(gpu_memory_utilization=0.1, max_model_len=2048, max_num_seqs=4),
                        CPU_READY)
    before = model.margin
    surprise = ServerParams(gpu_memory_utilization=0.3, max_model_len=4096, max_num_seqs=4)
    assert model.predict(surprise).fits and not model.predict(surprise).uncertain
    obs = model.observe_failure(surprise, LaunchFailure(kind="kv_cache_too_small", message="",
                                                        available_gib=0.01, estimated_max_model_len=2048))
    assert obs.miss and model.misses == 1 and model.margin > before


def test_machine_failures_teach_nothing(tiny):
    model = MemoryModel(tiny, CPU_TOTAL, "cpu")
    params = ServerParams(gpu_memory_utilization=0.5)
    before = model.predict(params)
    model.observe_failure(params, LaunchFailure(kind="startup_timeout", message=""))
    model.observe_failure(params, LaunchFailure(kind="insufficient_free_memory", message="",
                                                needed_gib=5.0, available_gib=3.0))
    assert model.predict(params) == before and not model.calibrated and model.misses == 0


def test_replaying_observations_rebuilds_the_same_model(tiny):
    events = [(ServerParams(gpu_memory_utilization=0.1, max_model_len=2048, max_num_seqs=4),
               CPU_READY),
              (ServerParams(gpu_memory_utilization=0.08, max_model_len=32768),
               LaunchFailure(kind="kv_cache_too_small", message="", estimated_max_model_len=9600))]

    def build() -> MemoryModel:
        model = MemoryModel(tiny, CPU_TOTAL, "cpu")
        for params, outcome in events:
            if isinstance(outcome, Capacity):
                model.observe_ready(params, outcome)
            else:
                model.observe_failure(params, outcome)
        return model

    probe = ServerParams(gpu_memory_utilization=0.09, max_model_len=8192)
    assert build().predict(probe) == build().predict(probe)


def test_oom_marks_higher_gmu_infeasible(llama8b):
    model = MemoryModel(llama8b, H200_BYTES, "cuda")
    model.observe_failure(ServerParams(gpu_memory_utilization=0.2, max_model_len=8192),
                          LaunchFailure(kind="kv_cache_too_small", message="", estimated_max_model_len=4000))
    model.observe_failure(ServerParams(gpu_memory_utilization=0.98, max_model_len=8192),
                          LaunchFailure(kind="oom", message="CUDA out of memory"))
    assert not model.predict(ServerParams(gpu_memory_utilization=0.99, max_model_len=8192)).fits
    assert model.predict(ServerParams(gpu_memory_utilization=0.9, max_model_len=8192)).fits


def test_roofline_of_8b_on_h200(llama8b):
    # The issue: 4800 GB/s over 16 GB of bf16 weights is about 298 tok/s.
    assert roofline_tok_s(4800, llama8b, context_tokens=512) == pytest.approx(298, rel=0.01)
    assert roofline_tok_s(4800, llama8b, 100_000) < roofline_tok_s(4800, llama8b, 100)
    assert roofline_tok_s(4800, llama8b, 100_000, kv_dtype_bytes=1) > roofline_tok_s(4800, llama8b, 100_000)


def test_offloaded_weights_cross_pcie_and_the_roofline_is_the_slower_link(llama8b):
    resident = roofline_tok_s(4800, llama8b, 512)
    # 4 GiB over a 63 GB/s PCIe 5.0 x16 link: at most 14.7 tok/s, however fast the HBM is
    offloaded = roofline_tok_s(4800, llama8b, 512, offload_bytes=4 * GIB, pcie_gbps=63.0)
    assert offloaded == pytest.approx(63e9 / (4 * GIB), rel=1e-6)
    assert offloaded < resident / 10
    # the device term alone is faster with fewer weights on the device: never the binding one here
    device_only = 4800e9 / (llama8b.weights_bytes - 4 * GIB + 512 * llama8b.kv_bytes_per_token())
    assert device_only > resident
    # an unknown link is taken as the slow fallback; offloading more than the weights is the weights
    assert roofline_tok_s(4800, llama8b, 512, offload_bytes=GIB) == pytest.approx(
        PCIE_FALLBACK_GBPS * 1e9 / GIB)
    assert roofline_tok_s(4800, llama8b, 512, offload_bytes=10**12, pcie_gbps=63.0) == pytest.approx(
        63e9 / llama8b.weights_bytes)


def test_roofline_shortfall_is_wanted_over_measured_share_minus_one():
    assert roofline_shortfall(3.0, 300.0, 0.05) == pytest.approx(0.05 / 0.01 - 1)   # 4.0
    assert roofline_shortfall(39.0, 298.0, 0.05) == 0.0      # --enforce-eager: slow but resident
    assert roofline_shortfall(3.0, 300.0, 0.0) == 0.0        # the check off
    assert roofline_shortfall(None, 300.0, 0.05) == 0.0
    assert roofline_shortfall(3.0, None, 0.05) == 0.0
    assert roofline_shortfall(0.0, 300.0, 0.05) > 100


def test_offloaded_weights_leave_their_device_memory_to_the_kv_cache(llama8b):
    model = MemoryModel(llama8b, H200_BYTES, "cuda")
    base = ServerParams(gpu_memory_utilization=0.12, max_model_len=8192)
    offload = ServerParams(gpu_memory_utilization=0.12, max_model_len=8192, cpu_offload_gb=6.0)
    r = model.resolve(offload)
    assert r.cpu_offload_bytes == 6 * GIB
    assert model.device_weights_bytes(r) == llama8b.weights_bytes - 6 * GIB
    assert model.predict(offload).kv_budget_gib == pytest.approx(model.predict(base).kv_budget_gib + 6)
    # 0.12 of an H200 (16.8 GiB) barely holds the 15 GiB of weights; 6 GiB offloaded makes room
    assert not model.predict(ServerParams(gpu_memory_utilization=0.1, max_model_len=8192)).fits
    assert model.predict(ServerParams(gpu_memory_utilization=0.1, max_model_len=8192,
                                      cpu_offload_gb=6.0)).fits
    # no more than the weights leave; on the CPU build the host is the device, nothing leaves
    assert model.resolve(ServerParams(cpu_offload_gb=1000.0)).cpu_offload_bytes == llama8b.weights_bytes
    assert MemoryModel(llama8b, H200_BYTES, "cpu").resolve(offload).cpu_offload_bytes == 0


def test_a_kv_failure_does_not_rule_out_a_config_that_offloads_more(llama8b):
    model = MemoryModel(llama8b, H200_BYTES, "cuda")
    model.observe_ready(ServerParams(gpu_memory_utilization=0.5, max_model_len=8192),
                        Capacity(kv_cache_gib=50.0))
    model.observe_failure(ServerParams(gpu_memory_utilization=0.13, max_model_len=65536),
                          LaunchFailure(kind="kv_cache_too_small", message="", estimated_max_model_len=3000))
    assert not model.predict(ServerParams(gpu_memory_utilization=0.13, max_model_len=65536)).fits
    more = model.predict(ServerParams(gpu_memory_utilization=0.13, max_model_len=65536,
                                      cpu_offload_gb=10.0))
    assert more.fits   # 10 GiB of weights gone from the device hold 80k tokens of KV


def test_device_memory_on_cpu_is_positive():
    assert device_memory_bytes("cpu") > GIB


def test_a_kv_failure_makes_the_same_length_certain_at_the_same_share(tiny):
    # Recorded grid, node 15.34 GiB: ready at 0.12, then gmu 0.05 x 32768 tokens failed with
    # "estimated maximum model length is 18304". The prior puts 0.05 x 32768 inside the margin
    # (0.125 GiB needed, ~0.07 available); after that failure the same share cannot hold 32768
    # tokens whatever max-num-seqs is, so the next ones are not launched.
    total = int(15.34 * GIB)
    model = MemoryModel(tiny, total, "cpu")
    model.observe_ready(ServerParams(gpu_memory_utilization=0.12, max_model_len=32768, max_num_seqs=16),
                        Capacity(kv_cache_gib=1.14, kv_cache_tokens=299392, max_concurrency=9.14))
    other = ServerParams(gpu_memory_utilization=0.05, max_model_len=32768, max_num_seqs=1)
    assert model.predict(other).uncertain
    model.observe_failure(ServerParams(gpu_memory_utilization=0.05, max_model_len=32768, max_num_seqs=16),
                          LaunchFailure(kind="kv_cache_too_small", message="",
                                        estimated_max_model_len=17792))
    p = model.predict(other)
    assert not p.fits and not p.uncertain
    # a larger share is not ruled out by it, nor a length the failed budget held
    assert model.predict(ServerParams(gpu_memory_utilization=0.08, max_model_len=32768,
                                      max_num_seqs=1)).fits
    assert model.predict(ServerParams(gpu_memory_utilization=0.05, max_model_len=8192,
                                      max_num_seqs=1)).fits
