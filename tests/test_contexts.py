"""contexts.py: the longest context served and how fast, folded from the trials frame; and through
`tuner show` / `tuner report` on the committed 32B AWQ study under a 16 GB budget."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd

from tuner import engines
from tuner.results import contexts

ROOT = Path(__file__).resolve().parents[1]
# the 32B study as of its 33rd trial: the live storage in studies/ grows when the study resumes
STUDY_32B = ROOT / "tests" / "data" / "studies" / "h200-16gb-32b-awq-33-trials.db"


def trial(n, context, seqs, *, failure="", feasible=True, kv=None, figures=None, state="COMPLETE",
          memory=0.0):
    single, throughput, ttft = figures or (None, None, None)
    return {"trial": n, "state": state, "failure": failure, "feasible": feasible,
            "constraint_memory": memory,
            "gpu_memory_utilization": 0.9, "max_model_len": context, "max_num_seqs": seqs,
            "kv_cache_tokens": kv, "single_stream_tok_s": single, "throughput_tok_s": throughput,
            "ttft_ms": ttft}


def frame(rows) -> pd.DataFrame:
    return pd.DataFrame(rows)


def test_one_row_per_context_with_its_best_served_configs_and_what_did_not_serve():
    df = frame([
        trial(0, 32768, 256, failure="no_cache_blocks", feasible=False),
        trial(1, 4096, 8, kv=9000, figures=(50.0, 300.0, 120.0)),
        trial(2, 4096, 32, kv=8500, figures=(48.0, 900.0, 90.0)),
        trial(3, 16384, 8, kv=20000, figures=(45.0, 280.0, 150.0)),
        trial(4, 8192, 8, failure="predicted_infeasible", feasible=False, memory=0.5),
        # below the user's required context: not launched, but no memory verdict
        trial(9, 1024, 8, failure="predicted_infeasible", feasible=False, memory=0.0),
        # ran, but its peak broke the memory budget: not served, counted apart
        trial(5, 32768, 4, failure="over_budget", feasible=False, kv=40000,
              figures=(51.0, 200.0, 100.0)),
        trial(6, 65536, 4, failure="kv_cache_too_small", feasible=False),
        trial(7, 65536, 4, failure="predicted_infeasible", feasible=False, memory=1.0),
        trial(8, 2048, 4, state="RUNNING", feasible=False),
    ])
    ctx = contexts.context_frame(df).set_index("context")
    assert list(ctx.index) == [1024, 2048, 4096, 8192, 16384, 32768, 65536]
    assert (ctx.loc[1024, "infeasible"], ctx.loc[1024, "predicted_not_to_fit"]) == (1, 0)
    assert ctx.loc[8192, "predicted_not_to_fit"] == 1
    row = ctx.loc[4096]
    assert (row["served"], row["kv_cache_tokens"], row["requests_at_context"]) == (2, 9000, 2)
    # each objective's best among the served configs of that context, with its trial
    assert (row["single_stream_tok_s"], row["single_stream_trial"]) == (50.0, 1)
    assert (row["throughput_tok_s"], row["throughput_trial"]) == (900.0, 2)
    assert (row["ttft_ms"], row["ttft_trial"]) == (90.0, 2)
    assert ctx.loc[16384, "requests_at_context"] == 1
    assert (ctx.loc[32768, "served"], ctx.loc[32768, "failed_for_memory"],
            ctx.loc[32768, "infeasible"]) == (0, 1, 1)
    assert (ctx.loc[65536, "failed_for_memory"], ctx.loc[65536, "predicted_not_to_fit"]) == (1, 1)
    assert ctx.loc[2048, "served"] == 0 and pd.isna(ctx.loc[2048, "kv_cache_tokens"])

    lines = contexts.describe(contexts.context_frame(df))
    assert lines[0] == ("longest max_model_len served: 16,384 tokens (trial 3: 280.0 tok/s "
                        "throughput; best single stream 45.0 tok/s, trial 3; its KV cache held "
                        "1 request of that length at once)")
    assert lines[1] == ("longer max_model_len not served: 32,768 (1 failed for memory, 1 broke a "
                        "constraint); 65,536 (1 failed for memory, 1 predicted not to fit)")
    table = "\n".join(lines[2:])
    assert "8,192      0  1 predicted not to fit" in table
    assert "16,384      1          20,000        1" in table


def test_nothing_served_yet_says_why_and_no_context_gives_no_lines():
    df = frame([trial(0, 131072, 256, failure="no_cache_blocks", feasible=False)])
    assert contexts.describe(contexts.context_frame(df)) == [
        "no max_model_len has served yet: 131,072 (1 failed for memory)"]
    assert contexts.describe(contexts.context_frame(pd.DataFrame())) == []


def test_llamacpp_context_is_per_slot():
    engines.use("llamacpp")
    try:
        df = pd.DataFrame([{"trial": 0, "state": "COMPLETE", "failure": "", "feasible": True,
                            "ctx_size": 16384, "parallel": 4, "kv_cache_tokens": 16384,
                            "single_stream_tok_s": 30.0, "throughput_tok_s": 90.0,
                            "ttft_ms": 40.0}])
        ctx = contexts.context_frame(df)
        assert list(ctx["context"]) == [4096] and ctx.loc[0, "requests_at_context"] == 4
        assert contexts.describe(ctx)[0].startswith("longest ctx_size per slot served: 4,096 tokens")
    finally:
        engines.use(engines.DEFAULT)


def test_the_32b_study_under_16_gb_answers_how_long_a_context_and_how_fast(tmp_path):
    """The committed GPU study: 16k served at offload 11 (trial 21), 32k failed for memory."""
    shutil.copy(STUDY_32B, tmp_path / "s.db")
    common = ["--study", "studies/h200-16gb-32b-awq.toml", "--storage", f"sqlite:///{tmp_path}/s.db"]
    show = subprocess.run([sys.executable, "-m", "tuner", "show", *common], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert show.returncode == 0, show.stderr
    assert "longest max_model_len served: 16,384 tokens (trial 21: 48.6 tok/s throughput" in show.stdout
    assert "longer max_model_len not served: 32,768 (1 failed for memory, 1 predicted not to fit)" in show.stdout
    report = subprocess.run([sys.executable, "-m", "tuner", "report", *common, "--results",
                             str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert report.returncode == 0, report.stderr
    csv = pd.read_csv(tmp_path / "h200-16gb-32b-awq" / "contexts.csv").set_index("context")
    assert csv.loc[16384, "throughput_trial"] == 21 and csv.loc[16384, "requests_at_context"] == 1
    assert csv.loc[2048, "throughput_trial"] == 16
    page = (tmp_path / "h200-16gb-32b-awq" / "report.html").read_text()
    assert 'id="contexts"' in page and "longest max_model_len served: 16,384 tokens" in page


def test_export_the_best_config_for_a_context_or_a_named_trial(tmp_path):
    """The committed 32B study's front is 2,048-token configs only; a user who needs 16k asks for
    the best that serves it, or for the trial `show` names."""
    shutil.copy(STUDY_32B, tmp_path / "s.db")
    common = ["--study", "studies/h200-16gb-32b-awq.toml", "--storage", f"sqlite:///{tmp_path}/s.db",
              "--results", str(tmp_path)]

    def export(*args):
        return subprocess.run([sys.executable, "-m", "tuner", "export", *common, *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)

    front = export("--prefer", "throughput")
    assert front.returncode == 0 and "--max-model-len 2048" in front.stdout
    long = export("--min-context", "16384", "--prefer", "throughput")
    assert long.returncode == 0, long.stderr
    assert "--max-model-len 16384 --max-num-seqs 16 --cpu-offload-gb 11" in long.stdout
    assert "# throughput: trial 21:" in long.stderr
    script = (tmp_path / "h200-16gb-32b-awq" / "best-command.sh").read_text()
    assert "`python -m tuner export --prefer throughput --min-context 16384`" in script
    named = export("--trial", "24")
    assert named.returncode == 0 and "--max-model-len 4096" in named.stdout
    assert named.stderr.splitlines()[0].startswith("# trial 24: single stream 3.8")
    assert "`python -m tuner export --trial 24`" in (
        tmp_path / "h200-16gb-32b-awq" / "best-command.sh").read_text()
    # what cannot be exported says why, in one line, exit 2
    for args, said in ((["--min-context", "32768"], "no measured config with max_model_len of at "
                        "least 32,768 tokens within every constraint (the longest served is 16,384"),
                       (["--trial", "19"], "trial 19 of study h200-16gb-32b-awq has no feasible "
                        "measurement (predicted_infeasible)"),
                       (["--trial", "99"], "has no trial 99"),
                       (["--trial", "21", "--min-context", "4096"], "not allowed with argument")):
        out = export(*args)
        assert out.returncode == 2 and said in out.stderr, (args, out.stderr)
