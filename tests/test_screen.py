"""Screening (search/screen.py): a config whose best possible figures, read off the launches already
measured at the same load levels, are beaten beyond the noise is not launched; nothing that would
reach the front is skipped."""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

import optuna
import pytest

from fakes import FAKE_PLATFORM, FakeServer, fake_config
from tuner import engines
from tuner.load.plan import load_plan
from tuner.records import Capacity, LevelMetrics, LoadMetrics, TrialOutcome, Workload
from tuner.results import report
from tuner.search import screen
from tuner.search.study import Tuner

NOISE = {k: {"cv": 0.05, "dof": 4, "configs": 2} for k in screen.OBJECTIVES}
WORKLOAD = Workload(prompt_tokens=64, output_tokens=32, max_concurrency=32)   # levels 4, 16, 32


def curve(slots: int, stream: float = 100.0) -> tuple[dict, ...]:
    """Same-load levels of a config with `slots`: n streams at `stream` tok/s, the rest queue."""
    out = [{"name": "single_stream", "concurrency": 1, "throughput_tok_s": stream}]
    for c in (4, 16, 32):
        run = min(c, slots)
        service_ms = 1000.0 * 32 / stream
        out.append({"name": f"c{c}", "concurrency": c, "throughput_tok_s": run * stream * 0.9,
                    "ttft_ms": 20.0 + max(0.0, c / run - 1) * service_ms})
    return tuple(out)


def measured(number: int, slots: int, eager: bool = True, stream: float = 100.0) -> screen.Measured:
    levels = curve(slots, stream)
    top = levels[-1]
    return screen.Measured(number, {"gpu_memory_utilization": 0.5, "max_model_len": 4096,
                                    "max_num_seqs": slots, "enforce_eager": eager},
                           {"single_stream_tok_s": stream, "throughput_tok_s": top["throughput_tok_s"],
                            "ttft_ms": top["ttft_ms"]}, runs=3, levels=levels)


def candidate(slots: int, eager: bool = True, gmu: float = 0.3) -> dict:
    return {"gpu_memory_utilization": gmu, "max_model_len": 1024, "max_num_seqs": slots,
            "enforce_eager": eager}


def test_fewer_slots_than_a_measured_launch_are_screened_with_the_reason():
    flags = engines.flags("vllm")
    got = screen.screen(candidate(4), [measured(0, 32)], WORKLOAD, flags, NOISE)
    assert got is not None and got.by == 0
    assert "trial 0 beats it beyond the noise on throughput_tok_s" in got.reason
    # its throughput bound is what the 32-slot launch measured at 4 clients (with room for noise)
    assert got.bound["throughput_tok_s"] == pytest.approx(4 * 100 * 0.9 * 1.15)
    # and the TTFT bound comes from the queue: 32 clients on 4 slots, half of 7 services
    assert got.bound["ttft_ms"] == pytest.approx(0.5 * 7 * 1000 * 31 / (100 * 1.15))


def test_what_the_measured_launches_say_nothing_about_is_launched():
    flags = engines.flags("vllm")
    launches = [measured(0, 32)]
    # as many slots as the top level: it meets no queue, it could be the best
    assert screen.screen(candidate(32), launches, WORKLOAD, flags, NOISE) is None
    # a flag that changes speed (CUDA graphs) differs from every measured launch
    assert screen.screen(candidate(4, eager=False), launches, WORKLOAD, flags, NOISE) is None
    # no noise measured yet, or noise that never varied: a tie is not known
    assert screen.screen(candidate(4), launches, WORKLOAD, flags, None) is None
    zero = {k: {"cv": 0.0, "dof": 2, "configs": 1} for k in screen.OBJECTIVES}
    assert screen.screen(candidate(4), launches, WORKLOAD, flags, zero) is None
    # SLOs (goodput), open-loop rates and length mixes: the bounds do not hold there
    for w in (replace(WORKLOAD, slo_ttft_ms=500.0), replace(WORKLOAD, request_rates=(2.0,)),
              replace(WORKLOAD, length_mix="uniform")):
        assert screen.screen(candidate(4), launches, w, flags, NOISE) is None


def test_a_close_call_is_a_tie_and_is_launched():
    flags = engines.flags("vllm")
    # a box that saturates: a 32-slot launch's c16 is 97 % of its c32, and TTFT is the objective at
    # 16 clients, where 16 slots meet no queue: the candidate's best is within the noise
    flat = measured(0, 32, stream=300.0)
    levels = list(flat.levels)
    levels[2] = dict(levels[2], throughput_tok_s=levels[3]["throughput_tok_s"] * 0.97)
    flat = replace(flat, levels=tuple(levels))
    at16 = replace(WORKLOAD, ttft_level=16)
    assert screen.screen(candidate(16), [flat], at16, flags, NOISE) is None
    # with TTFT at the top level the 16 slots queue half the clients: beaten on TTFT too
    got = screen.screen(candidate(16), [flat], WORKLOAD, flags, NOISE)
    assert got is not None and got.reason.endswith("ttft_ms")


def test_a_launch_short_of_kv_cache_bounds_nothing_at_the_levels_where_it_bound():
    """A 32-slot launch whose cache held only a few requests measured less than its slots could do:
    its figures at those levels say nothing about a config with fewer slots and more memory."""
    flags = engines.flags("vllm")
    full = measured(0, 32)
    got = screen.screen(candidate(4), [full], WORKLOAD, flags, NOISE)
    assert got is not None and got.bound["throughput_tok_s"] == pytest.approx(4 * 100 * 0.9 * 1.15)
    # the same launch, preempting at c4: the c16 figure (room for 16 requests) bounds instead
    levels = [dict(lv, preemptions=12.0) if lv["name"] == "c4" else lv for lv in full.levels]
    preempted = replace(full, levels=tuple(levels))
    c16 = full.levels[2]["throughput_tok_s"] * 1.15
    assert screen.bound(candidate(4), [preempted], WORKLOAD, flags, NOISE)["throughput_tok_s"] \
        == pytest.approx(min(4 * 100 * 1.15, c16))
    # a cache of 3 requests (96 tokens each): no level of 4 or more clients counts; only the
    # n-streams bound is left
    short = replace(full, kv_cache_tokens=3 * 96)
    assert screen.bound(candidate(4), [short], WORKLOAD, flags, NOISE)["throughput_tok_s"] \
        == pytest.approx(4 * 100 * 1.15)
    # room for 4 requests exactly is enough at c4
    room = replace(full, kv_cache_tokens=4 * 96)
    assert screen.bound(candidate(4), [room], WORKLOAD, flags, NOISE)["throughput_tok_s"] \
        == pytest.approx(4 * 100 * 0.9 * 1.15)


def test_the_bound_is_never_below_what_a_config_of_this_physics_measures():
    """Configs of a same-load world (n streams at the fastest single stream, the rest queue):
    every bound is at least as good as the config's own figures, on every objective."""
    flags = engines.flags("vllm")
    rng = random.Random(7)
    for _ in range(200):
        stream = rng.uniform(50, 300)
        peers = [measured(i, s, stream=stream * rng.uniform(0.97, 1.03))
                 for i, s in enumerate(rng.sample([1, 2, 4, 8, 16, 32], 3))]
        n = rng.choice([1, 2, 4, 8, 16])
        best = screen.bound(candidate(n), peers, WORKLOAD, flags, NOISE)
        truth = curve(n, stream)[-1]
        assert best["throughput_tok_s"] >= truth["throughput_tok_s"]
        assert best["ttft_ms"] <= truth["ttft_ms"]


# ---------------------------------------------------------------- in a study


@dataclass
class SameLoadDevice:
    """A device obeying the same-load protocol: single stream flat, n slots serve n of the level's
    clients and the rest queue; KV tokens grow with gmu (a long context fails at a small share)."""

    noise: float = 0.03
    launches: list = field(default_factory=list)
    seed: int = 0

    def __post_init__(self):
        self.rng = random.Random(self.seed)

    def __call__(self, spec, workload, on_started=None, progress=False) -> TrialOutcome:
        from tuner.records import LaunchFailure

        self.launches.append(spec.params)
        if on_started is not None:
            on_started(FakeServer())
        p = spec.params
        base = TrialOutcome(params=p, argv=("vllm", "serve", spec.model, *p.vllm_flags()),
                            log_path=spec.log_path, launch_s=1.0)
        tokens = max(0, int((p.gpu_memory_utilization - 0.15) * 400_000))
        if tokens < p.max_model_len:
            return replace(base, failure=LaunchFailure(
                kind="kv_cache_too_small", message=f"estimated maximum model length is {tokens}",
                estimated_max_model_len=tokens))
        j = lambda x: x * (1 + self.rng.gauss(0, self.noise))   # noqa: E731
        stream = j(100.0)
        levels = []
        for lv in load_plan(workload):
            run = min(lv.concurrency, p.max_num_seqs)
            service_ms = 1000.0 * workload.output_tokens / stream
            levels.append(LevelMetrics(
                name=lv.name, concurrency=lv.concurrency, requests=lv.requests, steady=True,
                throughput_tok_s=j(run * stream * 0.9),
                ttft_ms=j(20.0 + max(0.0, lv.concurrency / run - 1) * service_ms)))
        top = levels[-1]
        metrics = LoadMetrics(single_stream_tok_s=stream, throughput_tok_s=top.throughput_tok_s,
                              ttft_ms=top.ttft_ms, ttft_ms_p90=top.ttft_ms, requests_sent=20,
                              levels=tuple(levels))
        return replace(base, metrics=metrics, load_s=1.0,
                       capacity=Capacity(kv_cache_tokens=tokens, max_concurrency=tokens / p.max_model_len))


def test_a_study_skips_the_dominated_slots_and_keeps_the_front(tmp_path):
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    wl = {"prompt_tokens": 16, "output_tokens": 8, "max_concurrency": 64, "waves": 1}
    on = replace(fake_config(tmp_path / "on", replicates=2, sampler="random"),
                 workload=replace(fake_config(tmp_path).workload, **wl))
    off = replace(on, screen=False, storage=f"sqlite:///{tmp_path}/off.db",
                  results_dir=str(tmp_path / "off"))
    for cfg in (on, off):
        Tuner(cfg, measure=SameLoadDevice(), platform=FAKE_PLATFORM, progress=False,
              report_at_end=False).run(10)
    study_on = optuna.load_study(study_name=on.name, storage=on.storage)
    skipped = [t for t in study_on.trials if t.user_attrs.get("failure") == "predicted_dominated"]
    assert skipped, [t.user_attrs.get("failure") for t in study_on.trials]
    for t in skipped:
        assert t.params["max_num_seqs"] < 64 and "beats it beyond the noise" in t.user_attrs["failure_message"]
        assert isinstance(t.user_attrs["screened_by"], int)
        assert not t.user_attrs.get("baseline")
    # the front holds the full-slot configs either way; nothing screened is on it
    for cfg in (on, off):
        df = report.trials_frame(optuna.load_study(study_name=cfg.name, storage=cfg.storage))
        front = df[df["pareto"]]
        assert len(front) and (front["max_num_seqs"] == 64).all(), front
    df = report.trials_frame(study_on)
    assert not df[df["failure"] == "predicted_dominated"]["pareto"].any()
