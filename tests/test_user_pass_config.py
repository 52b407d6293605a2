"""A new user's own study files: the mistakes a first study makes are refused with one line that
names the key and the fix, and what the file says is what is searched and measured."""

from __future__ import annotations

import copy
import random

import pytest

from tuner import config
from tuner.config import parse_study
from tuner.errors import ConfigError
from tuner.load import plan
from tuner.load.lengths import draw_lengths

DOC = {
    "study": {"name": "mine"},
    "model": {"path": "preset:tiny"},
    "server": {"extra_args": ["--enforce-eager"]},
    "space": {"gpu_memory_utilization": {"low": 0.05, "high": 0.15, "step": 0.05},
              "max_model_len": {"choices": [512, 2048]},
              "max_num_seqs": {"low": 2, "high": 16, "log": True}},
    "workload": {"prompt_tokens": 100, "output_tokens": 20},
}


def study(**sections) -> dict:
    """DOC with some sections' keys replaced (a key set to None is removed)."""
    doc = copy.deepcopy(DOC)
    for section, keys in sections.items():
        table = doc.setdefault(section, {})
        for key, value in keys.items():
            if value is None:
                table.pop(key, None)
            else:
                table[key] = value
    return doc


def refused(doc: dict) -> str:
    with pytest.raises(ConfigError) as e:
        parse_study(doc, "mine.toml", {})
    return str(e.value)


def test_the_base_study_parses():
    cfg = parse_study(study(), "mine.toml", {})
    assert cfg.dimension("max_num_seqs").log and cfg.workload.prompt_tokens == 100
    # the check of the fixed flags (--enforce-eager here) leaves the study's own name alone
    assert cfg.name == "mine" and cfg.storage == "sqlite:///studies/mine.db"


# ---------------------------------------------------------------- a flag both searched and fixed

@pytest.mark.parametrize("extra, name, spelled", [
    (["--max-num-seqs", "4"], "max_num_seqs", "--max-num-seqs"),
    (["--max-model-len=1024"], "max_model_len", "--max-model-len"),
])
def test_a_searched_flag_also_fixed_in_extra_args_is_refused(extra, name, spelled):
    # extra_args follow the searched flags on vLLM's command line, so the fixed value won at every
    # launch: each trial was recorded with a value it never ran
    msg = refused(study(server={"extra_args": ["--enforce-eager", *extra]}))
    assert f"space.{name}" in msg and spelled in msg and "extra_args" in msg


def test_a_bool_flag_searched_and_fixed_is_refused_in_either_spelling():
    space = {"enforce_eager": {"choices": [True, False]}}
    msg = refused(study(space=space))     # the demo's extra_args hold --enforce-eager
    assert "space.enforce_eager" in msg and "--enforce-eager" in msg
    msg = refused(study(space=space, server={"extra_args": ["--no-enforce-eager"]}))
    assert "--no-enforce-eager" in msg
    assert parse_study(study(space=space, server={"extra_args": []}), "mine.toml", {}).dimension("enforce_eager")


def test_measure_refuses_a_value_the_study_fixes_otherwise_and_takes_the_same_one():
    with pytest.raises(ConfigError) as e:
        config.check_flag_values({"kv_cache_dtype": "fp8"}, "command line",
                                 ("--kv-cache-dtype", "auto"))
    assert "--kv-cache-dtype" in str(e.value) and "extra_args" in str(e.value)
    config.check_flag_values({"kv_cache_dtype": "auto", "enforce_eager": True}, "command line",
                             ("--kv-cache-dtype", "auto", "--enforce-eager"))


# ---------------------------------------------------------------- ranges whose high is not on a step

@pytest.mark.parametrize("name, spec, last", [
    ("gpu_memory_utilization", {"low": 0.1, "high": 0.2, "step": 0.3}, "0.1"),
    ("gpu_memory_utilization", {"low": 0.5, "high": 0.95, "step": 0.1}, "0.9"),
    ("max_num_seqs", {"low": 1, "high": 256, "step": 2}, "255"),
    ("max_model_len", {"low": 1000, "high": 2000, "step": 3000}, "1000"),
])
def test_a_range_whose_high_is_off_its_steps_is_refused_with_the_last_value(name, spec, last):
    # Optuna lowers such a high silently: the values written were not the values searched
    msg = refused(study(space={name: spec}))
    assert f"space.{name}" in msg and f"stop at {last}" in msg and f"set high = {last}" in msg


@pytest.mark.parametrize("spec", [{"low": 0.04, "high": 0.2, "step": 0.01},
                                  {"low": 0.5, "high": 0.95, "step": 0.01},
                                  {"low": 0.6, "high": 0.95, "step": 0.05},
                                  {"low": 0.2, "high": 0.2, "step": 0.1}])
def test_ranges_on_their_steps_pass_floating_point_and_all(spec):
    cfg = parse_study(study(space={"gpu_memory_utilization": spec}), "mine.toml", {})
    assert cfg.dimension("gpu_memory_utilization").high == spec["high"]


# ---------------------------------------------------------------- the workload

def test_a_uniform_mix_of_the_prompt_alone_keeps_the_output_fixed():
    wl = {"length_mix": "uniform", "prompt_tokens_mix": [50, 150]}
    cfg = parse_study(study(workload=wl), "mine.toml", {})
    lengths = draw_lengths(cfg.workload, 50, random.Random(0))
    assert {o for _, o in lengths} == {20} and len({p for p, _ in lengths}) > 5
    cfg = parse_study(study(workload={"length_mix": "normal", "output_tokens_mix": [20, 5]}),
                      "mine.toml", {})
    assert {p for p, _ in draw_lengths(cfg.workload, 20, random.Random(0))} == {100}


def test_an_empty_levels_list_is_refused_not_read_as_the_default_ladder():
    msg = refused(study(workload={"levels": []}))
    assert "workload.levels" in msg and "empty" in msg


@pytest.mark.parametrize("old, new", [("concurrency", "levels"), ("request_rate", "request_rates")])
def test_an_old_spelling_beside_the_new_one_is_refused(old, new):
    values = {"concurrency": 8, "levels": [4, 16], "request_rate": 2.0, "request_rates": [1.0]}
    msg = refused(study(workload={old: values[old], new: values[new]}))
    assert f"workload.{old}" in msg and new in msg


@pytest.mark.parametrize("key", ["ttft_ms", "tpot_ms", "e2e_ms"])
@pytest.mark.parametrize("value", [0, -5.0])
def test_an_slo_of_zero_or_less_is_refused(key, value):
    # no request meets it: every config would end slo_not_met after a full launch
    msg = refused(study(slo={key: value}))
    assert f"slo.{key}" in msg and "> 0" in msg


def test_the_reason_a_mix_is_too_long_reads_after_the_context():
    cfg = parse_study(study(workload={"length_mix": "uniform", "prompt_tokens_mix": [10, 4000]}),
                      "mine.toml", {})
    share, why = plan.context_too_short(cfg.workload, 1024)
    said = f"max_model_len 1024 < {why}"
    assert 0 < share < 1 and said.startswith("max_model_len 1024 < the longest ")
    assert "length mix (more than max_failed_share 0.05)" in said


# ---------------------------------------------------------------- typos

@pytest.mark.parametrize("section, key, meant", [
    ("space", "max_num_seq", "max_num_seqs"),
    ("workload", "prompt_token", "prompt_tokens"),
    ("study", "replicate", "replicates"),
])
def test_a_key_one_typo_away_names_the_key_meant(section, key, meant):
    value = {"low": 1, "high": 8} if section == "space" else 64
    msg = refused(study(**{section: {key: value}}))
    assert f"{section}.{key}" in msg and f"did you mean {meant}?" in msg


# ---------------------------------------------------------------- a model folder without a tokenizer

def shape_folder(tmp_path, *files):
    """A model shape copied for what-if tuning: config.json (and the files named), no weights."""
    import json
    import shutil

    from tuner.models.presets import TINY_MODEL

    folder = tmp_path / "shape"
    folder.mkdir()
    shutil.copy(TINY_MODEL / "config.json", folder)
    for name in files:
        (folder / name).write_text(json.dumps({}))
    return folder


@pytest.mark.parametrize("files, extra, refused_", [
    ((), (), True),
    ((), ("--tokenizer", "org/name"), False),
    ((), ("--tokenizer=/models/tok",), False),
    (("tokenizer.json",), (), False),
    (("tokenizer.model",), (), False),
    (("vocab.json", "merges.txt"), (), False),
    (("tekken.json",), (), False),
    (("generation_config.json",), (), True),
])
def test_a_folder_without_a_tokenizer_is_a_problem_unless_one_is_named(tmp_path, files, extra, refused_):
    from tuner.models import checkpoint

    problem = checkpoint.tokenizer_problem(str(shape_folder(tmp_path, *files)), extra)
    assert (problem is not None) == refused_
    if refused_:
        assert "no tokenizer" in problem and "--tokenizer" in problem


def test_run_refuses_a_folder_without_a_tokenizer_before_any_launch(tmp_path):
    # before: every launch crashed in vLLM's tokenizer load, --trials times over, each said
    # only as "crashed"
    import os
    import subprocess
    import sys

    import faultkit as fk

    folder = shape_folder(tmp_path)
    for command in (["run", "--trials", "3"],
                    ["measure", "--gpu-memory-utilization", "0.1", "--max-model-len", "1024",
                     "--max-num-seqs", "2"]):
        p = subprocess.run([sys.executable, "-m", "tuner", *command, "--model", str(folder),
                            "--storage", f"sqlite:///{tmp_path}/db/s.db", "--results",
                            str(tmp_path / "results")], cwd=fk.REPO, capture_output=True, text=True,
                           timeout=120, env={**os.environ, "PYTHONPATH": str(fk.REPO)})
        assert p.returncode == 2, p.stderr
        errors = [ln for ln in p.stderr.splitlines() if ln.startswith("tuner: error: ")]
        assert len(errors) == 1 and "holds no tokenizer" in errors[0], p.stderr
        assert not (tmp_path / "results").exists() and not (tmp_path / "db").exists()
    p = subprocess.run([sys.executable, "-m", "tuner", "doctor", "--model", str(folder), "--storage",
                        f"sqlite:///{tmp_path}/db/s.db", "--results", str(tmp_path / "results")],
                       cwd=fk.REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "model      PROBLEM: " in p.stdout and "no tokenizer" in p.stdout


@pytest.mark.parametrize("engine", ["llamacpp", "sglang"])
def test_a_chat_workload_on_an_engine_whose_tokenize_counts_no_chat_is_refused(engine):
    # before: the study launched a server, then stopped at prompt building, a launch spent per run
    from tuner import engines

    space = {"llamacpp": {"ctx_size": {"choices": [1024]}, "parallel": {"choices": [1, 2]}},
             "sglang": {"mem_fraction_static": {"choices": [0.8]},
                        "context_length": {"choices": [1024]},
                        "max_running_requests": {"choices": [2]}}}[engine]
    doc = {"study": {"name": "chat"}, "model": {"path": "preset:tiny"},
           "server": {"engine": engine}, "space": space,
           "workload": {"prompt_tokens": 64, "output_tokens": 8, "endpoint": "chat"}}
    try:
        msg = refused(doc)
        assert "workload.endpoint" in msg and "completions" in msg
        doc["workload"]["endpoint"] = "completions"
        assert parse_study(doc, "chat.toml", {}).engine_name == engine
    finally:
        engines.use("vllm")


@pytest.mark.parametrize("workload, words", [
    ({"length_trace": "example"}, ["workload.length_trace", "length_mix is 'fixed'",
                                   "set length_mix = \"trace\""]),
    ({"length_mix": "trace"}, ["workload.length_trace", "missing", "\"example\""]),
    ({"prompt_tokens_mix": [10, 40]}, ["workload.prompt_tokens_mix", "length_mix is 'fixed'",
                                       "set length_mix = \"uniform\" or \"normal\""]),
    ({"length_mix": "trace", "length_trace": "example", "output_tokens_mix": [5, 9]},
     ["workload.output_tokens_mix", "length_mix is 'trace'"]),
])
def test_a_half_given_length_mix_says_which_key_to_set(workload, words):
    # before: "a trace mix takes length_trace = FILE, and only it does" / "a fixed mix takes no
    # parameters", which named no key to set
    msg = refused(study(workload=workload))
    for w in words:
        assert w in msg, (w, msg)
