"""`python -m tuner compare`: real stored studies, one on the real llama.cpp server (the demo) and one
with the vLLM engine against the fake OpenAI server, same workload, compared in a real process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from faultkit import fake_engine_study, write_study

pytestmark = pytest.mark.llamacpp

REPO = Path(__file__).resolve().parent.parent
OBJECTIVES = ("single_stream_tok_s", "throughput_tok_s", "ttft_ms")
# studies/demo-llamacpp.toml's workload: the fake vLLM study is given the same one
DEMO_WORKLOAD = {"prompt_tokens": 64, "output_tokens": 32, "warmup_requests": 2,
                 "single_stream_requests": 4, "throughput_requests": 32, "waves": 2,
                 "max_concurrency": 16, "request_timeout_s": 60}


def tuner(cwd: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tuner", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO)})


def fake_vllm(name: str, workload: dict | None = None, replicates: int = 1) -> dict:
    doc = fake_engine_study("preset:tiny", name=name)
    doc["study"]["replicates"] = replicates      # 1: the baselines relaunched, noise measured
    if workload is not None:
        doc["workload"] = dict(workload)
    return doc


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    work = tmp_path_factory.mktemp("compare")
    write_study(work, fake_vllm("fake-vllm", DEMO_WORKLOAD), "fake-vllm.toml")
    write_study(work, fake_vllm("fake-other", replicates=0), "fake-other.toml")  # output 4 tokens
    write_study(work, fake_vllm("never-run", DEMO_WORKLOAD), "never-run.toml")
    for args in (("--study", "demo-llamacpp", "--trials", "4", "--replicates", "0"),
                 ("--study", "fake-vllm.toml", "--trials", "4"),
                 ("--study", "fake-other.toml", "--trials", "2")):
        done = tuner(work, "run", *args, "--quiet")
        assert done.returncode == 0, done.stderr[-3000:]
    return work


@pytest.fixture(scope="module")
def compared(work):
    done = tuner(work, "compare", "--study", "fake-vllm.toml", "--study", "demo-llamacpp")
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_compare_csv_rows_are_the_fronts(work, compared):
    out = work / "results" / "compare-fake-vllm-demo-llamacpp"
    rows = pd.read_csv(out / "compare.csv")
    assert list(rows["study"].unique()) == ["fake-vllm", "demo-llamacpp"]
    assert set(rows[rows["study"] == "fake-vllm"]["engine"]) == {"vLLM"}
    assert set(rows[rows["study"] == "demo-llamacpp"]["engine"]) == {"llama.cpp"}
    for study in ("fake-vllm", "demo-llamacpp"):
        front = pd.read_csv(work / "results" / study / "pareto.csv").set_index("trial")
        trials = pd.read_csv(work / "results" / study / "trials.csv").set_index("trial")
        mine = rows[rows["study"] == study].set_index("trial")
        assert len(front) and sorted(mine.index) == sorted(front.index)
        for t, r in mine.iterrows():
            for k in OBJECTIVES:
                assert r[k] == pytest.approx(front.at[t, k]) == pytest.approx(trials.at[t, k])
        assert mine["balanced"].sum() == 1
    llama = rows[rows["study"] == "demo-llamacpp"]
    assert llama["flags"].str.contains(r"^-c \d+ -np \d+").all()
    vllm = rows[rows["study"] == "fake-vllm"]
    assert vllm["flags"].str.startswith("--gpu-memory-utilization ").all()
    # the fake study measured its noise (baselines relaunched): every member has a spread
    assert vllm[[f"{k}_spread" for k in OBJECTIVES]].notna().all().all()
    png = (out / "compare.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_the_table_lists_each_front_with_its_figures_and_the_best_marked(work, compared):
    text = compared.stdout
    rows = pd.read_csv(work / "results" / "compare-fake-vllm-demo-llamacpp" / "compare.csv")
    assert "engine vLLM" in text and "engine llama.cpp" in text
    assert "4 of 4 trials measured" in text
    lines = text.splitlines()
    for _, r in rows.iterrows():
        line = next(l for l in lines if r["flags"] in l and l.split()[0] == str(r["trial"]))
        for k in OBJECTIVES:
            assert f"{r[k]:.1f}" in line, (k, line)
    best = {k: (rows.loc[rows[k].idxmin() if k == "ttft_ms" else rows[k].idxmax()]) for k in OBJECTIVES}
    marks = next(l for l in lines if l.startswith("* best across the studies"))
    for k, short in zip(OBJECTIVES, ("single-stream tok/s", "throughput tok/s", "TTFT p50 ms")):
        assert f"{short} {best[k]['study']} trial {best[k]['trial']}" in marks
    assert sum(l.count(" *") for l in lines) == 3
    # each study's balanced command is the one `export` prints
    for study in ("fake-vllm.toml", "demo-llamacpp"):
        exported = tuner(work, "export", "--study", study)
        assert exported.returncode == 0
        assert f"  balanced: {exported.stdout.strip()}" in lines
    assert "not like for like" not in compared.stderr


def test_differing_workloads_are_warned_about_in_one_line(work):
    done = tuner(work, "compare", "--study", "fake-vllm.toml", "--study", "fake-other.toml",
                 "--out", str(work / "mixed"))
    assert done.returncode == 0, done.stderr[-2000:]
    warned = [l for l in done.stderr.splitlines() if "not like for like" in l]
    assert len(warned) == 1 and warned[0].startswith("tuner: warning:")
    assert "output tokens fake-vllm 32 vs fake-other 4" in warned[0]
    assert (work / "mixed" / "compare.csv").exists() and (work / "mixed" / "compare.png").exists()


@pytest.mark.parametrize("studies,out", [
    (("fake-vllm.toml",), None), (("fake-vllm.toml", "missing.toml"), None),
    (("fake-vllm.toml", "never-run.toml"), None), (("fake-vllm.toml", "fake-vllm.toml"), None),
    (("fake-vllm.toml", "demo-llamacpp"), "/proc/no-such/out")],
    ids=["one-study", "missing-file", "no-stored-trials", "the-same-study-twice", "unwritable-out"])
def test_bad_input_is_one_line_and_exit_2(work, studies, out):
    args = [a for s in studies for a in ("--study", s)] + (["--out", out] if out else [])
    done = tuner(work, "compare", *args)
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1 and done.stderr.startswith("tuner: error:")
    assert done.stdout == ""


def test_the_mismatch_line_names_a_differing_model_and_levels():
    from dataclasses import replace

    from tuner.results import compare
    from tuner import config

    demo = config.load_study(str(REPO / "studies" / "demo.toml"))
    llama = config.load_study(str(REPO / "studies" / "demo-llamacpp.toml"))
    empty = pd.DataFrame(columns=compare.CSV_COLUMNS)

    def side(cfg, label):
        return compare.Side(label, cfg, "", "", 0, 0, empty, "")

    line = compare.mismatch([side(demo, "a"), side(replace(llama, model="/models/other"), "b")])
    assert "levels a 4,16,32 vs b 4,16" in line and "model a preset:tiny vs b /models/other" in line
    assert "\n" not in line
    assert compare.mismatch([side(llama, "a"), side(llama, "b")]) == ""
    # levels of another length, or another SLO (it picks the throughput level), are named too
    longer = replace(llama, workload=replace(llama.workload, level_seconds=15.0, slo_ttft_ms=500.0))
    line = compare.mismatch([side(llama, "a"), side(longer, "b")])
    assert "level seconds a 0 vs b 15" in line and "slo ttft ms a none vs b 500" in line, line


# ---------------------------------------------------------------- studies built straight in storage


def test_the_front_line_joins_strict_members_only(tmp_path):
    """compare.png of a front where trial 1 beats trial 0 (kept as a tie within the noise) on
    every objective: no line joins them; trial 0 is a hollow marker."""
    import matplotlib.pyplot as plt

    from test_html_report import REPLICATE, TIED, stored_study
    from tuner.results import compare

    cfg, _ = stored_study(tmp_path, TIED, study_attrs=REPLICATE, tie_tolerance=0.1)
    side = compare.load_side(cfg, "a")
    assert dict(zip(side.front["trial"], side.front["strict_pareto"])) == {0: False, 1: True}
    fig = compare.plot_figure([side])
    try:
        ax, ax2 = fig.axes[:2]
        assert not ax.lines and not ax2.lines        # one strict member: nothing to join
        hollow = [c for c in ax.collections if "ties within noise" in c.get_label()]
        assert len(hollow) == 1
        assert hollow[0].get_offsets()[0][0] == pytest.approx(
            float(side.front.set_index("trial").at[0, "ttft_ms"]))
    finally:
        plt.close(fig)


def test_storage_option_and_a_workload_warning_for_waves(tmp_path, capsys):
    """compare --storage reads studies whose files name no storage (once for all, or one per
    --study); studies differing only in waves are warned about."""
    from test_html_report import TIED, stored_study
    from tuner import cli

    db = tmp_path / "db"
    db.mkdir()
    files = []
    for name, waves in (("one", 2), ("two", 4)):
        doc = fake_vllm(name, {**DEMO_WORKLOAD, "waves": waves})
        files.append(write_study(tmp_path, doc, f"{name}.toml"))
        cfg, _ = stored_study(db, TIED[:3], name=name)
    url = cfg.storage
    assert "storage" not in files[0].read_text()
    for storages in ([url], [url, url]):
        args = ["compare", "--study", str(files[0]), "--study", str(files[1]),
                "--out", str(tmp_path / "out")]
        assert cli.main(args + [a for u in storages for a in ("--storage", u)]) == 0
        err = capsys.readouterr().err
        warned = [line for line in err.splitlines() if "not like for like" in line]
        assert len(warned) == 1 and "waves one 2 vs two 4" in warned[0], err
        rows = pd.read_csv(tmp_path / "out" / "compare.csv")
        assert set(rows["study"]) == {"one", "two"} and "strict_pareto" in rows.columns
    three = args + ["--storage", url] * 3
    assert cli.main(three) == 2
    assert "compare got 3 --storage for 2 --study" in capsys.readouterr().err


def test_one_study_file_in_two_storages_compares_as_two_studies(tmp_path, capsys):
    """Two seeds of one study, each in its own storage: refused as "given twice" before; the same
    file with the same storage still is."""
    from test_html_report import TIED, stored_study
    from tuner import cli

    study_file = write_study(tmp_path, fake_vllm("seeded", DEMO_WORKLOAD), "seeded.toml")
    urls = []
    for seed in ("a", "b"):
        (tmp_path / seed).mkdir()
        cfg, _ = stored_study(tmp_path / seed, TIED[:3], name="seeded")
        urls.append(cfg.storage)
    args = ["compare", "--study", str(study_file), "--study", str(study_file),
            "--out", str(tmp_path / "out")]
    assert cli.main(args + ["--storage", urls[0], "--storage", urls[1]]) == 0
    rows = pd.read_csv(tmp_path / "out" / "compare.csv")
    assert set(rows["study"]) == {"seeded", "seeded#2"}
    capsys.readouterr()
    assert cli.main(args + ["--storage", urls[0], "--storage", urls[0]]) == 2
    assert "given twice with the same --storage" in capsys.readouterr().err
