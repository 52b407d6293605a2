"""A memory budget emulates a smaller card on a bigger one: vLLM's batch defaults follow the card's
memory, so a budget launch pins the small card's (search/study.py budget_pins), the defaults
baseline is the small card's, the memory model reasons about the pinned flag, and a study begun
before the pins goes on without them."""

from __future__ import annotations

from dataclasses import dataclass, replace

import optuna
import pytest

from fakes import FAKE_STUDY, FakeDevice
from tuner.config import parse_study
from tuner.engines.vllm_defaults import batch_defaults, budget_batch_defaults
from tuner.records import Platform
from tuner.search import space
from tuner.search.study import Tuner, budget_pins

GIB = 2**30
H100 = Platform("cuda", "NVIDIA H100 80GB HBM3", int(79.6 * GIB), None, ("true",), "0.24.0")
A100 = Platform("cuda", "NVIDIA A100-SXM4-80GB", int(79.2 * GIB), None, ("true",), "0.24.0")
B200 = Platform("cuda", "NVIDIA B200", int(179 * GIB), None, ("true",), "0.28.0")
CPU = Platform("cpu", "", int(23.5 * GIB), None, ("true",), "0.32.0")


def test_the_tiers_vllm_picks_by_device_memory():
    assert batch_defaults("cuda", 79.6 * GIB, "NVIDIA H100 80GB HBM3") == (8192, 1024)
    assert batch_defaults("cuda", 79.2 * GIB, "NVIDIA A100-SXM4-80GB") == (2048, 256)   # vLLM's A100 carve-out
    assert batch_defaults("cuda", 15.77 * GIB) == (2048, 256)                            # a V100 16 GB
    assert batch_defaults("cuda", 179 * GIB, "NVIDIA B200") == (16384, 1024)
    assert batch_defaults("cpu", 23.5 * GIB) == (2048, 128)
    # a budget card differs from the card at hand only across a tier
    assert budget_batch_defaults(15.77, H100) == {"max_num_batched_tokens": 2048, "max_num_seqs": 256}
    assert budget_batch_defaults(75, H100) == {}
    assert budget_batch_defaults(16, A100) == {}           # the A100 already gets the small tier
    assert budget_batch_defaults(100, B200) == {"max_num_batched_tokens": 8192, "max_num_seqs": 1024}
    assert budget_batch_defaults(8, CPU) == {}


def config(tmp_path, budget=16.0, space_extra=None, extra_args=None):
    doc = {k: (dict(v) if isinstance(v, dict) else v) for k, v in FAKE_STUDY.items()}
    doc["space"] = {**doc["space"], **(space_extra or {})}
    doc["server"] = {"memory_budget_gib": budget, **({"extra_args": extra_args} if extra_args else {})}
    return parse_study(doc, "<budget test>", {"storage": f"sqlite:///{tmp_path}/b.db",
                                              "results_dir": str(tmp_path / "results")})


def test_pins_only_what_the_study_neither_searches_nor_fixes(tmp_path):
    assert budget_pins(config(tmp_path), H100) == ("--max-num-batched-tokens", "2048")
    # max_num_seqs is searched: never pinned
    assert budget_pins(config(tmp_path, space_extra={
        "max_num_batched_tokens": {"choices": [2048, 8192]}}), H100) == ()
    assert budget_pins(config(tmp_path, extra_args=["--max-num-batched-tokens", "4096"]), H100) == ()
    assert budget_pins(config(tmp_path), H100, given={"max_num_batched_tokens"}) == ()
    assert budget_pins(config(tmp_path), A100) == ()
    assert budget_pins(config(tmp_path, budget=75), H100) == ()


@dataclass
class ArgvDevice(FakeDevice):
    """The fake device, keeping each launch's fixed flags (the launcher's argv is recorded too)."""

    launcher_argv: bool = True
    tokens_per_gmu: int = 400_000    # the budget's share of a big card is a small gmu: room anyway
    overhead_gmu: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        self.extra_args = []

    def __call__(self, spec, *args, **kwargs):
        self.extra_args.append(tuple(spec.extra_args))
        return super().__call__(spec, *args, **kwargs)


def test_a_budget_study_launches_and_exports_the_small_card_s_batch_defaults(tmp_path, caplog):
    from tuner.results import export, report

    cfg = config(tmp_path)
    device = ArgvDevice()
    study = Tuner(cfg, measure=device, platform=H100, progress=False).run(3)
    assert device.extra_args and all(a[-2:] == ("--max-num-batched-tokens", "2048")
                                     for a in device.extra_args)
    stored = study.user_attrs["config"]["extra_args"]
    assert stored[-2:] == ["--max-num-batched-tokens", "2048"]
    # the defaults baseline is the 16 GB card's: 256 sequences (snapped to the space's 64), not 1024
    defaults = next(t for t in study.trials if t.user_attrs.get("baseline") == "vllm-defaults")
    assert "batch defaults of a 16 GiB card" in defaults.user_attrs["baseline_source"]
    df = report.trials_frame(study)
    row = df[df["failure"] == ""].iloc[0]
    command = export.exported(row, study, cfg).command()
    assert "--max-num-batched-tokens 2048" in command


def test_the_memory_model_reasons_about_the_pinned_flag(tmp_path):
    cfg = config(tmp_path)
    cfg = replace(cfg, use_memory_model=True)
    pinned = Tuner(cfg, measure=FakeDevice(), platform=H100, progress=False)
    params = space.ServerParams(gpu_memory_utilization=0.2, max_model_len=4096, max_num_seqs=4)
    assert pinned.with_fixed(params).max_num_batched_tokens == 2048
    assert pinned.memory_model.resolve(pinned.with_fixed(params)).max_num_batched_tokens == 2048
    # the same study searched on the big card's own defaults: 8192 tokens a step, less KV cache
    unpinned = Tuner(cfg, measure=FakeDevice(), platform=H100, progress=False)
    unpinned.extra_args, unpinned.pins = unpinned.extra_args[:-2], ()
    assert unpinned.memory_model.resolve(unpinned.with_fixed(params)).max_num_batched_tokens == 8192
    with_pin = pinned.predict(params)
    without = unpinned.predict(params)
    assert with_pin.kv_cache_tokens > without.kv_cache_tokens


def test_a_study_begun_without_the_pins_goes_on_without_them(tmp_path, capsys):
    cfg = config(tmp_path)
    first = ArgvDevice()
    Tuner(cfg, measure=first, platform=H100, progress=False).run(2)
    # as a study stored before the pins existed: its config lists the flags without them
    study = optuna.load_study(study_name=cfg.name, storage=cfg.storage)
    summary = dict(study.user_attrs["config"])
    summary["extra_args"] = summary["extra_args"][:-2]
    study.set_user_attr("config", summary)
    later = ArgvDevice()
    Tuner(cfg, measure=later, platform=H100, progress=False).run(4)
    assert later.extra_args and all("--max-num-batched-tokens" not in a for a in later.extra_args)
    assert "began launching without --max-num-batched-tokens 2048" in capsys.readouterr().err


@pytest.mark.parametrize("platform", [CPU, A100])
def test_no_pin_where_the_card_at_hand_picks_the_same(tmp_path, platform):
    cfg = config(tmp_path, budget=8.0)
    device = ArgvDevice()
    Tuner(cfg, measure=device, platform=platform, progress=False).run(2)
    assert device.extra_args and all("--max-num-batched-tokens" not in a for a in device.extra_args)


def test_doctor_names_the_pinned_flag(tmp_path):
    from tuner.cli import doctor_budget_lines

    assert doctor_budget_lines(config(tmp_path), H100) == [
        "budget     launches add --max-num-batched-tokens 2048: vLLM's batch defaults on a 16 GiB "
        "card (this one's: 8192 batched tokens, 1024 sequences); the exported command carries them"]
    assert doctor_budget_lines(config(tmp_path), CPU) == []


def test_the_memory_model_knows_the_a100_carve_out(tmp_path):
    """vLLM gives an A100 80GB the small batch defaults; the memory model resolves them too."""
    cfg = replace(config(tmp_path, budget=60), use_memory_model=True)
    params = space.ServerParams(gpu_memory_utilization=0.5, max_model_len=4096, max_num_seqs=4)
    on_a100 = Tuner(cfg, measure=FakeDevice(), platform=A100, progress=False)
    on_h100 = Tuner(cfg, measure=FakeDevice(), platform=H100, progress=False)
    on_h100.extra_args, on_h100.pins = on_h100.extra_args[:-2], ()    # the H100's own defaults
    assert on_a100.memory_model.resolve(on_a100.with_fixed(params)).max_num_batched_tokens == 2048
    assert on_h100.memory_model.resolve(on_h100.with_fixed(params)).max_num_batched_tokens == 8192
