"""A GGUF with random weights for a weightless Llama model folder, with its word-level tokenizer, written once into a cache."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

# Bumped when what is written changes, so an old cached file is not reused.
_FORMAT = 1


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tuner" / "gguf"


def gguf_for(model_dir: str | os.PathLike) -> Path:
    """The GGUF of `model_dir` (a folder with config.json and a word-level tokenizer.json), written
    on first use; the path of the cached file. The weights are random (seeded): this is for
    measuring a server, like vLLM's `--load-format dummy`."""
    folder = Path(model_dir)
    config_text = (folder / "config.json").read_text()
    tokenizer_text = (folder / "tokenizer.json").read_text()
    digest = hashlib.sha256(f"{_FORMAT}\0{config_text}\0{tokenizer_text}".encode()).hexdigest()[:16]
    path = cache_dir() / f"{folder.name}-{digest}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_suffix(f".{os.getpid()}.part")
        _write(part, json.loads(config_text), json.loads(tokenizer_text), folder.name)
        os.replace(part, path)   # atomic: a concurrent writer or a killed one leaves no half file
    return path


def _vocab(tokenizer: dict, vocab_size: int) -> tuple[list[str], list[int]]:
    """The tokens in id order as llama.cpp's WordPiece ("bert") tokenizer holds them, and their types.

    The embedded tokenizer is word-level over whitespace; llama.cpp has no word-level tokenizer,
    but its WordPiece one splits on whitespace and punctuation and matches each word, spelled
    "▁word", whole: so every word of the vocabulary is one token, as it is to vLLM.
    """
    import gguf

    model = tokenizer["model"]
    if model.get("type") != "WordLevel":
        raise ValueError(f"only word-level tokenizers are converted, not {model.get('type')!r}")
    special = {t["id"]: t["content"] for t in tokenizer.get("added_tokens", ()) if t.get("special")}
    by_id = {i: w for w, i in model["vocab"].items()}
    tokens, types = [], []
    for i in range(vocab_size):
        if i in special:
            tokens.append(special[i])
            types.append(gguf.TokenType.CONTROL)
        elif i in by_id:
            tokens.append("\u2581" + by_id[i])
            types.append(gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[unused{i}]")
            types.append(gguf.TokenType.UNUSED)
    return tokens, types


def _write(path: Path, config: dict, tokenizer: dict, name: str) -> None:
    import gguf
    import numpy as np

    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim", hidden // heads)
    ffn, vocab = config["intermediate_size"], config["vocab_size"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(name)
    writer.add_context_length(config.get("max_position_embeddings", 4096))
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(config.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-5)))
    writer.add_vocab_size(vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    tokens, types = _vocab(tokenizer, vocab)
    writer.add_tokenizer_model("bert")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores([0.0] * vocab)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(config.get("bos_token_id", 1))
    writer.add_eos_token_id(config.get("eos_token_id", 2))
    writer.add_sep_token_id(config.get("eos_token_id", 2))
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(False)   # as the HF tokenizer: no post-processor adds specials
    writer.add_add_eos_token(False)
    writer.add_add_sep_token(False)
    rng = np.random.default_rng(0)

    def weight(*shape: int) -> "np.ndarray":
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)

    ones = lambda n: np.ones(n, dtype=np.float32)  # noqa: E731
    writer.add_tensor("token_embd.weight", weight(vocab, hidden))
    for i in range(layers):
        b = f"blk.{i}."
        writer.add_tensor(b + "attn_norm.weight", ones(hidden))
        writer.add_tensor(b + "attn_q.weight", weight(heads * head_dim, hidden))
        writer.add_tensor(b + "attn_k.weight", weight(kv_heads * head_dim, hidden))
        writer.add_tensor(b + "attn_v.weight", weight(kv_heads * head_dim, hidden))
        writer.add_tensor(b + "attn_output.weight", weight(hidden, heads * head_dim))
        writer.add_tensor(b + "ffn_norm.weight", ones(hidden))
        writer.add_tensor(b + "ffn_gate.weight", weight(ffn, hidden))
        writer.add_tensor(b + "ffn_up.weight", weight(ffn, hidden))
        writer.add_tensor(b + "ffn_down.weight", weight(hidden, ffn))
    writer.add_tensor("output_norm.weight", ones(hidden))
    writer.add_tensor("output.weight", weight(vocab, hidden))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
