"""The seam: every searchable flag is one row of the engine's table, and adding a row is all a new flag needs."""

import pandas as pd
import pytest

from tuner import cli, engines
from tuner.results import export, report
from tuner.search import space
from tuner.config import parse_study
from tuner.engines import vllm
from tuner.engines.base import Flag
from tuner.errors import ConfigError
from tuner.run.process import LaunchSpec, build_argv

SPACE = {"gpu_memory_utilization": {"low": 0.1, "high": 0.5},
         "max_model_len": {"choices": [1024, 2048]}, "max_num_seqs": {"low": 1, "high": 8}}


def study(space_table: dict) -> dict:
    return {"model": {"path": "preset:tiny"}, "space": space_table}


@pytest.fixture
def new_flag(monkeypatch):
    """A flag vLLM does not have, added the way a real one would be: one row."""
    row = Flag("max_loras", "int", "--max-loras", default=1, memory="equal", low=1, high=64,
               hand_tuned=2, help="adapters resident at once")
    monkeypatch.setattr(vllm, "FLAGS", vllm.FLAGS + (row,))
    return row


def test_table_rows_are_well_formed():
    names = [f.name for f in engines.flags()]
    assert names == list(space.ServerParams.__dataclass_fields__)[:len(names)]
    for f in engines.flags():
        assert f.kind in ("float", "int", "bool", "str")
        assert f.cli == "--" + f.name.replace("_", "-")
        assert f.memory in ("", "supply", "demand", "equal")
    assert [f.name for f in engines.flags() if f.required] == [
        "gpu_memory_utilization", "max_model_len", "max_num_seqs"]


def test_one_generic_function_spells_every_flag():
    p = space.ServerParams(0.5, 1024, 2, 4096, True, "fp8")
    assert p.vllm_flags() == ["--gpu-memory-utilization", "0.5", "--max-model-len", "1024",
                              "--max-num-seqs", "2", "--max-num-batched-tokens", "4096",
                              "--enforce-eager", "--kv-cache-dtype", "fp8"]
    assert space.ServerParams(enforce_eager=False).vllm_flags() == []


def test_a_new_row_is_searchable_launched_reported_and_offered(new_flag):
    cfg = parse_study(study({**SPACE, "max_loras": {"low": 1, "high": 8}}), "s.toml", {})
    dim = cfg.dimension("max_loras")
    assert (dim.kind, dim.low, dim.high) == ("int", 1, 8)

    with pytest.raises(ConfigError, match=r"max_loras must be an integer in \[1, 64\], got 65"):
        parse_study(study({**SPACE, "max_loras": {"low": 1, "high": 65}}), "s.toml", {})

    params = space.params_from({"gpu_memory_utilization": 0.3, "max_model_len": 1024,
                                "max_num_seqs": 4, "max_loras": 3})
    assert params.value("max_loras") == 3 and params.values()["max_loras"] == 3
    assert params.vllm_flags()[-2:] == ["--max-loras", "3"]
    argv = build_argv(LaunchSpec(model="m", params=params), ("vllm", "serve"), 8000)
    assert argv[argv.index("--max-loras") + 1] == "3"

    assert "max_loras" in report.param_columns()
    row = pd.Series({"trial": 0, "gpu_memory_utilization": 0.3, "max_model_len": 1024.0,
                     "max_num_seqs": 4.0, "max_loras": 3.0})
    assert export.launch_params(row).value("max_loras") == 3

    args = cli.build_parser().parse_args(["measure", "--gpu-memory-utilization", "0.2",
                                          "--max-model-len", "2048", "--max-num-seqs", "4",
                                          "--max-loras", "5"])
    assert args.max_loras == 5


def test_a_new_row_is_checked_in_baselines_and_fixed_flags(new_flag):
    from tuner.config import fixed_flag_values

    assert fixed_flag_values(["--max-loras", "4"]) == {"max_loras": 4}
    with pytest.raises(ConfigError, match="max_loras"):
        fixed_flag_values(["--max-loras=0"], "s.toml")
    doc = {**study(SPACE), "baselines": [{"name": "b", "max_loras": 2, "max_num_seqs": 2}]}
    assert dict(parse_study(doc, "s.toml", {}).baselines[0].values)["max_loras"] == 2


def test_known_infeasible_reads_memory_roles_from_the_table(new_flag):
    """A KV failure rules out configs with less memory and more context, only when the table's
    "equal" flags (here the new one) agree."""
    from types import SimpleNamespace

    from optuna.trial import TrialState

    from tuner.search.study import Tuner

    failed = SimpleNamespace(user_attrs={"failure": "kv_cache_too_small"}, number=0,
                             params={"gpu_memory_utilization": 0.3, "max_model_len": 2048,
                                     "max_num_seqs": 4, "max_loras": 2})
    fake_study = SimpleNamespace(get_trials=lambda deepcopy, states: [failed]
                                 if TrialState.COMPLETE in states else [])
    tuner = object.__new__(Tuner)

    def probe(**values):
        base = {"gpu_memory_utilization": 0.2, "max_model_len": 4096, "max_num_seqs": 8,
                "max_loras": 2}
        return tuner.known_infeasible(fake_study, space.params_from({**base, **values}))

    assert probe() is failed                                   # less memory, longer context
    assert probe(gpu_memory_utilization=0.4) is None           # more memory: may fit
    assert probe(max_model_len=1024) is None                   # shorter context: may fit
    assert probe(max_loras=3) is None                          # an "equal" flag differs


def test_cpu_offload_gb_is_an_optional_searched_flag():
    cfg = parse_study(study({**SPACE, "cpu_offload_gb": {"low": 0, "high": 8, "step": 2}}), "t.toml",
                      {"storage": "sqlite:///:memory:"})
    dim = cfg.dimension("cpu_offload_gb")
    assert (dim.kind, dim.low, dim.high, dim.step) == ("float", 0.0, 8.0, 2)
    p = space.params_from({"gpu_memory_utilization": 0.3, "max_model_len": 1024, "max_num_seqs": 4,
                           "cpu_offload_gb": 4.0})
    assert p.cpu_offload_gb == 4.0 and p.extra == ()       # a named field: the memory model reads it
    assert p.vllm_flags()[-2:] == ["--cpu-offload-gb", "4"]
    flag = engines.flag("cpu_offload_gb")
    assert (flag.memory, flag.default, flag.hand_tuned, flag.required) == ("supply", 0.0, 0.0, False)
    assert flag.problem(-1.0) and flag.problem(float("inf")) and flag.problem(0.0) is None
    # unsearched it is absent from the command line (vLLM's 0), and a fixed one is read back
    assert "--cpu-offload-gb" not in space.params_from({"max_model_len": 1024}).vllm_flags()
    from tuner.config import fixed_flag_values

    assert fixed_flag_values(["--cpu-offload-gb", "12"]) == {"cpu_offload_gb": 12.0}


def test_vllm_engine_core_is_forked_unless_the_user_says_otherwise(monkeypatch):
    # vLLM's CLI would spawn it: a new interpreter re-importing torch and vLLM on every launch
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    assert vllm.ENGINE.env() == {"VLLM_WORKER_MULTIPROC_METHOD": "fork"}
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    assert vllm.ENGINE.env() == {}
