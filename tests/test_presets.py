"""Weightless model folders: the embedded tiny model and the shape presets."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer

from tuner.models import presets
from tuner.errors import TunerError


@pytest.mark.parametrize("name", ["tiny", *sorted(presets.PRESETS)])
def test_tokenizer_vocabulary_equals_vocab_size_and_round_trips(name, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    folder = presets.preset_folder(name)
    config = json.loads((folder / "config.json").read_text())
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert tok.get_vocab_size() == config["vocab_size"]
    if config["model_type"] in presets.BYTE_LEVEL_MODEL_TYPES:
        ids = [ord("w"), ord("7"), ord(" "), ord("x")]   # each byte is one token, its own id
    else:
        ids = [config["vocab_size"] - 1, 1000, 7]
    assert tok.encode(tok.decode(ids)).ids == ids
    assert tok.token_to_id("</s>") == config["eos_token_id"]
    template = json.loads((folder / "tokenizer_config.json").read_text())["chat_template"]
    assert "messages" in template


@pytest.mark.parametrize("name", ["tiny", *sorted(presets.PRESETS)])
def test_the_tokenizer_the_server_loads_counts_text_as_written(name, tmp_path, monkeypatch):
    """Loaded as vLLM loads it (transformers' AutoTokenizer picks the class, for qwen2 whatever
    tokenizer_config.json says), text re-encodes to the tokens it was decoded from, so prompts of
    an exact length exist. The word-level tokenizer loaded as Qwen2Tokenizer encoded every text to []."""
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    folder = presets.preset_folder(name)
    config = json.loads((folder / "config.json").read_text())
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert len(tok) == config["vocab_size"]           # nothing added beyond the model's vocabulary
    vocab = config["vocab_size"]
    rng = random.Random(1)
    ids = [rng.randrange(vocab // 10, vocab) for _ in range(64)]
    encoded = tok.encode(tok.decode(ids), add_special_tokens=False)
    assert len(encoded) >= 64
    cut = encoded[:50]
    assert tok.encode(tok.decode(cut), add_special_tokens=False) == cut
    assert tok.eos_token_id == config["eos_token_id"] and tok.bos_token_id == config["bos_token_id"]


def test_a_cached_preset_with_an_old_tokenizer_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    folder = presets.preset_folder("qwen2.5-32b")
    (folder / "tuner-preset.json").unlink()           # as written before the tokenizer scheme changed
    (folder / "tokenizer.json").write_text("{}")
    folder = presets.preset_folder("qwen2.5-32b")
    assert Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size() == 152064


def test_embedded_tiny_model_matches_its_generator():
    shipped = json.loads((presets.TINY_MODEL / "config.json").read_text())
    assert shipped == presets.TINY_CONFIG


def test_published_shapes():
    l8 = presets.PRESETS["llama-3.1-8b"]
    assert (l8["num_hidden_layers"], l8["num_key_value_heads"], l8["hidden_size"],
            l8["intermediate_size"], l8["vocab_size"]) == (32, 8, 4096, 14336, 128256)
    q32 = presets.PRESETS["qwen2.5-32b"]
    assert (q32["num_hidden_layers"], q32["num_key_value_heads"], q32["hidden_size"]) == (64, 8, 5120)


@pytest.mark.parametrize("name, billions", [("qwen2.5-7b", 7.62), ("qwen3-8b", 8.19),
                                            ("mistral-7b", 7.25), ("llama-3.1-8b", 8.03)])
def test_the_memory_model_counts_each_preset_as_its_model_card_does(name, billions, tmp_path,
                                                                   monkeypatch):
    """The parameter counts the model cards publish (Qwen2.5-7B 7.61B, Qwen3-8B 8.2B, Mistral 7B
    v0.3 7.25B, Llama 3.1 8B 8.03B), within 10 million: the shapes are the published ones."""
    from tuner.search import feasibility

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    shape = feasibility.model_shape(str(presets.preset_folder(name)))
    assert shape.param_count / 1e9 == pytest.approx(billions, abs=0.01)


def test_the_awq_preset_is_the_32b_shape_in_4_bit_and_needs_offload_on_a_16_gb_card():
    from tuner.search import feasibility
    from tuner.search.space import ServerParams

    full = feasibility.model_shape(str(presets.preset_folder("qwen2.5-32b")))
    awq = feasibility.model_shape(str(presets.preset_folder("qwen2.5-32b-awq")))
    assert awq.quantization == "awq" and awq.dtype_bytes == 2 and awq.param_count == full.param_count
    # 4-bit linear layers with their fp16 scales and 4-bit zero points per group of 128, fp16
    # embeddings, lm_head, biases and norms (by hand in tests/test_presets_by_hand.py): ~18.0 GiB,
    # more than 16 GB; the H200 study logged 11.26 GiB with 7 GiB offloaded, 18.26 in all
    assert awq.weights_bytes == 19_328_804_864
    assert 17.5 < awq.weights_bytes / 2**30 < 18.5
    card = feasibility.MemoryModel(awq, int(15.77 * 2**30), "cuda", "Tesla V100-SXM2-16GB")
    at = lambda off: card.predict(ServerParams(gpu_memory_utilization=0.92, max_model_len=4096,
                                               max_num_seqs=8, cpu_offload_gb=off))
    assert not at(0).fits and not at(2).fits and at(8).fits
    assert at(8).kv_cache_tokens > at(6).kv_cache_tokens > 0    # each offloaded GiB goes to the cache


def test_unknown_preset_names_the_choices():
    with pytest.raises(TunerError, match="llama-3.1-8b"):
        presets.preset_folder("nope")


