"""Bad input to `python -m tuner run`: exit code 2, one line on stderr naming the problem and the
fix, nothing written (no results folder, no database) and nothing launched."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import faultkit as fk

# An engine that leaves a mark if it is ever started.
ENGINE = "import pathlib, sys; pathlib.Path(sys.argv[0]).with_name('LAUNCHED').touch()"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return fk.private_model(tmp_path_factory.mktemp("model"))


def good_doc(tmp_path, model) -> dict:
    engine = tmp_path / "engine.py"
    engine.write_text(ENGINE)
    doc = fk.fake_engine_study(model, engine=(sys.executable, str(engine)))
    doc["study"]["name"] = "bad"
    return doc


def run_cli(tmp_path, study_text: str | None = None, extra: list[str] = (), results=None,
            storage=None):
    study = tmp_path / "study.toml"
    if study_text is not None:
        study.write_text(study_text)
    results = results or tmp_path / "results"
    storage = storage or f"sqlite:///{tmp_path}/db/bad.db"
    argv = [sys.executable, "-m", "tuner", "run", "--study", str(study), "--trials", "2",
            "--results", str(results), "--storage", storage, *extra]
    p = subprocess.run(argv, cwd=fk.REPO, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(fk.REPO)})
    return p


def assert_refused(tmp_path, p, *words, results=None):
    assert p.returncode == 2, p.stderr
    # the one notice a weightless model folder earns ("served with --load-format dummy") may come first
    lines = [ln for ln in p.stderr.strip().splitlines()
             if not (ln.startswith("model ") and ln.endswith("the text is not)"))]
    assert len(lines) == 1, p.stderr
    line = lines[0]
    assert line.startswith("tuner: error: ")
    for w in words:
        assert w in line, (w, line)
    assert p.stdout == ""
    if results is None:
        assert not (tmp_path / "results").exists()         # no results folder
    assert not (tmp_path / "db").exists()                 # no database, not even its folder
    assert not (tmp_path / "LAUNCHED").exists()            # the engine never ran
    return line


def with_(doc: dict, table: str, **values) -> dict:
    doc = json.loads(json.dumps(doc))
    doc.setdefault(table, {}).update(values)
    return doc


# ---------------------------------------------------------------- the study file


def test_the_good_study_runs(tmp_path, model):
    # the baseline every case below spoils: it gets as far as launching the engine
    p = run_cli(tmp_path, fk.to_toml(good_doc(tmp_path, model)))
    assert (tmp_path / "LAUNCHED").exists(), p.stderr


def test_malformed_toml(tmp_path, model):
    text = fk.to_toml(good_doc(tmp_path, model)).replace("[space]", "[space")
    line = assert_refused(tmp_path, run_cli(tmp_path, text), "study.toml", "malformed TOML", "line")
    assert "line" in line


def test_study_file_missing(tmp_path):
    assert_refused(tmp_path, run_cli(tmp_path, None), "study file not found", "--study")


@pytest.mark.parametrize("table,key,value,words", [
    ("server", "hots", "0.0.0.0", ["server.hots", "unknown key", "host"]),
    ("workload", "prompt_token", 8, ["workload.prompt_token", "unknown key", "prompt_tokens"]),
    ("study", "trials", 3, ["study.trials", "unknown key"]),
])
def test_unknown_keys(tmp_path, model, table, key, value, words):
    doc = with_(good_doc(tmp_path, model), table, **{key: value})
    assert_refused(tmp_path, run_cli(tmp_path, fk.to_toml(doc)), *words)


@pytest.mark.parametrize("dim,spec,words", [
    ("gpu_memory_utilization", {"low": 0.0, "high": 0.5}, ["space.gpu_memory_utilization.low", "(0, 1]"]),
    ("gpu_memory_utilization", {"low": -0.2, "high": 0.5}, ["gpu_memory_utilization", "(0, 1]"]),
    ("gpu_memory_utilization", {"low": 0.5, "high": 1.5}, ["space.gpu_memory_utilization.high", "(0, 1]"]),
    ("gpu_memory_utilization", {"choices": [0.5, 1.2]}, ["gpu_memory_utilization", "1.2"]),
    ("max_model_len", {"low": -1024, "high": 4096}, ["space.max_model_len.low", "positive"]),
    ("max_num_seqs", {"choices": [0, 4]}, ["space.max_num_seqs", "positive"]),
    ("max_model_len", {"low": 4096, "high": 1024}, ["space.max_model_len", "empty range"]),
    ("max_num_seqs", {"choices": []}, ["space.max_num_seqs.choices", "empty"]),
    ("max_num_seqs", {"low": 1, "high": 8, "step": 0}, ["space.max_num_seqs.step", "> 0"]),
    ("cpu_offload_gb", {"low": -4.0, "high": 8.0}, ["space.cpu_offload_gb.low", "[0, inf)", "-4"]),
    ("cpu_offload_gb", {"choices": [0, "lots"]}, ["space.cpu_offload_gb.choices", "'lots'"]),
])
def test_out_of_range_space(tmp_path, model, dim, spec, words):
    doc = good_doc(tmp_path, model)
    doc["space"][dim] = spec
    assert_refused(tmp_path, run_cli(tmp_path, fk.to_toml(doc)), *words)


@pytest.mark.parametrize("table,key,value,words", [
    ("workload", "prompt_tokens", -8, ["workload.prompt_tokens", ">= 1"]),
    ("workload", "output_tokens", 0, ["workload.output_tokens", ">= 1"]),
    ("workload", "request_timeout_s", -1.0, ["workload.request_timeout_s", "> 0"]),
    ("server", "launch_timeout_s", 0.0, ["server.launch_timeout_s", "> 0"]),
    ("server", "extra_args", ["--api-key", "sk-123"], ["server.extra_args", "VLLM_API_KEY"]),
    ("study", "name", "my study", ["study.name", "letters"]),
    ("study", "patience", -3, ["study.patience", ">= 0"]),
    ("slo", "min_roofline_share", 1.5, ["slo.min_roofline_share", "[0, 1)", "1.5"]),
    ("slo", "min_roofline_share", -0.1, ["slo.min_roofline_share", "[0, 1)"]),
    ("workload", "max_failed_share", 1.5, ["workload.max_failed_share", "below 1", "1.5"]),
    ("server", "memory_budget_gib", float("nan"), ["server.memory_budget_gib", "finite", "nan"]),
    ("workload", "request_timeout_s", float("inf"), ["workload.request_timeout_s", "finite"]),
    ("study", "seed", 2**32, ["study.seed", "2**32 - 1"]),
])
def test_out_of_range_values(tmp_path, model, table, key, value, words):
    doc = with_(good_doc(tmp_path, model), table, **{key: value})
    line = assert_refused(tmp_path, run_cli(tmp_path, fk.to_toml(doc)), *words)
    assert "sk-123" not in line


def test_secret_in_the_study_file_is_refused_but_settings_are_not(tmp_path, model):
    doc = good_doc(tmp_path, model)
    doc["server"]["env"]["HF_TOKEN"] = "hf_abc"
    line = assert_refused(tmp_path, run_cli(tmp_path, fk.to_toml(doc)), "server.env.HF_TOKEN",
                          "export it")
    assert "hf_abc" not in line
    from tuner.config import parse_study

    doc = good_doc(tmp_path, model)
    doc["server"]["env"]["TOKENIZERS_PARALLELISM"] = "false"
    assert dict(parse_study(doc, "x", {}).env)["TOKENIZERS_PARALLELISM"] == "false"


def test_model_path_that_does_not_exist(tmp_path, model):
    doc = with_(good_doc(tmp_path, model), "model", path=str(tmp_path / "no-such-model"))
    assert_refused(tmp_path, run_cli(tmp_path, fk.to_toml(doc)), "no-such-model", "does not exist",
                   "preset:")


@pytest.mark.parametrize("engine", [["no-such-vllm-binary", "serve"], ["/opt/nowhere/bin/vllm", "serve"]])
def test_engine_that_is_not_installed(tmp_path, model, engine):
    doc = with_(good_doc(tmp_path, model), "server", engine=engine)
    assert_refused(tmp_path, run_cli(tmp_path, fk.to_toml(doc)), engine[0], "not installed",
                   "engine")


def test_engine_on_the_command_line_that_is_not_installed(tmp_path, model):
    p = run_cli(tmp_path, fk.to_toml(good_doc(tmp_path, model)), ["--engine", "nope-vllm serve"])
    assert_refused(tmp_path, p, "nope-vllm", "not installed")


# ---------------------------------------------------------------- where results and the study go


@pytest.mark.parametrize("where", ["under-a-file", "read-only-filesystem"])
def test_unwritable_results_folder(tmp_path, model, where):
    if where == "under-a-file":
        (tmp_path / "afile").write_text("")
        results = tmp_path / "afile" / "results"
    else:
        results = Path("/sys/tuner-results")
    p = run_cli(tmp_path, fk.to_toml(good_doc(tmp_path, model)), results=results)
    assert_refused(tmp_path, p, str(results), "not writable", "--results", results=results)
    assert not results.exists()


@pytest.mark.parametrize("url,words", [
    ("bogus://nowhere/x", ["bogus://nowhere/x", "cannot be opened", "--storage"]),
    ("sqlite:////sys/tuner/x.db", ["sqlite:////sys/tuner/x.db", "cannot be opened", "--storage"]),
    ("postgresql://tuner@127.0.0.1:1/tuner", ["postgresql://", "cannot be opened", "--storage"]),
])
def test_storage_that_cannot_be_opened(tmp_path, model, url, words):
    p = run_cli(tmp_path, fk.to_toml(good_doc(tmp_path, model)), storage=url)
    assert_refused(tmp_path, p, *words)


def test_results_folder_of_another_study(tmp_path, model):
    folder = tmp_path / "results" / "bad"
    folder.mkdir(parents=True)
    owner = json.dumps({"study": "bad", "storage": "sqlite:///elsewhere/other.db"})
    (folder / "study.json").write_text(owner)
    p = run_cli(tmp_path, fk.to_toml(good_doc(tmp_path, model)))
    assert_refused(tmp_path, p, str(folder), "belongs to", "--results", results=tmp_path / "results")
    assert (folder / "study.json").read_text() == owner       # left as it was
    assert os.listdir(folder) == ["study.json"]


# ---------------------------------------------------------------- the command line


@pytest.mark.parametrize("args,words", [
    (["--trials", "0"], ["--trials", "at least 1"]),
    (["--trials", "many"], ["--trials", "whole number"]),
    (["--sampler", "magic"], ["--sampler", "invalid choice"]),
    (["--launch-timeout", "0"], ["command line: --launch-timeout: must be > 0"]),
    (["--launch-timeout", "soon"], ["--launch-timeout", "expected a number", "soon"]),
    (["--memory-budget-gib", "-16"], ["command line: --memory-budget-gib: must be > 0"]),
    (["--name", "a/b"], ["study.name"]),
    (["--patience", "-1"], ["study.patience", ">= 0"]),
    (["--memory-budget-gib", "nan"], ["--memory-budget-gib", "finite", "'nan'"]),
    (["--seed", "-1"], ["--seed", "0 or more"]),
    (["--first-worker", "-1"], ["--first-worker", "0 or more"]),
    (["--host", "999.1.1.1"], ["--host 999.1.1.1", "resolves"]),
])
def test_bad_command_line_values(tmp_path, model, args, words):
    p = run_cli(tmp_path, fk.to_toml(good_doc(tmp_path, model)), args)
    assert_refused(tmp_path, p, *words)


# ---------------------------------------------------------------- values vLLM or the model rule out


def run_measure(tmp_path, doc: dict, args: list[str]):
    """`python -m tuner measure` from tmp_path, so its default results/ and studies/ land there."""
    study = tmp_path / "study.toml"
    study.write_text(fk.to_toml(doc))
    argv = [sys.executable, "-m", "tuner", "measure", "--study", str(study), *args]
    return subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(fk.REPO)})


def assert_measure_refused(tmp_path, p, *words):
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tuner: error: "), p.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert p.stdout == ""
    assert not (tmp_path / "results").exists() and not (tmp_path / "studies").exists()
    assert not (tmp_path / "LAUNCHED").exists()
    return lines[0]


GOOD = ["--gpu-memory-utilization", "0.2", "--max-model-len", "512", "--max-num-seqs", "2"]


def flags(**changes) -> list[str]:
    out = list(GOOD)
    for key, value in changes.items():
        flag = "--" + key.replace("_", "-")
        if flag in out:
            out[out.index(flag) + 1] = value
        else:
            out += [flag, value]
    return out


def test_a_good_measure_launches(tmp_path, model):
    p = run_measure(tmp_path, good_doc(tmp_path, model), GOOD)
    assert (tmp_path / "LAUNCHED").exists(), p.stderr


@pytest.mark.parametrize("changes,words", [
    ({"gpu_memory_utilization": "1.7"}, ["--gpu-memory-utilization", "1.7", "(0, 1]"]),
    ({"gpu_memory_utilization": "0"}, ["--gpu-memory-utilization", "(0, 1]"]),
    ({"gpu_memory_utilization": "-0.5"}, ["-0.5", "(0, 1]"]),
    ({"gpu_memory_utilization": "nan"}, ["--gpu-memory-utilization", "'nan'", "finite"]),
    ({"gpu_memory_utilization": "lots"}, ["--gpu-memory-utilization", "lots"]),
    ({"max_model_len": "1000000"}, ["--max-model-len", "1000000", "1..32768",
                                    "max_position_embeddings"]),
    ({"max_model_len": "4k"}, ["--max-model-len", "4k", "whole number"]),
    ({"max_num_seqs": "0"}, ["--max-num-seqs", "at least 1"]),
    ({"kv_cache_dtype": "fp9"}, ["--kv-cache-dtype", "'fp9'", "fp8_e5m2"]),
    ({"cpu_offload_gb": "-2"}, ["--cpu-offload-gb", "-2", "[0, inf)"]),
    ({"cpu_offload_gb": "inf"}, ["--cpu-offload-gb", "'inf'", "finite"]),
    ({"max_model_len": "8"}, ["max_model_len 8 <", "8 + 4 tokens per request", "refused for length"]),
    ({"cpu_offload_gb": "some"}, ["--cpu-offload-gb", "expected a number", "'some'"]),
    ({"max_num_batched_tokens": "1"}, ["--max-num-batched-tokens", "max_num_batched_tokens 1",
                                       "max_num_seqs 2"]),
])
def test_measure_refuses_bad_values_before_launch(tmp_path, model, changes, words):
    p = run_measure(tmp_path, good_doc(tmp_path, model), flags(**changes))
    assert_measure_refused(tmp_path, p, *words)


def test_batched_tokens_below_the_context_only_without_chunked_prefill(tmp_path, model):
    doc = good_doc(tmp_path, model)
    doc["server"]["extra_args"] = ["--no-enable-chunked-prefill"]
    p = run_measure(tmp_path, doc, flags(max_num_batched_tokens="256"))
    assert_measure_refused(tmp_path, p, "max_num_batched_tokens 256", "max_model_len 512",
                           "chunked")
    # chunked prefill is vLLM 0.32's default: then it is allowed
    p = run_measure(tmp_path, good_doc(tmp_path, model), flags(max_num_batched_tokens="256"))
    assert (tmp_path / "LAUNCHED").exists(), p.stderr


def test_long_context_allowed_when_the_study_says_so(tmp_path, model):
    doc = good_doc(tmp_path, model)
    doc["server"]["env"]["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    p = run_measure(tmp_path, doc, flags(max_model_len="1000000"))
    assert (tmp_path / "LAUNCHED").exists(), p.stderr


@pytest.mark.parametrize("edit,words", [
    (lambda d: d["space"].update(max_model_len={"choices": [65536, 131072]}),
     ["space.max_model_len", "65536", "1..32768", "max_position_embeddings"]),
    (lambda d: d["space"].update(max_model_len={"low": 40000, "high": 80000}),
     ["space.max_model_len", "1..32768"]),
    (lambda d: d["space"].update(kv_cache_dtype={"choices": ["auto", "fp9"]}),
     ["space.kv_cache_dtype.choices", "'fp9'"]),
    (lambda d: d["space"].update(max_num_batched_tokens={"choices": [2, 4096]}),
     ["space.max_num_batched_tokens", "lowest value 2", "max_num_seqs 4"]),
    (lambda d: d["server"].update(extra_args=["--kv-cache-dtype", "fp9"]),
     ["server.extra_args --kv-cache-dtype", "'fp9'"]),
    (lambda d: d["server"].update(extra_args=["--max-num-batched-tokens=2"]),
     ["server.extra_args --max-num-batched-tokens", "max_num_seqs 4", "space.max_num_seqs"]),
])
def test_run_refuses_values_vllm_or_the_model_rule_out(tmp_path, model, edit, words):
    doc = good_doc(tmp_path, model)
    edit(doc)
    assert_refused(tmp_path, run_cli(tmp_path, fk.to_toml(doc)), *words)


def test_run_refuses_a_baseline_out_of_range(tmp_path, model):
    text = fk.to_toml(good_doc(tmp_path, model)) + (
        "\n[[baselines]]\nname = \"mine\"\ngpu_memory_utilization = 1.5\n")
    assert_refused(tmp_path, run_cli(tmp_path, text), "baselines[0].gpu_memory_utilization",
                   "1.5", "(0, 1]")


def test_run_clips_a_space_partly_over_the_models_limit(tmp_path, model):
    doc = good_doc(tmp_path, model)
    doc["space"]["max_model_len"] = {"choices": [1024, 65536]}
    p = run_cli(tmp_path, fk.to_toml(doc))
    assert (tmp_path / "LAUNCHED").exists(), p.stderr
    warnings = [line for line in p.stderr.splitlines() if line.startswith("tuner: warning:")]
    assert len(warnings) == 1, p.stderr
    assert "65536" in warnings[0] and "32768" in warnings[0] and "choices 1024" in warnings[0]


# ---------------------------------------------------------------- the checks themselves (in process)


def test_model_max_len_mirrors_vllm():
    from tuner.config import model_max_len

    assert model_max_len({"max_position_embeddings": 32768})[0] == 32768
    assert model_max_len({"n_positions": 1024, "max_position_embeddings": 2048})[0] == 1024
    assert model_max_len({"max_position_embeddings": 4096},
                         {"model_max_length": 2048})[0] == 2048
    assert model_max_len({"max_position_embeddings": 4096},
                         {"model_max_length": 1e30})[0] == 4096
    linear = {"max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 4.0}}
    assert model_max_len(linear) == (16384, "max_position_embeddings 4096 in config.json x RoPE factor 4")
    for kind in ("llama3", "yarn", "longrope"):    # already scaled
        cfg = {"max_position_embeddings": 131072, "rope_scaling": {"rope_type": kind, "factor": 8.0}}
        assert model_max_len(cfg)[0] == 131072
    nested = {"max_position_embeddings": 8192, "rope_parameters": {
        "full_attention": {"rope_type": "dynamic", "factor": 2.0},
        "sliding_attention": {"rope_type": "default"}}}
    assert model_max_len(nested)[0] == 16384
    gemma3 = {"model_type": "gemma3", "max_position_embeddings": 131072,
              "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    assert model_max_len(gemma3)[0] == 131072
    assert model_max_len({"text_config": {"max_position_embeddings": 8192}})[0] == 8192
    assert model_max_len({"max_position_embeddings": 2048, "model_max_length": 8192})[0] == 8192
    assert model_max_len({"hidden_size": 8})[0] is None


def test_the_installed_vllm_agrees_on_kv_cache_dtypes():
    typing = pytest.importorskip("typing")
    cache = pytest.importorskip("vllm.config.cache")
    from tuner.config import KV_CACHE_DTYPES

    assert set(typing.get_args(cache.CacheDType)) == set(KV_CACHE_DTYPES)


def test_fit_space_to_model_clips_ranges_on_their_step():
    from tuner.config import fit_space_to_model, parse_study

    doc = {"model": {"path": "x"}, "space": {
        "gpu_memory_utilization": {"low": 0.1, "high": 0.9},
        "max_model_len": {"low": 1000, "high": 100000, "step": 1000},
        "max_num_seqs": {"choices": [1, 2]}}}
    cfg = parse_study(doc, "s.toml", {})
    said = []
    fitted = fit_space_to_model(cfg, {"max_position_embeddings": 32768}, warn=said.append)
    dim = fitted.dimension("max_model_len")
    assert (dim.low, dim.high) == (1000, 32000) and len(said) == 1
    assert fit_space_to_model(fitted, {"max_position_embeddings": 32768}, warn=said.append) == fitted
    assert len(said) == 1


def test_unknown_engine_name_is_refused(tmp_path, model):
    doc = with_(good_doc(tmp_path, model), "server", engine="sglang-nope")
    p = run_cli(tmp_path, fk.to_toml(doc))
    assert_refused(tmp_path, p, "server.engine", "unknown engine 'sglang-nope'", '"vllm" or "llamacpp"')


def test_a_vllm_flag_in_a_llamacpp_space_is_refused(tmp_path, model):
    doc = with_(good_doc(tmp_path, model), "server", engine="llamacpp")
    p = run_cli(tmp_path, fk.to_toml(doc))
    # the fake study searches gpu_memory_utilization, which llama.cpp has no counterpart for
    assert_refused(tmp_path, p, "space.gpu_memory_utilization", "not a tunable flag", "ctx_size")


# ---------------------------------------------------------------- a study that is not there


@pytest.mark.parametrize("command", [["show"], ["export"], ["report"], ["export", "--json"]])
def test_reading_a_study_that_does_not_exist_creates_no_database(tmp_path, model, command):
    study = tmp_path / "study.toml"
    study.write_text(fk.to_toml(good_doc(tmp_path, model)))
    p = subprocess.run([sys.executable, "-m", "tuner", *command, "--study", str(study),
                        "--storage", f"sqlite:///{tmp_path}/db/bad.db",
                        "--results", str(tmp_path / "results")], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(fk.REPO)})
    line = assert_refused(tmp_path, p, "no study 'bad'", "run `python -m tuner run` first")
    assert "(no such file)" in line
    assert sorted(f.name for f in tmp_path.iterdir()) == ["engine.py", "study.toml"]


def test_compare_with_a_study_not_in_its_storage_creates_no_database(tmp_path, model):
    doc = good_doc(tmp_path, model)
    for name in ("a", "b"):
        (tmp_path / f"{name}.toml").write_text(fk.to_toml(with_(
            doc, "study", name=name, storage=f"sqlite:///{tmp_path}/db/{name}.db")))
    p = subprocess.run([sys.executable, "-m", "tuner", "compare", "--study", str(tmp_path / "a.toml"),
                        "--study", str(tmp_path / "b.toml"), "--out", str(tmp_path / "results")],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(fk.REPO)})
    assert_refused(tmp_path, p, "no study 'a'")
    assert sorted(f.name for f in tmp_path.iterdir()) == ["a.toml", "b.toml", "engine.py"]


def test_measure_refuses_a_config_json_the_memory_model_cannot_read_as_run_does(tmp_path, model):
    broken = tmp_path / "broken-model"
    shutil.copytree(model, broken)
    config = json.loads((broken / "config.json").read_text())
    del config["hidden_size"]
    (broken / "config.json").write_text(json.dumps(config))
    doc = good_doc(tmp_path, str(broken))
    doc["study"]["memory_model"] = True
    p = run_measure(tmp_path, doc, GOOD)
    assert p.returncode == 2, p.stderr
    assert "missing hidden_size" in p.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "LAUNCHED").exists()


def test_a_python_without_the_dependencies_gets_one_line_and_exit_2(tmp_path):
    # `python3 -m tuner show` with the system Python instead of .venv's: pandas is imported only
    # once the command runs; it was a traceback
    hide = ("import sys, importlib.abc\n"
            "class Hide(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] == 'pandas':\n"
            "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
            "sys.meta_path.insert(0, Hide())\n"
            "from tuner.cli import main\n"
            "raise SystemExit(main(['show', '--storage', sys.argv[1]]))\n")
    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, "-c", hide, f"sqlite:///{tmp_path}/none.db"], cwd=root,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "has no pandas" in lines[0] and "bash install.sh" in lines[0], r.stderr
    assert "Traceback" not in r.stderr
