"""Review of the day's user passes: defects found in the new refusals and stops, each pinned."""

from __future__ import annotations

import re

import pytest


# ---------------------------------------------------------------- three alike launch failures

def _crashed_study(messages_and_params):
    """An in-memory study whose launches crashed with these (message, params) in order."""
    import optuna
    from optuna.distributions import CategoricalDistribution, FloatDistribution

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    dists = {"gpu_memory_utilization": FloatDistribution(0.1, 0.9, step=0.1),
             "max_num_seqs": CategoricalDistribution([1, 4, 16, 64]),
             "kv_cache_dtype": CategoricalDistribution(["auto", "fp8"])}
    study = optuna.create_study(directions=["maximize", "maximize", "minimize"])
    for message, params in messages_and_params:
        study.add_trial(optuna.trial.create_trial(
            params=params, distributions={k: dists[k] for k in params},
            values=[0.0, 0.0, 1e9],
            user_attrs={"failure": "crashed", "failure_message": message}))
    return study


def test_crashes_that_name_each_configs_own_values_are_not_config_blind():
    """Numbers are masked when messages are compared, so three configs that vLLM refused each for
    its own searched value ("max_num_seqs (64) ...", "(16)", "(256)") read as one failure "whatever
    their flags" and stopped the study, telling the user to fix extra_args or the model."""
    from tuner.search.study import same_launch_failures

    said = "(EngineCore pid={pid}) ValueError: max_num_seqs ({s}) is more than the attention backend holds"
    study = _crashed_study([
        (said.format(pid=101, s=64), {"gpu_memory_utilization": 0.5, "max_num_seqs": 64}),
        (said.format(pid=202, s=16), {"gpu_memory_utilization": 0.7, "max_num_seqs": 16}),
        (said.format(pid=303, s=4), {"gpu_memory_utilization": 0.9, "max_num_seqs": 4}),
    ])
    assert same_launch_failures(study) == []
    # a searched choice the engine refuses, named in its own words (another case)
    study = _crashed_study([
        ("NotImplementedError: FP8 KV cache is not supported on the CPU backend",
         {"max_num_seqs": s, "kv_cache_dtype": "fp8"}) for s in (1, 4, 16)])
    assert same_launch_failures(study) == []


def test_crashes_alike_but_for_pids_still_stop_the_study():
    from tuner.search.study import same_launch_failures

    said = "(EngineCore pid={pid}) OSError: /models/x does not appear to have a file named tokenizer.json"
    study = _crashed_study([
        (said.format(pid=pid), {"gpu_memory_utilization": g, "max_num_seqs": s})
        for pid, g, s in ((101, 0.5, 64), (202, 0.7, 16), (303, 0.9, 4))])
    assert len(same_launch_failures(study)) == 3


# ---------------------------------------------------------------- show --all-columns

def test_all_columns_print_whole_numbers_whole_not_in_six_digits():
    """A column a failed trial leaves blank turns float, and 6 significant digits printed a GPU's
    KV cache of 1,234,567 tokens as 1.23457e+06 and a server's pgid 4194301 as 4.1943e+06: not
    the figure, and not a pid one can kill."""
    import pandas as pd

    from tuner.results import report

    df = pd.DataFrame({"trial": [0, 1], "state": ["COMPLETE", "COMPLETE"],
                       "failure": ["", "no_cache_blocks"],
                       "kv_cache_tokens": [1234567.0, float("nan")],
                       "server_pgid": [4194301.0, float("nan")],
                       "device_memory_bytes": [85520809984.0, 85520809984.0],
                       "kv_cache_gib": [21.123456789, float("nan")]})
    text = report.all_columns_text(df)
    assert "1.23457e+06" not in text and "e+" not in text, text
    assert re.search(r"^  kv_cache_tokens +1234567$", text, re.M), text
    assert re.search(r"^  server_pgid +4194301$", text, re.M), text
    assert re.search(r"^  device_memory_bytes +85520809984$", text, re.M), text
    assert re.search(r"^  kv_cache_gib +21\.1235$", text, re.M), text   # a fraction keeps 6 digits


# ---------------------------------------------------------------- a flag searched and fixed

LLAMA_DOC = {
    "study": {"name": "mine"},
    "model": {"path": "preset:tiny"},
    "server": {"engine": "llamacpp", "extra_args": ["-t", "2"]},
    "space": {"ctx_size": {"choices": [512, 1024]}, "parallel": {"choices": [1, 2]},
              "kv_unified": {"choices": [False, True]}},
    "workload": {"prompt_tokens": 16, "output_tokens": 8},
}


@pytest.mark.parametrize("extra, name", [
    (["--ctx-size", "4096"], "ctx_size"),
    (["--parallel=4"], "parallel"),
    (["-kvu"], "kv_unified"),
])
def test_a_llamacpp_flag_fixed_in_its_long_spelling_is_refused_too(extra, name):
    """llama-server takes -c and --ctx-size alike (the last one given wins), and the table knew
    only -c: a study searching ctx_size with --ctx-size 4096 in extra_args ran 4096 at every launch
    and recorded the searched values, the very case the new refusal is for."""
    import copy

    from tuner import engines
    from tuner.config import parse_study
    from tuner.errors import ConfigError

    doc = copy.deepcopy(LLAMA_DOC)
    doc["server"]["extra_args"] += extra
    try:
        with pytest.raises(ConfigError) as e:
            parse_study(doc, "mine.toml", {})
        assert f"space.{name}" in str(e.value) and extra[0].partition("=")[0] in str(e.value)
        # the base study (-t 2 fixed, nothing searched fixed) parses
        assert parse_study(copy.deepcopy(LLAMA_DOC), "mine.toml", {}).engine_name == "llamacpp"
    finally:
        engines.use("vllm")


def test_measure_takes_a_llamacpp_value_fixed_in_its_long_spelling_when_it_is_the_same():
    from tuner import config, engines

    engines.use("llamacpp")
    try:
        config.check_flag_values({"ctx_size": 4096}, "command line", ("--ctx-size", "4096"))
        with pytest.raises(config.ConfigError):
            config.check_flag_values({"ctx_size": 2048}, "command line", ("--ctx-size", "4096"))
        config.check_flag_values({"kv_unified": True}, "command line", ("-kvu",))
    finally:
        engines.use("vllm")


def test_a_vllm_flag_fixed_with_underscores_is_refused_too():
    # vLLM's parser takes --max_num_seqs as --max-num-seqs: the searched value never ran
    from fakes import FAKE_STUDY

    from tuner.config import ConfigError, parse_study

    doc = {k: (dict(v) if isinstance(v, dict) else v) for k, v in FAKE_STUDY.items()}
    doc["server"] = {"extra_args": ["--max_num_seqs", "8"]}
    with pytest.raises(ConfigError, match=r"space.max_num_seqs: also fixed in \[server\] extra_args "
                                          r"\(--max_num_seqs\)"):
        parse_study(doc, "<test>", {"storage": "sqlite:///:memory:", "results_dir": "/tmp/r"})
