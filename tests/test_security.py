"""Security: servers bind loopback unless the study says otherwise, no shell anywhere, exported
commands quoted for any value, and an API key from the environment that reaches the server but
never a log, a result or the study's storage."""

from __future__ import annotations

import ast
import os
import shlex
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import faultkit as fk
from tuner.results import export, report
from tuner.config import parse_study
from tuner.run.process import LaunchSpec, ServerProcess, build_argv
from tuner.search.space import ServerParams

TUNER_SRC = fk.REPO / "tuner"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return fk.private_model(tmp_path_factory.mktemp("model"))


# ---------------------------------------------------------------- where servers listen


def listening_addresses(port: int) -> set[str]:
    """Local addresses of sockets listening on `port` (from /proc/net/tcp and tcp6)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.split(":")
            if int(p, 16) == port and state == "0A":   # LISTEN
                if len(addr) == 8:
                    found.add(socket.inet_ntop(socket.AF_INET, bytes.fromhex(addr)[::-1]))
                else:
                    found.add(addr)
    return found


def test_study_default_host_is_loopback(model):
    doc = fk.fake_engine_study(model)
    cfg = parse_study(doc, "x", {})
    assert cfg.host == "127.0.0.1"
    argv = build_argv(LaunchSpec(model="m", params=ServerParams(0.5, 1024, 2)), ("vllm", "serve"), 8000)
    assert argv[argv.index("--host") + 1] == "127.0.0.1"


@pytest.mark.parametrize("study_host,expected", [(None, "127.0.0.1"), ("0.0.0.0", "0.0.0.0")])
def test_server_listens_where_the_study_says(tmp_path, model, study_host, expected):
    doc = fk.fake_engine_study(model)
    if study_host:
        doc["server"]["host"] = study_host
    cfg = parse_study(doc, "x", {})
    spec = LaunchSpec(model=str(model), params=ServerParams(0.5, 1024, 2), engine_cmd=cfg.engine,
                      host=cfg.host, env=cfg.env, launch_timeout_s=30,
                      log_path=str(tmp_path / "server.log"))
    with ServerProcess(spec) as server:
        server.start()
        ready = server.wait_ready()
        assert not hasattr(ready, "kind"), ready
        assert listening_addresses(server.port) == {expected}


# ---------------------------------------------------------------- no shell


def test_no_shell_anywhere_in_the_tuner():
    shell_calls = {"system", "popen", "getoutput", "getstatusoutput", "spawnl", "spawnlp"}
    runners = {"Popen", "run", "call", "check_call", "check_output", "create_subprocess_shell"}
    problems = []
    for path in sorted(TUNER_SRC.rglob("*.py")):
        text = path.read_text()
        if "shell=True" in text.replace(" ", ""):
            problems.append(f"{path.name}: shell=True")
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            where = f"{path.name}:{node.lineno}"
            if name in shell_calls and isinstance(node.func, ast.Attribute) and \
                    getattr(node.func.value, "id", "") == "os":
                problems.append(f"{where}: os.{name}")
            if name == "create_subprocess_shell":
                problems.append(f"{where}: {name}")
            if name in runners and node.args and isinstance(node.args[0], (ast.Constant, ast.JoinedStr)) \
                    and isinstance(getattr(node.args[0], "value", ""), str):
                problems.append(f"{where}: {name} with a command string")
            for kw in node.keywords:
                if kw.arg == "shell" and not (isinstance(kw.value, ast.Constant) and kw.value.value is False):
                    problems.append(f"{where}: shell=")
    assert problems == []


def test_server_argv_is_a_list_that_keeps_odd_values_whole():
    spec = LaunchSpec(model="/models/it's a $(model)", params=ServerParams(0.5, 1024, 2),
                      extra_args=("--served-model-name", "a b; rm -rf ~"))
    argv = build_argv(spec, ("vllm", "serve"), 8000)
    assert argv[2] == "/models/it's a $(model)"
    assert argv[argv.index("--served-model-name") + 1] == "a b; rm -rf ~"


# ---------------------------------------------------------------- export quoting

NASTY = ["/models/my model", "/m/it's \"quoted\"", "/m/$(touch PWNED)", "/m/`touch PWNED`",
         "/m/a;touch PWNED", "/m/line\nbreak", "/m/ünïcødé", "-starts-with-dash", "/m/*glob?"]


@pytest.mark.parametrize("model_path", NASTY)
def test_exported_script_runs_exactly_the_argv(tmp_path, model_path):
    from fakes import FakeDevice, FAKE_PLATFORM, fake_config
    from tuner.search.study import Tuner

    cfg = fake_config(tmp_path)
    study = Tuner(cfg, measure=FakeDevice(), platform=FAKE_PLATFORM, progress=False).run(3)
    extra = ["--served-model-name", "a b'c\"d", "--chat-template", "{{ $x }}"]
    df = report.trials_frame(study)
    row = export.choose(df[df["pareto"]], "balanced").copy()
    flags = export.launch_params(row).vllm_flags()
    # what the launcher ran; the export drops the trial's port and keeps everything else whole
    row["command"] = shlex.join(["/venv/bin/vllm", "serve", model_path, *flags, *extra,
                                 "--host", "127.0.0.1", "--port", "41234"])
    want = ["vllm", "serve", model_path, *flags, *extra, "--host", "127.0.0.1"]
    assert shlex.split(export.command(row, study)) == want

    # run best-command.sh with a stand-in `vllm` that writes its argv NUL-separated
    bindir = tmp_path / "bin"
    bindir.mkdir()
    stub = bindir / "vllm"
    stub.write_text(f"#!{sys.executable}\nimport sys\nopen(sys.argv[0] + '.args', 'w')"
                    ".write('\\0'.join(sys.argv[1:]))\n")
    stub.chmod(stub.stat().st_mode | stat.S_IXUSR)
    script = tmp_path / "best-command.sh"
    script.write_text(export.script(row, study))
    subprocess.run(["sh", str(script)], cwd=tmp_path, check=True, timeout=30,
                   env={**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}"})
    assert (bindir / "vllm.args").read_text().split("\0") == want[1:]
    assert not (tmp_path / "PWNED").exists()


# ---------------------------------------------------------------- API keys


def test_api_key_from_the_environment_reaches_the_server_and_no_file(tmp_path, model):
    secret = "sk-tuner-test-" + os.urandom(8).hex()
    doc = fk.fake_engine_study(model, "ok")
    study_file = fk.write_study(tmp_path, doc)
    argv = [sys.executable, "-m", "tuner", "run", "--study", str(study_file), "--trials", "2",
            "--storage", f"sqlite:///{tmp_path}/s.db", "--results", str(tmp_path / "results")]
    p = subprocess.run(argv, cwd=fk.REPO, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(fk.REPO), "VLLM_API_KEY": secret})
    assert p.returncode == 0, p.stderr
    # the fake server refuses /v1/* without the key (as vLLM does): measured trials prove it arrived
    import optuna

    study = optuna.load_study(study_name="faults", storage=f"sqlite:///{tmp_path}/s.db")
    assert [t.user_attrs.get("failure", "") for t in study.trials] == ["", ""]
    assert all(t.values[1] > 0 for t in study.trials)
    # ...and it is nowhere: not in stdout/stderr, any result or log file, or the database
    assert secret not in p.stdout + p.stderr
    files = [f for f in tmp_path.rglob("*") if f.is_file()]
    assert any(f.name == "server.log" for f in files) and any(f.suffix == ".db" for f in files)
    leaked = [str(f) for f in files if secret.encode() in f.read_bytes()]
    assert leaked == []


def test_without_the_key_the_server_refuses(tmp_path, model):
    # the converse, so the test above proves something: a server expecting a key the tuner lacks
    doc = fk.fake_engine_study(model, "ok")
    cfg = parse_study(doc, "x", {})
    spec = LaunchSpec(model=str(model), params=ServerParams(0.5, 1024, 2), engine_cmd=cfg.engine,
                      env=cfg.env + (("VLLM_API_KEY", "server-only"),), launch_timeout_s=30,
                      log_path=str(tmp_path / "server.log"))
    from tuner.load.client import Workload
    from tuner.run.measure import measure_config

    outcome = measure_config(spec, Workload(warmup_requests=0, single_stream_requests=1,
                                            throughput_requests=1, output_tokens=2, prompt_tokens=4),
                             progress=False)
    assert outcome.failure_kind == "load_test_failed"
    assert "http_error" in outcome.metrics.error_kinds


def test_launch_spec_repr_hides_the_environment():
    spec = LaunchSpec(model="m", params=ServerParams(0.5, 1024, 2), env=(("VLLM_API_KEY", "sk-x"),))
    assert "sk-x" not in repr(spec)
