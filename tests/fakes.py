"""Shared fakes built from the real data types: a fake device that launches instantly."""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from types import SimpleNamespace

from tuner.config import parse_study
from tuner.run.process import Capacity, LaunchFailure, build_argv
from tuner.run.measure import TrialOutcome
from tuner.load.metrics import LoadMetrics
from tuner.search.study import Platform

FAKE_PLATFORM = Platform("cpu", "fake device", 10 * 2**30, None, ("true",), "0.0-fake")

FAKE_STUDY = {
    "study": {"name": "fake", "sampler": "tpe", "seed": 1, "memory_model": False, "replicates": 0},
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
    noise: float = 0.0                  # launch-to-launch relative noise (sd) of every figure
    fail_relaunch_of: set = field(default_factory=set)   # max_num_seqs values whose 2nd+ launch fails
    seed: int = 0

    def __post_init__(self):
        self.rng = random.Random(self.seed)
    launcher_argv: bool = False         # record the argv the launcher builds (engine, extras, host, port)

    def kv_tokens(self, gmu: float) -> int:
        return max(0, int((gmu - self.overhead_gmu) * self.tokens_per_gmu / 0.1))

    def __call__(self, spec, workload, on_started=None, progress=False) -> TrialOutcome:
        self.launches.append(spec.params)
        if on_started is not None:
            on_started(FakeServer())
        if self.interrupt_at == len(self.launches):
            raise KeyboardInterrupt
        p = spec.params
        argv = (tuple(build_argv(spec, spec.engine_cmd, FakeServer.port)) if self.launcher_argv
                else ("vllm", "serve", spec.model, *p.vllm_flags()))
        base = TrialOutcome(params=p, argv=argv,
                            log_path=spec.log_path, launch_s=1.0)
        tokens = self.kv_tokens(p.gpu_memory_utilization)
        if tokens < p.max_model_len:
            return replace(base, failure=LaunchFailure(
                kind="kv_cache_too_small", message="estimated maximum model length is %d" % tokens,
                needed_gib=p.max_model_len * 4096 / 2**30, available_gib=tokens * 4096 / 2**30,
                estimated_max_model_len=tokens))
        seqs = p.max_num_seqs
        if seqs in self.fail_relaunch_of and self.launches[:-1].count(p):
            return replace(base, failure=LaunchFailure(kind="oom", message="CUDA out of memory"))

        def jitter(x: float) -> float:
            return x * (1 + self.rng.gauss(0, self.noise)) if self.noise else x

        metrics = LoadMetrics(single_stream_tok_s=jitter(100.0 - 0.1 * seqs),
                              single_stream_tok_s_spread=1.0,
                              throughput_tok_s=jitter(100.0 * min(seqs, 16)),
                              ttft_ms=jitter(10.0 * seqs), ttft_ms_spread=1.0, ttft_ms_p90=12.0 * seqs,
                              tpot_ms_p90=10.0, e2e_ms_p90=100.0, concurrency=16,
                              requests_sent=20)
        return replace(base, metrics=metrics, load_s=2.0, capacity=Capacity(
            kv_cache_tokens=tokens, kv_cache_gib=tokens * 4096 / 2**30, weights_gib=0.01,
            max_concurrency=tokens / p.max_model_len))


@dataclass
class FakeCurveDevice(FakeDevice):
    """FakeDevice whose load test also reports every level of the workload's plan (each config's
    load curve: throughput saturates at min(concurrency, max-num-seqs, 16), TTFT queues beyond
    max-num-seqs); `during(launch_number)` runs while the launch is under way (its trial RUNNING)."""

    during: object = None

    def __call__(self, spec, workload, on_started=None, progress=False) -> TrialOutcome:
        from tuner.load.plan import load_plan
        from tuner.records import LevelMetrics

        out = super().__call__(spec, workload, on_started, progress)
        if self.during is not None:
            self.during(len(self.launches))
        if out.metrics is None:
            return out
        seqs = spec.params.max_num_seqs
        scale = out.metrics.throughput_tok_s / (100.0 * min(seqs, 16))   # this launch's noise
        levels = tuple(LevelMetrics(
            name=lv.name, concurrency=lv.concurrency, requests=lv.requests, steady=True,
            throughput_tok_s=scale * 100.0 * min(lv.concurrency, seqs, 16),
            ttft_ms=10.0 * max(1.0, lv.concurrency / seqs) + 0.37 * lv.concurrency,
            ttft_ms_p90=12.0 * max(1.0, lv.concurrency / seqs) + 0.5 * lv.concurrency,
            tpot_ms=10.0 + 0.123 * min(lv.concurrency, seqs),
            e2e_ms_p90=100.0 + 3.3 * lv.concurrency) for lv in load_plan(workload))
        return replace(out, metrics=replace(out.metrics, levels=levels))


# ---------------------------------------------------------------- a fake NVML (pynvml patched)

GIB = 2**30


class RecordingTrial:
    """What record_outcome writes to: an Optuna trial's user attrs and constraints, kept in dicts."""

    def __init__(self):
        self.attrs, self.constraints = {}, {}

    def set_user_attr(self, k, v):
        self.attrs[k] = v

    def set_constraint(self, k, v):
        self.constraints[k] = v


@dataclass
class FakeGpu:
    """One GPU as a fake NVML shows it; tests move `used` and `processes` while a sampler runs."""

    name: str = "NVIDIA H100 80GB HBM3"
    total: int = 80 * GIB
    used: int = 1 * GIB
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    capability: tuple[int, int] | None = (9, 0)
    clock_mhz: int | None = 2619
    bus_bits: int | None = 5120
    pcie: tuple[int, int] | None = (5, 16)            # max link generation, lanes
    processes: list = field(default_factory=list)     # [(pid, used_bytes)]
    migs: list["FakeGpu"] = field(default_factory=list)   # MIG instances (MIG mode on when any)


class FakeNvml:
    """Patches pynvml so that NVML sees `devices` (in NVML index order)."""

    def __init__(self, monkeypatch, *devices: FakeGpu):
        import pynvml

        self.devices = list(devices) or [FakeGpu()]
        self.error = pynvml.NVMLError
        for attr, value in {
            "nvmlInit": lambda: None,
            "nvmlDeviceGetCount": lambda: len(self.devices),
            "nvmlDeviceGetHandleByIndex": self._by_index,
            "nvmlDeviceGetName": lambda h: h.name,
            "nvmlDeviceGetUUID": lambda h: h.uuid,
            "nvmlDeviceGetCudaComputeCapability": self._capability,
            "nvmlDeviceGetMemoryInfo": lambda h: SimpleNamespace(total=h.total, used=h.used,
                                                                 free=h.total - h.used),
            "nvmlDeviceGetMaxClockInfo": lambda h, kind: self._or_fail(h.clock_mhz),
            "nvmlDeviceGetMemoryBusWidth": lambda h: self._or_fail(h.bus_bits),
            "nvmlDeviceGetMaxPcieLinkGeneration": lambda h: self._or_fail(h.pcie and h.pcie[0]),
            "nvmlDeviceGetMaxPcieLinkWidth": lambda h: self._or_fail(h.pcie and h.pcie[1]),
            "nvmlDeviceGetComputeRunningProcesses": lambda h: [
                SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in h.processes],
            "nvmlDeviceGetGraphicsRunningProcesses": lambda h: [],
            "nvmlDeviceGetMigMode": lambda h: (1 if h.migs else 0, 1 if h.migs else 0),
            "nvmlDeviceGetMaxMigDeviceCount": lambda h: 7 if h.migs else 0,
            "nvmlDeviceGetMigDeviceHandleByIndex": self._mig,
        }.items():
            monkeypatch.setattr(pynvml, attr, value)

    def _fail(self):
        import pynvml
        raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def _or_fail(self, value):
        return self._fail() if value is None else value

    def _by_index(self, index):
        if not 0 <= index < len(self.devices):
            self._fail()
        return self.devices[index]

    def _capability(self, h):
        return self._or_fail(h.capability)

    def _mig(self, h, index):
        if index >= len(h.migs):
            self._fail()
        return h.migs[index]


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
