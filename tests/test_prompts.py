"""Prompt building against vLLM's /tokenize and /detokenize, backed by the tokenizer vLLM loads."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from fakes import TokenizerServer
from tuner.models import presets
from tuner.load.prompts import PromptError, build_prompts

pytest.importorskip("transformers")

PRESET_TOKENIZERS = ["tiny", "llama-3.1-8b", "qwen2.5-32b"]   # 3.2-3b and 3.1-70b share 8b's vocabulary


@pytest.fixture(scope="module")
def preset_dirs(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("XDG_CACHE_HOME", str(cache))
    try:
        yield {name: presets.preset_folder(name) for name in PRESET_TOKENIZERS}
    finally:
        mp.undo()


@pytest.fixture(scope="module")
def servers(preset_dirs):
    started = {name: TokenizerServer(folder) for name, folder in preset_dirs.items()}
    yield started
    for s in started.values():
        s.close()


def build(server, count, prompt_tokens, endpoint="completions", seed=0, model="m"):
    async def go():
        async with aiohttp.ClientSession() as s:
            return await build_prompts(s, server.base_url, model, count, prompt_tokens, endpoint, seed=seed)
    return asyncio.run(go())


@pytest.mark.parametrize("name", PRESET_TOKENIZERS)
@pytest.mark.parametrize("endpoint,prompt_tokens", [("completions", 64), ("completions", 1024), ("chat", 64)])
def test_every_preset_tokenizer_gives_exact_distinct_prompts(servers, name, endpoint, prompt_tokens):
    server = servers[name]
    prompts = build(server, 8, prompt_tokens, endpoint, seed=7)
    assert [server.count_served(p, endpoint == "chat") for p in prompts] == [prompt_tokens] * 8
    assert len(set(prompts)) == 8
    # distinct from their first tokens: a shared first KV block would be a prefix-cache hit
    assert len({tuple(server.tok.encode(p, add_special_tokens=False)[:16]) for p in prompts}) == 8


def test_a_tokenizer_that_encodes_text_to_nothing_fails_loudly(tmp_path):
    # the bug of issue 15: a word-level vocabulary under a qwen2 config, which transformers 5 loads
    # as Qwen2Tokenizer; every prompt was empty for the server ("The decoder prompt cannot be empty")
    config = presets.PRESETS["qwen2.5-32b"]
    presets.build_tokenizer_files({**config, "model_type": "llama"}, tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config))
    server = TokenizerServer(tmp_path)
    try:
        assert type(server.tok).__name__ == "Qwen2Tokenizer"
        with pytest.raises(PromptError, match="to no tokens") as err:
            build(server, 4, 1024)
    finally:
        server.close()
    assert "1024 tokens" in str(err.value) and "\n" not in str(err.value)


def test_a_template_longer_than_the_prompt_fails_loudly(servers):
    with pytest.raises(PromptError, match="chat template alone take 4 tokens"):
        build(servers["tiny"], 2, 4, "chat")


def test_lengths_that_never_settle_fail_loudly(preset_dirs):
    def one_more(path, request, answer):          # every text re-tokenizes one token longer
        if path == "/tokenize" and request.get("add_special_tokens") is False:
            return {"count": answer["count"] + 1, "tokens": answer["tokens"] + [5]}
        return answer
    server = TokenizerServer(preset_dirs["tiny"], tamper=one_more)
    try:
        with pytest.raises(PromptError, match="after 8 rounds"):
            build(server, 2, 32)
    finally:
        server.close()


def test_a_served_count_that_is_not_text_plus_template_is_followed(preset_dirs):
    # the probe says BOS costs 1 token, but longer prompts count 2 more (a template that joins
    # text and suffix differently): the served count decides, not the probe's arithmetic
    def longer(path, request, answer):
        if path == "/tokenize" and "add_special_tokens" not in request and len(request["prompt"]) > 20:
            return {"count": answer["count"] + 2, "tokens": answer["tokens"] + [5, 5]}
        return answer
    server = TokenizerServer(preset_dirs["tiny"], tamper=longer)
    try:
        prompts = build(server, 4, 32)
    finally:
        server.close()
    assert [server.count_served(p) + 2 for p in prompts] == [32] * 4


def test_without_tokenize_the_word_scheme_is_used(preset_dirs):
    server = TokenizerServer(preset_dirs["tiny"], tamper=lambda path, request, answer: None)
    try:
        prompts = build(server, 3, 10)
    finally:
        server.close()
    assert [server.count_served(p) for p in prompts] == [10] * 3       # unverified, right for w<i> vocabularies
    assert len(set(prompts)) == 3


def test_a_refusing_tokenize_is_not_taken_for_a_missing_one(preset_dirs):
    server = TokenizerServer(preset_dirs["tiny"])
    server.tamper = lambda path, request, answer: 400 if path == "/tokenize" else answer
    try:
        with pytest.raises(PromptError, match="/tokenize answered HTTP 400"):
            build(server, 2, 16)
    finally:
        server.close()


def test_a_server_that_fails_meanwhile_gets_words_whose_requests_will_fail(preset_dirs):
    # a crash is that config's failed load test, not a study-wide PromptError
    calls = []

    def dies(path, request, answer):
        calls.append(path)
        return 503 if len(calls) > 3 else answer
    server = TokenizerServer(preset_dirs["tiny"], tamper=dies)
    try:
        prompts = build(server, 3, 16)
    finally:
        server.close()
    assert len(prompts) == 3 and all(len(p.split()) == 16 for p in prompts)
