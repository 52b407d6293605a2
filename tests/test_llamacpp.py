"""llama.cpp as the second engine, against the real server (the xllamacpp wheel) serving the tiny model's GGUF."""

from __future__ import annotations

import json
import socket
import urllib.request
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from tuner import engines
from tuner.engines import llamacpp
from tuner.engines.llamacpp_gguf import gguf_for
from tuner.run.process import Capacity, LaunchFailure, LaunchSpec, ServerProcess, group_members
from tuner.load.client import Workload, run_load_test
from tuner.models.presets import TINY_MODEL
from tuner.search.space import ServerParams

pytestmark = pytest.mark.llamacpp


@pytest.fixture(autouse=True)
def _llamacpp():
    engines.use("llamacpp")


def params(ctx_size: int = 1024, parallel: int = 2, kv_unified: bool = False) -> ServerParams:
    return ServerParams(extra=tuple(sorted({"ctx_size": ctx_size, "parallel": parallel,
                                            "kv_unified": kv_unified}.items())))


def spec(tmp_path: Path, p: ServerParams, model: str = str(TINY_MODEL), port: int = 0) -> LaunchSpec:
    return LaunchSpec(model=model, params=p, engine="llamacpp", extra_args=("-t", "2", "--threads-http", "12"),
                      port=port, launch_timeout_s=120, log_path=str(tmp_path / "server.log"))


def post(base_url: str, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(base_url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_the_gguf_tokenizer_gives_the_embedded_tokenizer_s_ids():
    """Every word is one token with the same id as the HF tokenizer's, so prompts mean the same
    to both engines; the weights are random but the file is cached and reused."""
    path = gguf_for(TINY_MODEL)
    assert path.stat().st_size > 1_000_000 and gguf_for(TINY_MODEL) == path
    import gguf

    reader = gguf.GGUFReader(str(path))
    assert reader.fields["general.architecture"].contents() == "llama"
    assert reader.fields["llama.block_count"].contents() == 4
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    hf = Tokenizer.from_file(str(TINY_MODEL / "tokenizer.json"))
    assert len(tokens) == hf.get_vocab_size() == 4096
    for word in ("w7", "w100", "w4095", "user"):
        assert tokens[hf.token_to_id(word)] == "\u2581" + word


def test_ready_capacity_exact_prompts_fixed_outputs_and_usage(tmp_path):
    with ServerProcess(spec(tmp_path, params(1024, 2))) as server:
        server.start()
        ready = server.wait_ready()
        assert isinstance(ready, Capacity), getattr(ready, "log_tail", ready)
        # two slots of 512 cells each, from llama.cpp's own load log
        assert ready.max_concurrency == 2.0 and ready.kv_cache_tokens == 1024
        assert dict(ready.cache_config)["n_ctx_slot"] == "512"
        assert ready.ready_s < 60
        assert server.argv[server.argv.index("-c") + 1] == "1024" and "-np" in server.argv
        # its /tokenize: the HF tokenizer's ids for the words
        hf = Tokenizer.from_file(str(TINY_MODEL / "tokenizer.json"))
        status, got = post(server.base_url, "/tokenize", {"content": "w100 w4095 user", "add_special": False})
        assert status == 200 and got["tokens"] == hf.encode("w100 w4095 user").ids
        w = Workload(prompt_tokens=40, output_tokens=12, warmup_requests=0, single_stream_requests=2,
                     throughput_requests=8, waves=1, max_concurrency=4, request_timeout_s=60)
        phases = run_load_test(server.base_url, str(TINY_MODEL), w, progress=False, engine="llamacpp")
        requests = [r for ph in phases for r in ph.requests]
        assert [ph.concurrency for ph in phases] == [1, 4]
        assert requests and all(r.ok for r in requests), [r.error for r in requests if not r.ok]
        # usage from the stream: exact prompt length as the server counts it, output fixed by ignore_eos
        assert {r.prompt_tokens for r in requests} == {40}
        assert {r.output_tokens for r in requests} == {12}
        assert all(r.ttft_s > 0 and len(r.itl_s) == 11 for r in requests)
        # its /metrics: llama.cpp's counters, differenced over a level
        after = dict(phases[-1].server_metrics_after)
        assert after["llamacpp:tokens_predicted_total"] >= 12 * len(requests)
        pgid = server.pgid
    assert group_members(pgid) == []


def test_a_request_longer_than_a_slot_is_refused_with_llamacpp_s_error(tmp_path):
    with ServerProcess(spec(tmp_path, params(512, 2))) as server:
        server.start()
        assert isinstance(server.wait_ready(), Capacity)
        prompt = " ".join(f"w{i}" for i in range(100, 400))   # 300 + 2 tokens > a 256-cell slot
        status, got = post(server.base_url, "/v1/completions", {"prompt": prompt, "max_tokens": 4})
    assert status == 400
    assert got["error"]["type"] == "exceed_context_size_error"
    assert got["error"]["n_ctx"] == 256


def test_a_broken_gguf_is_a_model_load_failure(tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(gguf_for(TINY_MODEL).read_bytes()[:5000])
    with ServerProcess(spec(tmp_path, params(), model=str(broken))) as server:
        server.start()
        failure = server.wait_ready()
    assert isinstance(failure, LaunchFailure)
    assert failure.kind == "model_load", failure.log_tail
    assert "gguf_init_from_reader: failed to read key-value pairs" in failure.message   # the first cause
    assert not failure.is_memory and failure.verdict_s < 60


def test_a_port_in_use_is_classified(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with ServerProcess(spec(tmp_path, params(), port=taken.getsockname()[1])) as server:
            server.start()
            failure = server.wait_ready()
    assert isinstance(failure, LaunchFailure) and failure.kind == "port_in_use", failure.log_tail
    assert "couldn't bind HTTP server socket" in failure.message


# ---------------------------------------------------------------- recorded texts, no server

@pytest.mark.parametrize("line, kind", [
    ("0.00.020 E llama_kv_cache: failed to allocate buffer for kv cache", "kv_cache_too_small"),
    ("E llama_init_from_model: failed to initialize the context: failed to allocate buffer for kv cache",
     "kv_cache_too_small"),
    ("E ggml_backend_cpu_buffer_type_alloc_buffer: failed to allocate buffer of size 343597383680",
     "oom"),
    ("E ggml_cuda_host_malloc: cudaMalloc failed: out of memory", "oom"),
    ("E llama_model_load: error loading model: llama_model_loader: failed to load model from x.gguf",
     "model_load"),
    ("E srv          start: couldn't bind HTTP server socket, hostname: 127.0.0.1, port: 8080",
     "port_in_use"),
])
def test_recorded_failure_texts(line, kind):
    failure = llamacpp.classify(f"I srv init: loading model\n{line}\nE srv init: exiting\n")
    assert failure is not None and failure.kind == kind
    assert failure.message == line.strip()
    if "of size" in line:
        assert failure.needed_gib == pytest.approx(320.0)


def test_a_clean_log_is_no_failure_and_a_training_context_warning_is_not_one():
    assert llamacpp.classify("W llama_context: n_ctx_seq (80000) > n_ctx_train (32768) -- possible "
                             "training context overflow\nI srv init: model loaded\n") is None


def test_flags_map_to_llama_server_spelling_and_slot_context():
    eng = engines.get("llamacpp")
    argv = eng.argv(("llama-server",), "/m/x.gguf", {"ctx_size": 4096, "parallel": 4, "kv_unified": True},
                    ("-t", "2"), "127.0.0.1", 9000)
    assert argv == ["llama-server", "-m", "/m/x.gguf", "-c", "4096", "-np", "4", "--kv-unified",
                    "-t", "2", "--metrics", "--host", "127.0.0.1", "--port", "9000"]
    assert eng.request_context({"ctx_size": 4096, "parallel": 4}) == 1024
    assert eng.request_context({"ctx_size": 4096, "parallel": 4, "kv_unified": True}) == 4096
    assert "gpu_memory_utilization" not in {f.name for f in eng.flags}
    assert {f.name for f in eng.flags if f.required} == {"ctx_size", "parallel"}


def test_the_load_client_asks_the_engine_for_metric_names_and_output_fields():
    from tuner.load.client import parse_prometheus, request_payload

    text = ("# TYPE llamacpp:tokens_predicted_total counter\nllamacpp:tokens_predicted_total 1027\n"
            "llamacpp:requests_processing 3\nllamacpp:n_tokens_max 1023\n"
            'vllm:num_requests_running{engine="0"} 5\n')
    assert dict(parse_prometheus(text, "llamacpp")) == {"llamacpp:tokens_predicted_total": 1027.0,
                                                        "llamacpp:requests_processing": 3.0}
    assert dict(parse_prometheus(text, "vllm")) == {"vllm:num_requests_running": 5.0}
    lc = json.loads(request_payload("m", "w10", 7, engine="llamacpp"))
    vl = json.loads(request_payload("m", "w10", 7, engine="vllm"))
    assert lc["ignore_eos"] is True and lc["max_tokens"] == 7 and "min_tokens" not in lc
    assert vl["min_tokens"] == 7 and vl["ignore_eos"] is True
    assert lc["stream_options"] == {"include_usage": True}
    api = engines.get("llamacpp").tokenizer_api
    assert api.tokenize_body("m", "w10", True) == {"model": "m", "content": "w10", "add_special": True}
    assert api.count({"tokens": [1, 10, 2]}) == 3
