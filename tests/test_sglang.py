"""SGLang as an engine, on logs assembled from its source's messages (tests/data/sglang/README.md)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pandas as pd
import pytest

from tuner import config, engines
from tuner.results import export
from tuner.engines import sglang
from tuner.engines.sglang_logs import classify, launch_phases, parse_capacity
from tuner.errors import ConfigError
from tuner.run.process import Capacity, LaunchFailure, LaunchSpec, ServerProcess, build_argv
from tuner.load.client import parse_prometheus
from tuner.models.presets import TINY_MODEL
from tuner.search.space import ServerParams

DATA = Path(__file__).parent / "data" / "sglang"
REPO = Path(__file__).resolve().parent.parent
HAS_SGLANG = sglang.importlib.util.find_spec("sglang") is not None


def log(name: str) -> str:
    return (DATA / name).read_text()


@pytest.fixture(autouse=True)
def _sglang():
    engines.use("sglang")


def params(**values) -> ServerParams:
    return ServerParams(extra=tuple(sorted(values.items())))


# ---------------------------------------------------------------- failure texts

@pytest.mark.parametrize("name, kind, message", [
    ("not_enough_memory.log", "no_cache_blocks",
     "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static. "
     "Current value: mem_fraction_static=0.1"),
    ("cuda_oom_load.log", "oom", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.96 GiB."),
    ("context_too_long.log", "context_too_long",
     "ValueError: Warning: User-specified context_length (262144) is greater than the derived"),
    ("no_weights.log", "model_load", "RuntimeError: Cannot find any model weights with `/models/empty-llama`"),
    ("scheduler_crash.log", "crashed", "ModuleNotFoundError: No module named 'sgl_kernel'"),
])
def test_recorded_failures_are_classified_by_their_cause(name, kind, message):
    failure = classify(log(name))
    assert failure is not None and failure.kind == kind
    assert failure.message.startswith(message), failure.message
    assert failure.is_memory == (kind in ("no_cache_blocks", "oom"))
    assert "Received sigquit" in failure.log_tail or kind == "context_too_long"


def test_the_oom_carries_torch_s_figures_and_the_context_failure_the_model_s_limit():
    oom = classify(log("cuda_oom_load.log"))
    assert oom.needed_gib == pytest.approx(1.96) and oom.available_gib == pytest.approx(1.02)
    assert classify(log("context_too_long.log")).estimated_max_model_len == 131072


def test_the_older_not_enough_memory_wording_without_the_value_is_the_same_failure():
    text = ("[2025-01-10 10:00:07 TP0] Scheduler hit an exception: Traceback (most recent call last):\n"
            "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static.\n")
    assert classify(text).kind == "no_cache_blocks"


def test_lines_of_a_server_that_goes_on_to_serve_are_no_failure():
    assert classify(log("ready.log")) is None
    # the context_length sentence as a WARNING (the override env is set): the server serves
    warning = ("[2025-09-30 10:00:00] Warning: User-specified context_length (262144) is greater than the "
               "derived context_length (131072). This may lead to incorrect model outputs or CUDA errors. "
               "Note that the derived context_length may differ from max_position_embeddings in the "
               "model's config.\n")
    assert classify(warning + log("ready.log")) is None


# ---------------------------------------------------------------- capacity and phases

def test_capacity_from_the_ready_log():
    cap = parse_capacity(log("ready.log"), ready_s=19.0)
    assert cap.weights_gib == pytest.approx(14.99)
    assert cap.kv_cache_gib == pytest.approx(90.02)          # K 45.01 + V 45.01
    assert cap.kv_cache_tokens == 737418                     # the scheduler's max_total_num_tokens
    assert cap.max_concurrency == pytest.approx(737418 / 4096, abs=0.01)   # at context_len
    cfg = dict(cap.cache_config)
    assert cfg["max_running_requests"] == "8" and cfg["context_len"] == "4096"
    assert cfg["chunked_prefill_size"] == "8192" and cfg["available_gpu_mem_gib"] == "32.75"
    assert cap.ready_s == 19.0
    # 128 KiB of K+V per token (Llama-3.1-8B shape, bf16): the two lines agree
    assert cap.kv_cache_gib * 2**30 / cap.kv_cache_tokens == pytest.approx(128 * 1024, rel=1e-3)


def test_capacity_of_the_newer_pool_line_and_of_an_mla_pool():
    newer = ("[x TP0] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 1000, "
             "K size: 1.50 GB, V size: 1.50 GB\n")
    mla = "[x TP0] KV Cache is allocated. #tokens: 383872, KV size: 19.36 GB\n"
    assert (parse_capacity(newer).kv_cache_gib, parse_capacity(newer).kv_cache_tokens) == (3.0, 1000)
    assert (parse_capacity(mla).kv_cache_gib, parse_capacity(mla).kv_cache_tokens) == (19.36, 383872)
    assert parse_capacity("").kv_cache_tokens is None and parse_capacity("").cache_config == ()


def test_launch_phases_from_the_ready_log():
    assert launch_phases(log("ready.log")) == {"weights": 1.52, "graphs": 6.21}
    assert launch_phases("no such lines") == {}


def test_the_metrics_page_gives_sglang_s_gauges_and_counters():
    found = dict(parse_prometheus(log("metrics.txt"), engine="sglang"))
    assert found["sglang:token_usage"] == 0.02 and found["sglang:num_queue_reqs"] == 24.0
    assert found["sglang:generation_tokens_total"] == 4096.0
    assert found["sglang:inter_token_latency_seconds_count"] == 4064.0
    assert "sglang:gen_throughput" not in found   # a rate SGLang computes itself: not differenced
    names = sglang.ENGINE.metric_names
    assert names["kv_cache_usage"] == "sglang:token_usage" and "preemptions" not in names


# ---------------------------------------------------------------- flags and argv

def test_the_flag_table_is_sglang_s_words_for_the_three_knobs():
    flags = {f.name: f for f in engines.flags()}
    assert [f.name for f in engines.flags() if f.required] == [
        "mem_fraction_static", "context_length", "max_running_requests"]
    for f in engines.flags():
        assert f.cli == "--" + f.name.replace("_", "-")
    assert flags["mem_fraction_static"].memory == "supply" and flags["context_length"].memory == "demand"
    assert flags["mem_fraction_static"].problem(0.0) and flags["mem_fraction_static"].problem(1.2)
    assert flags["mem_fraction_static"].problem(0.85) is None
    assert flags["max_running_requests"].problem(0) == (
        "max_running_requests must be a positive integer (>= 1), got 0")


def test_argv_of_the_weightless_tiny_model_serves_dummy_weights_with_metrics():
    spec = LaunchSpec(model=str(TINY_MODEL), engine="sglang", extra_args=("--tp-size", "1"),
                      params=params(mem_fraction_static=0.8, context_length=2048, max_running_requests=16,
                                    disable_cuda_graph=True))
    argv = build_argv(spec, ("python", "-m", "sglang.launch_server"), 31234)
    assert argv == ["python", "-m", "sglang.launch_server", "--model-path", str(TINY_MODEL),
                    "--mem-fraction-static", "0.8", "--context-length", "2048",
                    "--max-running-requests", "16", "--disable-cuda-graph", "--tp-size", "1",
                    "--load-format", "dummy", "--enable-metrics", "--host", "127.0.0.1", "--port", "31234"]


def test_a_folder_with_weights_is_served_as_it_is(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    argv = sglang.ENGINE.argv(("sglang",), str(tmp_path), {"context_length": 1024}, ("--enable-metrics",),
                              "0.0.0.0", 30000)
    assert "--load-format" not in argv and argv.count("--enable-metrics") == 1
    assert argv[:3] == ["sglang", "--model-path", str(tmp_path)]


def test_requests_fix_their_output_and_ask_sglang_s_tokenizer():
    eng = sglang.ENGINE
    assert eng.fixed_output(32) == {"min_tokens": 32, "ignore_eos": True}
    assert eng.request_context({"context_length": 2048}) == 2048 and eng.request_context({}) is None
    api = eng.tokenizer_api
    assert (api.tokenize_path, api.detokenize_path) == ("/v1/tokenize", "/v1/detokenize")
    assert api.tokenize_body("m", "w1 w2", True) == {"model": "m", "prompt": "w1 w2",
                                                      "add_special_tokens": True}
    assert api.count({"tokens": [5, 6], "count": 2, "max_model_len": 4096}) == 2
    assert not api.chat_messages


# ---------------------------------------------------------------- a study file, export and run

STUDY = """\
[study]
name = "sg"
[model]
path = "preset:tiny"
[server]
engine = "sglang"
[space]
mem_fraction_static = { low = 0.5, high = 0.9 }
context_length = { choices = [1024, 2048] }
max_running_requests = { low = 1, high = 16 }
[workload]
prompt_tokens = 32
output_tokens = 8
"""


def write_study(tmp_path: Path, text: str = STUDY) -> Path:
    path = tmp_path / "sg.toml"
    path.write_text(text)
    return path


def test_an_sglang_study_validates_against_sglang_s_table(tmp_path):
    cfg = config.load_study(str(write_study(tmp_path)))
    assert cfg.engine_name == "sglang" and engines.current() == "sglang"
    assert {d.name for d in cfg.dimensions} == {"mem_fraction_static", "context_length", "max_running_requests"}
    with pytest.raises(ConfigError, match=r"mem_fraction_static must be in \(0, 1\]"):
        config.load_study(str(write_study(tmp_path, STUDY.replace("high = 0.9", "high = 1.5"))))
    with pytest.raises(ConfigError, match="max_num_seqs"):   # a vLLM flag is no SGLang flag
        config.load_study(str(write_study(tmp_path, STUDY + "max_num_seqs = { low = 1, high = 4 }\n")))


def test_export_rebuilds_the_sglang_command_from_the_trial_s_argv(tmp_path):
    cfg = config.load_study(str(write_study(tmp_path)))
    argv = sglang.ENGINE.argv(("/venv/bin/python", "-m", "sglang.launch_server"), str(TINY_MODEL),
                              {"mem_fraction_static": 0.7, "context_length": 2048, "max_running_requests": 4},
                              (), "127.0.0.1", 40111)
    row = pd.Series({"trial": 3, "mem_fraction_static": 0.7, "context_length": 2048.0,
                     "max_running_requests": 4.0, "command": " ".join(argv)})
    e = export.exported(row, None, cfg)
    assert list(e.argv) == ["python", "-m", "sglang.launch_server", "--model-path", "MODEL",
                            "--mem-fraction-static", "0.7", "--context-length", "2048",
                            "--max-running-requests", "4", "--enable-metrics", "--host", "127.0.0.1"]
    assert e.placeholder and "random weights" in e.notes[0]
    # a trial without its argv: rebuilt from its params, the same flags
    rebuilt = export.exported(row.drop(labels=["command"]), None, cfg)
    assert list(rebuilt.argv)[4:11] == list(e.argv)[4:11]


def test_a_preset_s_random_weights_export_as_its_published_checkpoint(tmp_path, monkeypatch):
    from tuner.models import presets

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    folder = presets.cache_dir() / "llama-3.1-8b"
    assert sglang.ENGINE.exported_model(str(folder))[0] == "meta-llama/Llama-3.1-8B-Instruct"
    assert sglang.ENGINE.exported_model("preset:llama-3.1-8b")[0] == "meta-llama/Llama-3.1-8B-Instruct"
    assert sglang.ENGINE.exported_model("Qwen/Qwen2.5-7B") == ("Qwen/Qwen2.5-7B", "")


@pytest.mark.skipif(HAS_SGLANG, reason="SGLang is installed here")
def test_running_an_sglang_study_without_sglang_is_one_line_and_exit_2(tmp_path):
    write_study(tmp_path)
    run = subprocess.run([sys.executable, "-m", "tuner", "run", "--study", "sg.toml", "--trials", "1"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 2, run.stderr
    lines = [ln for ln in run.stderr.splitlines() if "SGLang is not installed" in ln]
    assert len(lines) == 1 and "Traceback" not in run.stderr
    assert not (tmp_path / "results" / "sg" / "trials.csv").exists()


@pytest.mark.skipif(HAS_SGLANG, reason="SGLang is installed here")
def test_doctor_lists_sglang_missing_as_a_problem_and_runs_the_other_checks(tmp_path):
    write_study(tmp_path)
    done = subprocess.run([sys.executable, "-m", "tuner", "doctor", "--study", "sg.toml"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 1, done.stderr
    lines = done.stdout.splitlines()
    assert [ln for ln in lines if ln.startswith("engine") and "PROBLEM" in ln and "SGLang" in ln]
    for check in ("model", "values", "storage", "results"):   # listed after it, each one
        assert [ln for ln in lines if ln.startswith(check)], done.stdout
    assert "Traceback" not in done.stderr


# ---------------------------------------------------------------- readiness, against a real process

FAKE_SGLANG = textwrap.dedent('''\
    """Plays SGLang's launch: a recorded log, then /health 503 (Starting) before 200, as http_server.py."""
    import http.server, os, sys, time
    argv = sys.argv[1:]
    port = int(argv[argv.index("--port") + 1])
    lines = open(os.environ["FAKE_LOG"]).read().splitlines(keepends=True)
    starting = int(os.environ.get("FAKE_STARTING", "3"))   # /health answers 503 this many times
    for line in lines:
        if "Uvicorn running" in line or "ready to roll" in line:
            break
        sys.stdout.write(line); sys.stdout.flush(); time.sleep(0.01)
    if os.environ.get("FAKE_EXIT"):
        sys.exit(int(os.environ["FAKE_EXIT"]))
    asked = {"health": 0}
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/health":
                asked["health"] += 1
                if asked["health"] <= starting:
                    self.send_response(503); self.end_headers(); return
                if asked["health"] == starting + 1:
                    sys.stdout.write("[t] The server is fired up and ready to roll!\\n"); sys.stdout.flush()
            body = b'{"object": "list", "data": [{"id": "m"}]}' if self.path == "/v1/models" else b""
            self.send_response(200); self.end_headers(); self.wfile.write(body)
        def log_message(self, *a):
            sys.stdout.write(f"[t] INFO:     {self.requestline} health#{asked['health']}\\n")
            sys.stdout.flush()
    sys.stdout.write("[t] INFO:     Uvicorn running on http://127.0.0.1:%d\\n" % port); sys.stdout.flush()
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
''')


def fake_spec(tmp_path: Path, log_name: str, **env) -> LaunchSpec:
    script = tmp_path / "fake_sglang.py"
    script.write_text(FAKE_SGLANG)
    return LaunchSpec(model=str(TINY_MODEL), engine="sglang", engine_cmd=(sys.executable, str(script)),
                      params=params(mem_fraction_static=0.85, context_length=4096, max_running_requests=8),
                      env=tuple({"FAKE_LOG": str(DATA / log_name), **env}.items()),
                      launch_timeout_s=30, log_path=str(tmp_path / "server.log"))


def test_ready_only_once_health_stops_answering_503(tmp_path):
    with ServerProcess(fake_spec(tmp_path, "ready.log", FAKE_STARTING="4")) as server:
        server.start()
        ready = server.wait_ready()
        assert isinstance(ready, Capacity), getattr(ready, "log_tail", ready)
        text = server.read_log()
    assert "ready to roll" in text and "health#4" in text   # four 503s were waited out
    assert ready.kv_cache_tokens == 737418 and ready.weights_gib == pytest.approx(14.99)
    assert server.argv[server.argv.index("--mem-fraction-static") + 1] == "0.85"


def test_a_failure_line_decides_while_the_http_server_lingers(tmp_path):
    # SGLang's HTTP side may outlive its dead scheduler; /health never turns 200
    started = time.monotonic()
    with ServerProcess(fake_spec(tmp_path, "not_enough_memory.log", FAKE_STARTING="100000")) as server:
        server.start()
        failure = server.wait_ready()
    assert isinstance(failure, LaunchFailure) and failure.kind == "no_cache_blocks", failure
    assert time.monotonic() - started < 20   # not the 30 s launch timeout


def test_a_server_that_exits_is_classified_from_its_log(tmp_path):
    with ServerProcess(fake_spec(tmp_path, "context_too_long.log", FAKE_EXIT="1")) as server:
        server.start()
        failure = server.wait_ready()
    assert isinstance(failure, LaunchFailure) and failure.kind == "context_too_long"
    assert failure.estimated_max_model_len == 131072
    # its own exit (1) or the launcher's TERM when the line was read first: the log decides either way
    assert failure.exit_code in (1, -15)
