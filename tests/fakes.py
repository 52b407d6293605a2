"""Shared fakes built from the real data types: a fake device that launches instantly."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from tuner.config import parse_study
from tuner.launcher import Capacity, LaunchFailure
from tuner.measure import TrialOutcome
from tuner.metrics import LoadMetrics
from tuner.study import Platform

FAKE_PLATFORM = Platform("cpu", "fake device", 10 * 2**30, None, ("true",), "0.0-fake")

FAKE_STUDY = {
    "study": {"name": "fake", "sampler": "tpe", "seed": 1, "memory_model": False},
    "model": {"path": "preset:tiny"},
    "space": {"gpu_memory_utilization": {"low": 0.1, "high": 0.9, "step": 0.1},
              "max_model_len": {"choices": [1024, 4096, 16384, 65536]},
              "max_num_seqs": {"choices": [1, 4, 16, 64]}},
    "workload": {"prompt_tokens": 16, "output_tokens": 8},
}


def fake_config(tmp_path, **study_overrides):
    doc = {k: (dict(v) if isinstance(v, dict) else v) for k, v in FAKE_STUDY.items()}
    doc["study"] = {**doc["study"], **study_overrides}
    return parse_study(doc, "<fake>", {"storage": f"sqlite:///{tmp_path}/fake.db",
                                       "results_dir": str(tmp_path / "results")})


@dataclass
class FakeServer:
    pgid: int = 4242
    port: int = 8000
    pid: int = 4242


@dataclass
class FakeDevice:
    """KV tokens grow with gmu; throughput grows with max-num-seqs and saturates at 16; TTFT
    grows with max-num-seqs. A config whose max-model-len exceeds the KV tokens fails like vLLM."""

    tokens_per_gmu: int = 40_000
    overhead_gmu: float = 0.15
    launches: list = field(default_factory=list)
    interrupt_at: int | None = None     # raise KeyboardInterrupt on this launch (1-based)

    def kv_tokens(self, gmu: float) -> int:
        return max(0, int((gmu - self.overhead_gmu) * self.tokens_per_gmu / 0.1))

    def __call__(self, spec, workload, on_started=None, progress=False) -> TrialOutcome:
        self.launches.append(spec.params)
        if on_started is not None:
            on_started(FakeServer())
        if self.interrupt_at == len(self.launches):
            raise KeyboardInterrupt
        p = spec.params
        base = TrialOutcome(params=p, argv=("vllm", "serve", spec.model, *p.vllm_flags()),
                            log_path=spec.log_path, launch_s=1.0)
        tokens = self.kv_tokens(p.gpu_memory_utilization)
        if tokens < p.max_model_len:
            return replace(base, failure=LaunchFailure(
                kind="kv_cache_too_small", message="estimated maximum model length is %d" % tokens,
                needed_gib=p.max_model_len * 4096 / 2**30, available_gib=tokens * 4096 / 2**30,
                estimated_max_model_len=tokens))
        seqs = p.max_num_seqs
        metrics = LoadMetrics(single_stream_tok_s=100.0 - 0.1 * seqs, single_stream_tok_s_spread=1.0,
                              throughput_tok_s=100.0 * min(seqs, 16), throughput_tok_s_spread=5.0,
                              ttft_ms=10.0 * seqs, ttft_ms_spread=1.0, ttft_ms_p90=12.0 * seqs,
                              tpot_ms_p90=10.0, e2e_ms_p90=100.0, concurrency=seqs)
        return replace(base, metrics=metrics, load_s=2.0, capacity=Capacity(
            kv_cache_tokens=tokens, kv_cache_gib=tokens * 4096 / 2**30, weights_gib=0.01,
            max_concurrency=tokens / p.max_model_len))


class TokenizerServer:
    """vLLM's /tokenize and /detokenize in-process (a thread with its own aiohttp loop), backed by
    the tokenizer vLLM itself would load from `folder` (transformers' AutoTokenizer), so prompt
    building meets the real tokenizer without starting a server. `tamper(path, body)` may rewrite
    an answer (`path`, the request's JSON, the answer), to stand in for a misbehaving tokenizer;
    None answers 404, as a server without that endpoint does, and a number answers that status."""

    def __init__(self, folder, tamper=None):
        import asyncio
        import socket
        import threading

        from aiohttp import web
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(folder))
        self.tamper = tamper or (lambda path, request, answer: answer)
        self.loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._detokenize)
        self.runner = web.AppRunner(app)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        ready = threading.Event()

        def serve():
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self.runner.setup())
            self.loop.run_until_complete(web.SockSite(self.runner, sock).start())
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()
        ready.wait(10)

    async def _tokenize(self, request):
        from aiohttp import web

        body = await request.json()
        if "messages" in body:   # vLLM's TokenizeChatRequest: add_generation_prompt defaults to true
            ids = self.tok.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        else:
            ids = self.tok.encode(body["prompt"], add_special_tokens=body.get("add_special_tokens", True))
        return self._answer(self.tamper("/tokenize", body, {"count": len(ids), "tokens": list(ids)}))

    async def _detokenize(self, request):
        from aiohttp import web

        body = await request.json()
        ids = body["tokens"]
        if any(i >= len(self.tok) for i in ids):   # vLLM answers 400 for ids beyond the vocabulary
            return web.json_response({"error": "token id out of vocabulary"}, status=400)
        return self._answer(self.tamper("/detokenize", body, {"prompt": self.tok.decode(ids)}))

    @staticmethod
    def _answer(answer):
        from aiohttp import web

        if answer is None or isinstance(answer, int):
            return web.Response(status=answer or 404, text="tampered")
        return web.json_response(answer)

    def count_served(self, text: str, chat: bool = False) -> int:
        if chat:
            ids = self.tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                               tokenize=True)
            return len(ids["input_ids"] if hasattr(ids, "keys") else ids)
        return len(self.tok.encode(text))

    def close(self) -> None:
        import asyncio

        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
