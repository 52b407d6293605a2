"""Model folders without weights: the embedded tiny default and model-shape presets (served with --load-format dummy)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tuner.errors import TunerError

PACKAGE_MODELS = Path(__file__).parent   # the embedded models sit beside this module
TINY_MODEL = PACKAGE_MODELS / "tiny-llama"

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }} : {{ message['content'] }} \n{% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)

_LLAMA31_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192, "rope_type": "llama3"}


def _llama(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int,
           max_pos: int, bos: int, eos: int, rope_scaling: dict | None, rope_theta: float = 500000.0,
           tie: bool = False) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": hidden // heads,
        "vocab_size": vocab, "max_position_embeddings": max_pos, "rms_norm_eps": 1e-5,
        "rope_theta": rope_theta, "rope_scaling": rope_scaling, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": tie,
        "bos_token_id": bos, "eos_token_id": eos, "torch_dtype": "bfloat16",
        "initializer_range": 0.02, "use_cache": True,
    }


# Values copied from the published config.json of each model (only the shape matters for dummy weights).
PRESETS: dict[str, dict] = {
    "llama-3.1-8b": _llama(4096, 14336, 32, 32, 8, 128256, 131072, 128000, 128009, _LLAMA31_ROPE),
    "llama-3.2-3b": _llama(3072, 8192, 28, 24, 8, 128256, 131072, 128000, 128009,
                           {**_LLAMA31_ROPE, "factor": 32.0}, tie=True),
    "llama-3.1-70b": _llama(8192, 28672, 80, 64, 8, 128256, 131072, 128000, 128009, _LLAMA31_ROPE),
    "qwen2.5-32b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
        "hidden_size": 5120, "intermediate_size": 27648, "num_hidden_layers": 64,
        "num_attention_heads": 40, "num_key_value_heads": 8, "vocab_size": 152064,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "hidden_act": "silu", "sliding_window": 131072, "use_sliding_window": False,
        "max_window_layers": 64, "tie_word_embeddings": False, "bos_token_id": 151643,
        "eos_token_id": 151645, "torch_dtype": "bfloat16", "attention_dropout": 0.0,
        "initializer_range": 0.02, "use_cache": True,
    },
}
PRESETS["qwen2.5-7b"] = {
    **PRESETS["qwen2.5-32b"], "hidden_size": 3584, "intermediate_size": 18944,
    "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
    "max_window_layers": 28,
}
# Qwen3: no QKV bias, a norm on q and k, head_dim 128 stated (not hidden / heads for every size)
PRESETS["qwen3-8b"] = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
    "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "rope_scaling": None, "hidden_act": "silu", "attention_bias": False, "sliding_window": None,
    "use_sliding_window": False, "max_window_layers": 36, "tie_word_embeddings": False,
    "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16",
    "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
}
# Mistral-7B-Instruct-v0.3: the Llama layout, no sliding window, a 32,768-token vocabulary
PRESETS["mistral-7b"] = {
    **_llama(4096, 14336, 32, 32, 8, 32768, 32768, 1, 2, None, rope_theta=1000000.0),
    "architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": None,
}
# Qwen2.5-32B-Instruct-AWQ's published config: the 32B shape in fp16 with 4-bit weights in groups of
# 128, each group with an fp16 scale and a 4-bit zero point per column. Embeddings and lm_head stay
# fp16, so the weights are 18.0 GiB: on a 16 GB card no config starts without --cpu-offload-gb.
# vLLM's AWQ needs compute capability 7.5 (auto_awq.py get_min_capability): a V100 (7.0) refuses
# it at every launch, so the 16 GB card this stands for is a Turing or later one (a T4, an A4000).
PRESETS["qwen2.5-32b-awq"] = {
    **PRESETS["qwen2.5-32b"], "torch_dtype": "float16",
    "quantization_config": {"bits": 4, "group_size": 128, "modules_to_not_convert": None,
                            "quant_method": "awq", "version": "gemm", "zero_point": True},
}

# The checkpoint each preset stands for (its config.json matches these published ones): what an
# exported command serves once the dummy weights are dropped. The tiny preset stands for none.
HF_IDS: dict[str, str] = {
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B-Instruct",
    "llama-3.2-3b": "meta-llama/Llama-3.2-3B-Instruct",
    "llama-3.1-70b": "meta-llama/Llama-3.1-70B-Instruct",
    "qwen2.5-32b": "Qwen/Qwen2.5-32B-Instruct",
    "qwen2.5-32b-awq": "Qwen/Qwen2.5-32B-Instruct-AWQ",
    "qwen2.5-7b": "Qwen/Qwen2.5-7B-Instruct",
    "qwen3-8b": "Qwen/Qwen3-8B",
    "mistral-7b": "mistralai/Mistral-7B-Instruct-v0.3",
}

# The embedded default: small enough to start fast on 2 CPU cores, with a KV cache large enough per
# token (4 layers x 4 KV heads x 64 x 2 bytes x 2 = 4 KiB) that the memory flags bite.
TINY_CONFIG = _llama(256, 512, 4, 4, 4, 4096, 32768, 1, 2, None)


# transformers 5 ignores tokenizer_config.json's class for these model types and rebuilds the
# tokenizer as the family's byte-level BPE from tokenizer.json's vocab and merges (Qwen2Tokenizer
# for qwen2). A word-level vocabulary rebuilt that way encodes every prompt to no tokens at all
# (vLLM: "The decoder prompt cannot be empty"), so these get a byte-level BPE built exactly as that
# class builds one: whichever class loads it, it is the same tokenizer.
BYTE_LEVEL_MODEL_TYPES = frozenset({"qwen2", "qwen3"})
QWEN2_PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
                           r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
# Bump when the files written for a preset change, so cached preset folders are rebuilt.
TOKENIZER_SCHEME = 2


def _byte_alphabet() -> list[str]:
    """GPT-2's byte-to-character map in byte order: the 256 base tokens of a byte-level BPE."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def build_tokenizer_files(config: dict, folder: Path) -> None:
    """Write an offline-built tokenizer whose vocabulary equals the config's vocab_size.

    Word-level (most model types): token i is the word `w{i}`, except the BOS/EOS/UNK ids and a
    few chat-template words, so a prompt of N distinct words is exactly N tokens and every sampled
    id decodes to text. Byte-level (BYTE_LEVEL_MODEL_TYPES): ids 0-255 are the 256 bytes and
    there are no merges, so any text of N bytes is N tokens; the other ids are `w{i}` strings that
    decode to text (and re-encode to their bytes).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    vocab_size = int(config["vocab_size"])
    bos, eos = int(config["bos_token_id"]), int(config["eos_token_id"])
    byte_level = config.get("model_type") in BYTE_LEVEL_MODEL_TYPES
    names = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    if byte_level:
        base = _byte_alphabet()
        if min(bos, eos) < len(base) or vocab_size <= len(base) + 2:
            raise ValueError(f"byte-level preset needs BOS/EOS ids above 255 and a larger vocabulary: {config}")
        special = {bos: "<s>", eos: "</s>"}
        vocab = {}
        for i in range(vocab_size):
            vocab[special.get(i) or (base[i] if i < len(base) else f"w{i}")] = i
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[], dropout=None, unk_token=None,
                                   continuing_subword_prefix="", end_of_word_suffix="",
                                   fuse_unk=False, byte_fallback=False))
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens(["<s>", "</s>"])
        # no unknown token (every byte is a token); pad is EOS, as Qwen's own pad is a vocab token
        names = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": None, "pad_token": "</s>"}
    else:
        unk = 0 if 0 not in (bos, eos) else 3
        special = {bos: "<s>", eos: "</s>", unk: "<unk>"}
        words = ["user", "assistant", "system", ":"]
        vocab = {}
        next_word = iter(words)
        for i in range(vocab_size):
            if i in special:
                vocab[special[i]] = i
            else:
                vocab[next(next_word, f"w{i}")] = i
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.add_special_tokens(["<s>", "</s>", "<unk>"])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", **names,
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": int(config["max_position_embeddings"]),
        "chat_template": CHAT_TEMPLATE,
    }, indent=2) + "\n")


def write_model_folder(config: dict, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    build_tokenizer_files(config, folder)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}) + "\n")
    return folder


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tuner" / "presets"


def preset_folder(name: str) -> Path:
    """The model folder of `preset:NAME`, written once into the user's cache."""
    if name == "tiny":
        return TINY_MODEL
    if name not in PRESETS:
        raise TunerError(f"unknown model preset {name!r}: choose one of "
                         + ", ".join(["tiny", *sorted(PRESETS)]))
    folder = cache_dir() / name
    config = PRESETS[name]
    marker = folder / "tuner-preset.json"    # what wrote the folder: a stale tokenizer is rebuilt too
    wanted = {"config": config, "tokenizer_scheme": TOKENIZER_SCHEME}
    try:
        current = json.loads(marker.read_text())
    except (OSError, ValueError):
        current = None
    if current != wanted:
        tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
        write_model_folder(config, tmp)
        (tmp / "tuner-preset.json").write_text(json.dumps(wanted) + "\n")
        if folder.exists():
            import shutil
            shutil.rmtree(folder)
        tmp.rename(folder)
    return folder


if __name__ == "__main__":  # regenerate the embedded tiny model folder
    write_model_folder(TINY_CONFIG, TINY_MODEL)
    print(TINY_MODEL)
