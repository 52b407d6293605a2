"""Prompts of an exact token length, as the server counts them, distinct per request."""

from __future__ import annotations

import asyncio
import random

import aiohttp

_TOKEN_PROBES = (262144, 200000, 151000, 128000, 100000, 64000, 50000, 32000, 16000, 8000, 4000, 2000, 1000)

async def _post_json(session: aiohttp.ClientSession, url: str, body: dict) -> dict | None:
    try:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=30)) as r:
            if r.status != 200:
                return None
            return await r.json()
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
        return None


async def build_prompts(session: aiohttp.ClientSession, base_url: str, model: str, count: int,
                        prompt_tokens: int, endpoint: str = "completions", seed: int = 0) -> list[str]:
    """`count` distinct prompts of exactly `prompt_tokens` tokens as the server counts them.

    Each prompt is random token ids detokenized by the server (distinct from its first tokens, so
    prefix caching cannot flatter TTFT), then re-tokenized and trimmed or padded until the length is
    exact; the special tokens (BOS) or the chat template's tokens are part of the count. Without
    /tokenize the prompts are words `w<i>` (the embedded word-level tokenizer's scheme), unverified.
    """
    rng = random.Random(seed)
    chat = endpoint == "chat"
    tok_url, detok_url = base_url + "/tokenize", base_url + "/detokenize"
    probe = "w100 w101"
    plain = await _post_json(session, tok_url, {"model": model, "prompt": probe, "add_special_tokens": False})
    if plain is None:
        return [" ".join(f"w{rng.randrange(7, 4096)}" for _ in range(prompt_tokens)) for _ in range(count)]
    if chat:
        full = await _post_json(session, tok_url, {"model": model,
                                                   "messages": [{"role": "user", "content": probe}]})
    else:
        full = await _post_json(session, tok_url, {"model": model, "prompt": probe})
    overhead = (full or plain)["count"] - plain["count"]
    target = max(prompt_tokens - overhead, 1)

    hi = 0
    for ids in _TOKEN_PROBES:  # the largest id the tokenizer decodes bounds the vocabulary
        r = await _post_json(session, detok_url, {"model": model, "tokens": [ids - 1]})
        if r is not None and r.get("prompt", "").strip():
            hi = ids
            break
    lo = max(hi // 10, 10)
    if hi <= lo:
        raise RuntimeError(f"cannot find decodable token ids via {detok_url}")

    async def one() -> str:
        ids = [rng.randrange(lo, hi) for _ in range(target)]
        text = ""
        for _ in range(6):
            r = await _post_json(session, detok_url, {"model": model, "tokens": ids})
            if r is None:
                break
            text = r["prompt"]
            t = await _post_json(session, tok_url, {"model": model, "prompt": text, "add_special_tokens": False})
            if t is None:
                break
            got = t["tokens"]
            if len(got) == target:
                return text
            ids = got[:target] if len(got) > target else got + [rng.randrange(lo, hi)
                                                               for _ in range(target - len(got))]
        return text  # best effort: the usage of each request records the real length

    prompts: list[str] = []
    for i in range(0, count, 16):  # a few at a time: the server is also tokenizing for others
        prompts += await asyncio.gather(*(one() for _ in range(min(16, count - i))))
    return prompts
