"""Prompts of an exact token length, as the server counts them, distinct per request."""

from __future__ import annotations

import asyncio
import random

import aiohttp

from tuner import engines
from tuner.errors import TunerError

# The largest id the server's tokenizer decodes bounds the ids prompts are drawn from.
_TOKEN_PROBES = (262144, 200000, 151000, 128000, 100000, 64000, 50000, 32000, 16000, 8000, 4000, 2000, 1000)
_PROBE_TEXT = "w100 w101"
_ROUNDS = 8            # detokenize/tokenize rounds per prompt; real tokenizers settle in 2-3
_BATCH = 16            # prompts built at a time: the server is also tokenizing for others


class PromptError(TunerError):
    """No prompt of the asked length can be built with this server's tokenizer: nothing is sent
    (every request would be rejected or mis-sized, for every config alike)."""

    def __init__(self, base_url: str, prompt_tokens: int, problem: str):
        self.base_url, self.prompt_tokens, self.problem = base_url, prompt_tokens, problem
        super().__init__(f"cannot build prompts of exactly {prompt_tokens} tokens on {base_url}: {problem}")


class _ServerFailing(Exception):
    """Nothing answered, or HTTP 5xx: a fault of this server now, not a fact of its tokenizer."""


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


class _Builder:
    """The server's /tokenize and /detokenize, asked the questions prompt building needs."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, model: str, prompt_tokens: int,
                 chat: bool, rng: random.Random, api=None):
        self.session, self.base_url, self.model = session, base_url, model
        self.prompt_tokens, self.chat, self.rng = prompt_tokens, chat, rng
        self.api = api or engines.get().tokenizer_api
        self.tok_url, self.detok_url = base_url + self.api.tokenize_path, base_url + self.api.detokenize_path

    def fail(self, problem: str) -> PromptError:
        return PromptError(self.base_url, self.prompt_tokens, problem)

    async def ask(self, url: str, body: dict, key: str, kind: type, what: str):
        status, r = await _post(self.session, url, body)
        if status == 0 or status >= 500:
            raise _ServerFailing
        value = None if r is None else (self.api.count(r) if key == "count" else r.get(key))
        if r is None or not isinstance(value, kind):
            shown = self.api.count_key or "tokens" if key == "count" else key
            raise self.fail(f"{url} answered {f'HTTP {status}' if r is None else 'without ' + repr(shown)} {what}")
        return value

    async def tokens_of(self, text: str) -> list[int]:
        return await self.ask(self.tok_url, self.api.tokenize_body(self.model, text, False),
                              "tokens", list, f"to a text of {len(text)} characters")

    async def served_count(self, text: str) -> int:
        """What the request will count: BOS or the chat template's tokens included."""
        if self.chat and self.api.chat_messages:
            body = {"model": self.model, "messages": [{"role": "user", "content": text}]}
        elif self.chat:
            raise self.fail("this engine's /tokenize counts no chat prompts: use endpoint = \"completions\"")
        else:
            body = self.api.tokenize_body(self.model, text, True)
        return await self.ask(self.tok_url, body, "count", int, f"to a {'chat' if self.chat else 'completion'} prompt")

    async def text_of(self, ids: list[int]) -> str:
        return await self.ask(self.detok_url, {"model": self.model, "tokens": ids}, self.api.detokenized_key, str,
                              f"to {len(ids)} token ids")

    async def id_range(self) -> tuple[int, int]:
        """Token ids to draw from: below the largest one the tokenizer decodes to text, above a
        tenth of it (byte and special tokens sit low, added ones beyond the vocabulary)."""
        for ids in _TOKEN_PROBES:
            status, r = await _post(self.session, self.detok_url, {"model": self.model, "tokens": [ids - 1]})
            if status >= 500 and self.api.out_of_range_5xx:
                continue   # llama.cpp: "vector::_M_range_check", an id past its vocabulary
            if status == 0 or status >= 500:
                raise _ServerFailing
            if r is not None and str(r.get(self.api.detokenized_key, "")).strip():
                return max(ids // 10, 10), ids
        raise self.fail(f"{self.detok_url} decodes none of the token ids "
                        + ", ".join(str(p - 1) for p in _TOKEN_PROBES))

    async def build(self, count: int) -> list[str]:
        plain = await self.tokens_of(_PROBE_TEXT)
        if not plain:
            raise self.fail(f"its tokenizer encodes the text {_PROBE_TEXT!r} to no tokens, so every prompt "
                            "would be empty (a tokenizer that does not fit the model folder's files?)")
        overhead = await self.served_count(_PROBE_TEXT) - len(plain)
        if self.prompt_tokens - overhead < 1:
            raise self.fail(f"the {'chat template' if self.chat else 'special tokens'} alone take {overhead} tokens")
        lo, hi = await self.id_range()
        prompts: list[str] = []
        seen: set[str] = set()
        for _ in range(3):                   # a duplicate is redrawn; a few rounds of them means the
            missing = count - len(prompts)   # id range is too small for this many distinct prompts
            for i in range(0, missing, _BATCH):
                batch = await asyncio.gather(*(self.one(overhead, lo, hi) for _ in range(min(_BATCH, missing - i))))
                for p in batch:
                    if p not in seen:
                        seen.add(p)
                        prompts.append(p)
            if len(prompts) == count:
                return prompts
        raise self.fail(f"only {len(prompts)} of {count} prompts are distinct (token ids {lo}-{hi - 1})")

    async def one(self, overhead: int, lo: int, hi: int) -> str:
        want = self.prompt_tokens - overhead     # tokens of the text alone
        ids = [self.rng.randrange(lo, hi) for _ in range(want)]
        got: list[int] = []
        for _ in range(_ROUNDS):
            text = await self.text_of(ids)
            got = await self.tokens_of(text)
            if not got:
                raise self.fail(f"{len(ids)} token ids decode to text that encodes to no tokens")
            if len(got) == want:
                served = await self.served_count(text)
                if served == self.prompt_tokens:
                    return text
                want += self.prompt_tokens - served   # the template joins the text differently
                if want < 1:
                    raise self.fail(f"a prompt of {len(got)} text tokens counts as {served}")
            ids = got[:want] if len(got) > want else got + [self.rng.randrange(lo, hi)
                                                            for _ in range(want - len(got))]
        raise self.fail(f"after {_ROUNDS} rounds of /detokenize and /tokenize a prompt still has "
                        f"{len(got)} tokens of text where {want} were wanted")


async def build_prompts(session: aiohttp.ClientSession, base_url: str, model: str, count: int,
                        prompt_tokens: int, endpoint: str = "completions", seed: int = 0,
                        engine: str | None = None) -> list[str]:
    """`count` distinct prompts of exactly `prompt_tokens` tokens as the server counts them.

    Each prompt is random token ids detokenized by the server (distinct from its first tokens, so
    prefix caching cannot flatter TTFT), then re-tokenized and trimmed or padded until its length is
    exact, then counted once more the way the request will be (BOS, or the chat template, included).
    Raises PromptError when the server's tokenizer cannot give that length (a tokenizer that encodes
    text to nothing, a template longer than the prompt, lengths that never settle) rather than
    sending prompts it would reject. A server without /tokenize (HTTP 404), or one that stops
    answering or fails with HTTP 5xx meanwhile, gets words `w<i>` (the embedded word-level
    tokenizer's scheme), unverified: the failing server's requests then fail and are recorded as
    that config's failed load test.
    """
    rng = random.Random(seed)

    def words() -> list[str]:
        return [" ".join(f"w{rng.randrange(7, 4096)}" for _ in range(prompt_tokens)) for _ in range(count)]

    api = engines.get(engine).tokenizer_api
    status, _ = await _post(session, base_url + api.tokenize_path, api.tokenize_body(model, _PROBE_TEXT, False))
    if status in (404, 405):
        return words()
    try:
        return await _Builder(session, base_url, model, prompt_tokens, endpoint == "chat", rng, api).build(count)
    except _ServerFailing:
        return words()


async def build_prompts_of_lengths(session: aiohttp.ClientSession, base_url: str, model: str,
                                   lengths, endpoint: str = "completions", seed: int = 0,
                                   engine: str | None = None) -> list[str]:
    """One distinct prompt per entry of `lengths` (token counts), each exactly that long: the
    prompts of each distinct length are built together (see build_prompts), with a seed of the
    workload's and the length's, so the same lengths give the same prompts for every config."""
    wanted: dict[int, int] = {}
    for n in lengths:
        wanted[n] = wanted.get(n, 0) + 1
    built: dict[int, list[str]] = {}
    for n, count in sorted(wanted.items()):
        built[n] = await build_prompts(session, base_url, model, count, n, endpoint,
                                       seed=seed * 1_000_003 + n, engine=engine)
    return [built[n].pop() for n in lengths]
