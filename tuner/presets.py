"""Model folders without weights: the embedded tiny default and model-shape presets (served with --load-format dummy)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tuner.errors import TunerError

PACKAGE_MODELS = Path(__file__).parent / "models"
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

# The checkpoint each preset stands for (its config.json matches these published ones): what an
# exported command serves once the dummy weights are dropped. The tiny preset stands for none.
HF_IDS: dict[str, str] = {
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B-Instruct",
    "llama-3.2-3b": "meta-llama/Llama-3.2-3B-Instruct",
    "llama-3.1-70b": "meta-llama/Llama-3.1-70B-Instruct",
    "qwen2.5-32b": "Qwen/Qwen2.5-32B-Instruct",
}

# The embedded default: small enough to start fast on 2 CPU cores, with a KV cache large enough per
# token (4 layers x 4 KV heads x 64 x 2 bytes x 2 = 4 KiB) that the memory flags bite.
TINY_CONFIG = _llama(256, 512, 4, 4, 4, 4096, 32768, 1, 2, None)


def build_tokenizer_files(config: dict, folder: Path) -> None:
    """Write an offline-built word-level tokenizer whose vocabulary equals the config's vocab_size.

    Token i is the word `w{i}`, except the BOS/EOS/UNK ids and a few chat-template words, so a
    prompt of N distinct words is exactly N tokens and every sampled id decodes to text.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab_size = int(config["vocab_size"])
    bos, eos = int(config["bos_token_id"]), int(config["eos_token_id"])
    unk = 0 if 0 not in (bos, eos) else 3
    special = {bos: "<s>", eos: "</s>", unk: "<unk>"}
    words = ["user", "assistant", "system", ":"]
    vocab: dict[str, int] = {}
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
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
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
    marker = folder / "config.json"
    if not marker.exists() or json.loads(marker.read_text()) != config:
        tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
        write_model_folder(config, tmp)
        if folder.exists():
            import shutil
            shutil.rmtree(folder)
        tmp.rename(folder)
    return folder


if __name__ == "__main__":  # regenerate the embedded tiny model folder
    write_model_folder(TINY_CONFIG, TINY_MODEL)
    print(TINY_MODEL)
