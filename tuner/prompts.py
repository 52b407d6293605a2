"""Prompts of an exact token length, as the server counts them, distinct per request."""

from __future__ import annotations

import asyncio
import random

import aiohttp

from tuner.errors import TunerError

# The largest id the server's tokenizer decodes bounds the ids prompts are drawn from.
_TOKEN_PROBES = (262144, 200000, 151000, 128000, 100000, 64000, 50000, 32000, 16000, 8000, 4000, 2000, 1000)
_PROBE_TEXT = "w100 w101"
_ROUNDS = 8            # detokenize/tokenize rounds per prompt; real tokenizers settle in 2-3
_BATCH = 16            # prompts built at a time: the server is also tokenizing for others


class PromptError(TunerError):
    """No prompt of the asked length can be built on this server: nothing is sent (every request
    would be rejected or mis-sized, for every config alike)."""

    def __init__(self, base_url: str, prompt_tokens: int, problem: str):
        self.base_url, self.prompt_tokens, self.problem = base_url, prompt_tokens, problem
        super().__init__(f"cannot build prompts of exactly {prompt_tokens} tokens on {base_url}: {problem}")


async def _post(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict | None]:
    """(HTTP status or 0 when nothing answered, the JSON object answered or None)."""
    try:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=30)) as r:
            if r.status != 200:
                return r.status, None
            got = await r.json()
            return r.status, (got if isinstance(got, dict) else None)
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
        return 0, None


async def _post_json(session: aiohttp.ClientSession, url: str, body: dict) -> dict | None:
    return (await _post(session, url, body))[1]


async def build_prompts(session: aiohttp.ClientSession, base_url: str, model: str, count: int,
                        prompt_tokens: int, endpoint: str = "completions", seed: int = 0) -> list[str]:
    """`count` distinct prompts of exactly `prompt_tokens` tokens as the server counts them.

    Each prompt is random token ids detokenized by the server (distinct from its first tokens, so
    prefix caching cannot flatter TTFT), then re-tokenized and trimmed or padded until its length is
    exact, then counted once more the way the request will be (BOS, or the chat template, included).
    Raises PromptError when the server's tokenizer cannot give that length (a tokenizer that encodes
    text to nothing, a template longer than the prompt) rather than sending prompts it would reject.
    A server without /tokenize (HTTP 404) gets words `w<i>` (the embedded word-level tokenizer's
    scheme), unverified; one whose /tokenize fails raises PromptError.
    """
    rng = random.Random(seed)
    chat = endpoint == "chat"
    tok_url, detok_url = base_url + "/tokenize", base_url + "/detokenize"

    def fail(problem: str) -> PromptError:
        return PromptError(base_url, prompt_tokens, problem)

    async def tokens_of(text: str) -> list[int]:
        r = await _post_json(session, tok_url, {"model": model, "prompt": text, "add_special_tokens": False})
        if r is None or not isinstance(r.get("tokens"), list):
            raise fail(f"{tok_url} did not answer")
        return r["tokens"]

    async def served_count(text: str) -> int:
        """What the request will count: BOS or the chat template's tokens included."""
        if chat:
            body = {"model": model, "messages": [{"role": "user", "content": text}]}
        else:
            body = {"model": model, "prompt": text}
        r = await _post_json(session, tok_url, body)
        if r is None or not isinstance(r.get("count"), int):
            raise fail(f"{tok_url} did not count a {'chat' if chat else 'completion'} prompt")
        return r["count"]

    async def text_of(ids: list[int]) -> str:
        r = await _post_json(session, detok_url, {"model": model, "tokens": ids})
        if r is None or not isinstance(r.get("prompt"), str):
            raise fail(f"{detok_url} did not decode {len(ids)} token ids")
        return r["prompt"]

    status, plain = await _post(session, tok_url, {"model": model, "prompt": _PROBE_TEXT,
                                                   "add_special_tokens": False})
    if status in (404, 405):                 # a server without the endpoint, not a failing one
        return [" ".join(f"w{rng.randrange(7, 4096)}" for _ in range(prompt_tokens)) for _ in range(count)]
    if plain is None:
        raise fail(f"{tok_url} answered {f'HTTP {status}' if status else 'nothing'} to a short text")
    if not plain.get("tokens"):
        raise fail(f"its tokenizer encodes the text {_PROBE_TEXT!r} to no tokens, so every prompt would be "
                   "empty (a tokenizer that does not fit the model folder's files?)")
    overhead = await served_count(_PROBE_TEXT) - len(plain["tokens"])
    if prompt_tokens - overhead < 1:
        raise fail(f"the {'chat template' if chat else 'special tokens'} alone take {overhead} tokens")

    hi = 0
    for ids in _TOKEN_PROBES:
        r = await _post_json(session, detok_url, {"model": model, "tokens": [ids - 1]})
        if r is not None and str(r.get("prompt", "")).strip():
            hi = ids
            break
    lo = max(hi // 10, 10)
    if hi <= lo:
        raise fail(f"{detok_url} decodes none of the token ids {', '.join(str(p - 1) for p in _TOKEN_PROBES)}")

    async def one() -> str:
        want = prompt_tokens - overhead      # tokens of the text alone
        ids = [rng.randrange(lo, hi) for _ in range(want)]
        got: list[int] = []
        for _ in range(_ROUNDS):
            text = await text_of(ids)
            got = await tokens_of(text)
            if not got:
                raise fail(f"{len(ids)} token ids decode to text that encodes to no tokens")
            if len(got) == want:
                served = await served_count(text)
                if served == prompt_tokens:
                    return text
                want += prompt_tokens - served   # the template joins the text differently
                if want < 1:
                    raise fail(f"a prompt of {len(got)} text tokens counts as {served}")
            ids = got[:want] if len(got) > want else got + [rng.randrange(lo, hi) for _ in range(want - len(got))]
        raise fail(f"after {_ROUNDS} rounds of {detok_url} and {tok_url} a prompt still has "
                   f"{len(got)} tokens of text where {want} were wanted")

    prompts: list[str] = []
    seen: set[str] = set()
    for _ in range(3):                       # a duplicate is redrawn; a few rounds of them means the
        missing = count - len(prompts)       # id range is too small for this many distinct prompts
        for i in range(0, missing, _BATCH):
            for p in await asyncio.gather(*(one() for _ in range(min(_BATCH, missing - i)))):
                if p not in seen:
                    seen.add(p)
                    prompts.append(p)
        if len(prompts) == count:
            return prompts
    raise fail(f"only {len(prompts)} of {count} prompts are distinct (token ids {lo}-{hi - 1})")
