"""Each preset's weights and KV bytes per token computed by hand from its config.json, against the
memory model (tuner/search/feasibility.py), with vLLM 0.32's rules as the reference:

- KV bytes per token = 2 (K and V) x layers x kv_heads x head_dim x 2 bytes (bf16/fp16), the
  page size of vllm/v1/kv_cache_interface.py::FullAttentionSpec divided by its block of 16 tokens.
- weights (bf16/fp16, no weight files) = parameters x 2 bytes, where per layer
  q = o = hidden x heads x head_dim, k = v = hidden x kv_heads x head_dim, MLP = 3 x hidden x
  intermediate, 2 norms of hidden; plus embeddings vocab x hidden, an lm_head as large unless
  tied, the final norm. Qwen2/2.5 add q/k/v biases, Qwen3 a q and k norm of head_dim each.
- AWQ (vllm/model_executor/layers/quantization/auto_awq.py, create_weights): per linear weight of
  in x out, qweight int32 [in, out/8] (0.5 byte a weight), qzeros int32 [in/128, out/8] (4 bits
  per group and column: 0.5/128 byte a weight), scales fp16 [in/128, out] (2/128 byte a weight);
  embeddings, lm_head (lm_head_quantized False), norms and biases stay fp16.
"""

from __future__ import annotations

import json

import pytest

from tuner.models.presets import PRESETS
from tuner.search.feasibility import GIB, MIB, MemoryModel, model_shape, weights_exceed_device
from tuner.search.space import ServerParams

H100_BYTES = 81559 * MIB    # NVML's total on an H100 80GB HBM3
H200_BYTES = 143771 * MIB   # and on an H200


def shape_of(config: dict, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return model_shape(str(tmp_path))


def dense_params(hidden, inter, layers, heads, kv_heads, head_dim, vocab, tied,
                 qkv_bias=False, qk_norm=False) -> int:
    attn = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    if qkv_bias:
        attn += heads * head_dim + 2 * kv_heads * head_dim
    if qk_norm:
        attn += 2 * head_dim
    per_layer = attn + 3 * hidden * inter + 2 * hidden
    return layers * per_layer + vocab * hidden * (1 if tied else 2) + hidden


# name: (params by hand, written out; the same from the formula; KV bytes per token by hand)
HAND = {
    # 32 x (2x4096x4096 + 2x4096x1024 + 3x4096x14336 + 2x4096) + 2x128256x4096 + 4096
    "llama-3.1-8b": (8_030_261_248, dense_params(4096, 14336, 32, 32, 8, 128, 128256, False),
                     2 * 32 * 8 * 128 * 2),                                # 131,072 = 128 KiB
    # tied: the embeddings once. 28 x (2x3072x3072 + 2x3072x1024 + 3x3072x8192 + 2x3072) + ...
    "llama-3.2-3b": (3_212_749_824, dense_params(3072, 8192, 28, 24, 8, 128, 128256, True),
                     2 * 28 * 8 * 128 * 2),                                # 114,688 = 112 KiB
    "llama-3.1-70b": (70_553_706_496, dense_params(8192, 28672, 80, 64, 8, 128, 128256, False),
                      2 * 80 * 8 * 128 * 2),                               # 327,680 = 320 KiB
    # q/k/v biases: 5120 + 2 x 1024 a layer
    "qwen2.5-32b": (32_763_876_352, dense_params(5120, 27648, 64, 40, 8, 128, 152064, False,
                                                 qkv_bias=True),
                    2 * 64 * 8 * 128 * 2),                                 # 262,144 = 256 KiB
    "qwen2.5-7b": (7_615_616_512, dense_params(3584, 18944, 28, 28, 4, 128, 152064, False,
                                               qkv_bias=True),
                   2 * 28 * 4 * 128 * 2),                                  # 57,344 = 56 KiB
    # head_dim 128 stated (4096 / 32 = 128 here too); q_norm and k_norm: 2 x 128 a layer
    "qwen3-8b": (8_190_735_360, dense_params(4096, 12288, 36, 32, 8, 128, 151936, False,
                                             qk_norm=True),
                 2 * 36 * 8 * 128 * 2),                                    # 147,456 = 144 KiB
    # the Llama 8B layers, a 32,768-token vocabulary; v0.3 has no sliding window
    "mistral-7b": (7_248_023_552, dense_params(4096, 14336, 32, 32, 8, 128, 32768, False),
                   2 * 32 * 8 * 128 * 2),                                  # 131,072 = 128 KiB
}


@pytest.mark.parametrize("name", sorted(HAND))
def test_each_bf16_preset_weighs_and_caches_what_its_shape_says(name, tmp_path):
    params, formula, kv_per_token = HAND[name]
    assert params == formula
    shape = shape_of(PRESETS[name], tmp_path)
    assert shape.param_count == params
    assert shape.weights_bytes == 2 * params               # bf16, no weight files
    assert shape.kv_bytes_per_token() == kv_per_token
    assert shape.sliding_window is None                    # every layer keeps every token
    # vLLM's pool on a GPU: blocks of 16 tokens of every layer
    for card in (H100_BYTES, H200_BYTES):
        mm = MemoryModel(shape, card, "cuda")
        r = mm.resolve(ServerParams(max_model_len=4096))
        assert mm.pool_block_bytes(r) == 16 * kv_per_token
        assert mm.request_kv_bytes(r) == 4096 * kv_per_token


def test_qwen3_counts_its_q_and_k_norms(tmp_path):
    """Qwen3's attention has an RMSNorm of head_dim on q and on k (36 x 2 x 128 = 9,216
    parameters): 8,190,735,360 in all, not 8,190,726,144."""
    shape = shape_of(PRESETS["qwen3-8b"], tmp_path)
    assert shape.param_count - dense_params(4096, 12288, 36, 32, 8, 128, 151936, False) == 36 * 2 * 128
    assert shape.param_count == 8_190_735_360


# Qwen2.5-32B-Instruct-AWQ by hand (64 layers, hidden 5120, 40 heads, 8 KV heads, head_dim 128,
# intermediate 27648, vocab 152064, untied, fp16, 4 bits in groups of 128):
AWQ_LINEAR = 64 * (2 * 5120 * 5120 + 2 * 5120 * 1024 + 3 * 5120 * 27648)   # 31,205,621,760
AWQ_QWEIGHT = AWQ_LINEAR // 2                     # 15,602,810,880: 4 bits a weight
AWQ_QZEROS = AWQ_LINEAR // 128 // 8 * 4           # 121,896,960: 4 bits a group and column
AWQ_SCALES = AWQ_LINEAR // 128 * 2                # 487,587,840: fp16 a group and column
AWQ_FP16 = 2 * (64 * (5120 + 2 * 1024)            # q/k/v biases
                + 64 * 2 * 5120 + 5120            # norms, the final norm
                + 2 * 152064 * 5120)              # embeddings and lm_head: 3,118,509,184 bytes
AWQ_BYTES = AWQ_QWEIGHT + AWQ_QZEROS + AWQ_SCALES + AWQ_FP16   # 19,328,804,864 = 18.00 GiB


def test_the_awq_preset_weighs_its_packed_weights_group_scales_and_zero_points(tmp_path):
    """The 4-bit weights alone (what the model counted) miss 0.57 GiB of scales and zero points
    (1/64 + 1/256 of a byte a weight): 17.43 GiB, where the checkpoint holds 18.00 GiB."""
    assert AWQ_LINEAR == 31_205_621_760 and AWQ_BYTES == 19_328_804_864
    shape = shape_of(PRESETS["qwen2.5-32b-awq"], tmp_path)
    assert shape.quantization == "awq" and shape.dtype_bytes == 2
    assert shape.weights_bytes == AWQ_BYTES
    assert shape.kv_bytes_per_token() == 2 * 64 * 8 * 128 * 2   # the KV cache stays fp16


def test_the_awq_prior_matches_what_vllm_loaded_with_7_gib_offloaded(tmp_path):
    """studies/h200-16gb-32b-awq.db, trials 2, 7-10 (vLLM on an H200, --cpu-offload-gb 7): "Model
    loading took 11.26 GiB", so ~18.26 GiB in all. The prior put 10.43 GiB on the device
    (0.83 GiB short: that much KV budget predicted that was not there); with the scales and
    zero points, 11.00 GiB."""
    shape = shape_of(PRESETS["qwen2.5-32b-awq"], tmp_path)
    mm = MemoryModel(shape, H200_BYTES, "cuda")
    r = mm.resolve(ServerParams(cpu_offload_gb=7, max_model_len=4096, max_num_seqs=2))
    assert abs(mm.device_weights_bytes(r) - 11.26 * GIB) < 0.3 * GIB


def test_the_awq_preset_on_a_16_gb_card_says_18_gib_of_weights(tmp_path):
    """A 16 GB budget (15.77 GiB, the seed's) without offload: the weights alone are over it by
    more than the 10 % tolerance, and the line names the hand figure."""
    shape = shape_of(PRESETS["qwen2.5-32b-awq"], tmp_path)
    mm = MemoryModel(shape, int(15.77 * GIB), "cuda")
    assert "~18.0 GiB" in weights_exceed_device(mm)


def test_a_gptq_checkpoint_counts_its_scales_and_zero_points(tmp_path):
    """Llama 3.1 8B in GPTQ 4-bit, groups of 128, symmetric (vLLM's auto_gptq still allocates and
    loads qzeros): linear 32 x (2x4096x4096 + 2x4096x1024 + 3x4096x14336) = 6,979,321,856 weights
    at 0.5 + 0.5/128 + 2/128 bytes = 3,489,660,928 + 27,262,976 + 109,051,904; the other
    8,030,261,248 - 6,979,321,856 = 1,050,939,392 parameters (embeddings, lm_head, norms) in bf16,
    2,101,878,784 bytes: 5,727,854,592 in all (5.33 GiB)."""
    linear = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
    assert linear == 6_979_321_856
    hand = linear // 2 + linear // 128 // 2 + linear // 128 * 2 + (8_030_261_248 - linear) * 2
    assert hand == 5_727_854_592
    config = dict(PRESETS["llama-3.1-8b"], quantization_config={
        "quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False})
    assert shape_of(config, tmp_path).weights_bytes == hand
