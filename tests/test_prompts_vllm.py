"""Prompts for every preset's tokenizer, on real vLLM (CPU build) serving a shrunken config of
that architecture with the same vocabulary and tokenizer: every request succeeds and counts
exactly the asked prompt tokens."""

from __future__ import annotations

import asyncio

import pytest

from conftest import real_vllm
from tuner.models import presets
from tuner.load.client import endpoint_url, new_session, request_payload, stream_request
from tuner.load.prompts import build_prompts

pytestmark = pytest.mark.vllm

# llama-3.2-3b and llama-3.1-70b share llama-3.1-8b's vocabulary, BOS and EOS: one server covers them
SAME_VOCABULARY = {"llama-3.2-3b": "llama-3.1-8b", "llama-3.1-70b": "llama-3.1-8b"}
TOKEN_IDS = ("vocab_size", "bos_token_id", "eos_token_id", "model_type")


def shrunk(config: dict) -> dict:
    """The architecture and vocabulary of `config` at a size that starts in seconds on a CPU."""
    small = {**config, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096}
    if "head_dim" in config:
        small["head_dim"] = 64
    if "max_window_layers" in config:
        small["max_window_layers"] = 2
    return small


def test_presets_sharing_a_vocabulary_really_share_it():
    for name, same in SAME_VOCABULARY.items():
        assert [presets.PRESETS[name][k] for k in TOKEN_IDS] == [presets.PRESETS[same][k] for k in TOKEN_IDS]


def check_prompts_are_served_exactly(base_url: str, model: str, cases) -> None:
    """8 prompts per (endpoint, length) sent at once: all succeed, each counted at its length."""
    async def go():
        out = {}
        async with new_session(8) as session:
            for endpoint, n in cases:
                prompts = await build_prompts(session, base_url, model, 8, n, endpoint, seed=n)
                url = endpoint_url(base_url, endpoint)
                results = await asyncio.gather(*(
                    stream_request(session, url, request_payload(model, p, 2, endpoint),
                                   chat=endpoint == "chat", timeout_s=300) for p in prompts))
                out[endpoint, n] = prompts, results
        return out

    for (endpoint, n), (prompts, results) in asyncio.run(go()).items():
        assert len(set(prompts)) == 8, (endpoint, n)
        for r in results:
            assert r.ok, (endpoint, n, r.error_kind, r.error)
            assert (r.prompt_tokens, r.output_tokens) == (n, 2), (endpoint, n)


def test_prompts_of_the_tiny_tokenizer_are_served_at_their_exact_length(tiny_vllm_server):
    base_url, model = tiny_vllm_server          # the session's server: max-model-len 1024
    check_prompts_are_served_exactly(base_url, model, [("completions", 64), ("completions", 1022), ("chat", 64)])


@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen2.5-32b"])
def test_prompts_of_every_preset_tokenizer_are_served_at_their_exact_length(tmp_path, name):
    folder = presets.write_model_folder(shrunk(presets.PRESETS[name]), tmp_path / name)
    with real_vllm(str(folder), tmp_path / "server.log", "--enforce-eager", max_model_len=2048) as base_url:
        check_prompts_are_served_exactly(base_url, str(folder),
                                         [("completions", 64), ("completions", 1024), ("chat", 64)])
