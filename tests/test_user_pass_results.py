"""A user reading the recorded studies: the figures and their spread in best-command.sh, the ties a
one-objective pick hides, show's tables and report.html's wording, on copies of the committed
studies (never the committed files themselves)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import optuna
import pytest

from tuner import cli
from tuner.config import load_study
from tuner.results import export, html, report

ROOT = Path(__file__).resolve().parents[1]


def copied(tmp_path: Path, db: str) -> str:
    """A storage URL of a copy of a committed study database."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    target = tmp_path / Path(db).name
    shutil.copy(ROOT / db, target)
    return f"sqlite:///{target}"


def study_and_config(tmp_path: Path, name: str, db: str | None = None, study_name: str | None = None):
    storage = copied(tmp_path, db or f"studies/{name}.db")
    overrides = {"storage": storage, "results_dir": str(tmp_path / "results")}
    cfg = load_study(ROOT / "studies" / f"{name}.toml", overrides)
    study = optuna.load_study(study_name=study_name or cfg.name, storage=storage)
    return cfg, study


def run_cli(tmp_path: Path, name: str, *args: str) -> int:
    storage = copied(tmp_path, f"studies/{name}.db")
    return cli.main([*args, "--study", str(ROOT / "studies" / f"{name}.toml"),
                     "--storage", storage, "--results", str(tmp_path / "results")])


def test_best_command_gives_each_figure_with_its_spread_in_words(tmp_path):
    # h200-steady-8b's one config ran 3 times: its figures have a standard deviation, and the
    # script a person runs said only "single_stream_tok_s 154.8" (no ±, column names)
    assert run_cli(tmp_path, "h200-steady-8b", "export") == 0
    text = (tmp_path / "results" / "h200-steady-8b" / "best-command.sh").read_text()
    head = text.splitlines()[1]
    assert head == ("# tuner study h200-steady-8b, trial 0: single stream 154.8 ± 1.1 tok/s, "
                    "throughput 10,097.8 ± 252.2 tok/s, TTFT p50 366.9 ± 61.8 ms (3 runs)")
    # report writes the same script as export
    cfg, study = study_and_config(tmp_path / "report", "h200-steady-8b")
    report.write_all(study, cfg)
    assert (cfg.results_path / "best-command.sh").read_text().splitlines()[1] == head


def test_a_one_objective_pick_names_the_members_that_tie_with_it_on_that_objective(tmp_path):
    # h200-full: every front member's single stream is within 1.2 % of the best (tie tolerance
    # 2 %): --prefer single-stream took trial 0 (256 sequences, 254 ms TTFT) on its mean alone,
    # where trial 2 ties it at 57 ms, and nothing said so
    assert run_cli(tmp_path, "h200-full", "export", "--prefer", "single-stream") == 0
    text = (tmp_path / "results" / "h200-full" / "best-command.sh").read_text()
    assert ("# on single-stream speed, trials 2, 4, 8 (206.2-208.4 tok/s) tie with trial 0 "
            "(208.7 tok/s) within the noise") in text
    assert "--prefer balanced weighs the other objectives too" in text

    cfg, study = study_and_config(tmp_path / "html", "h200-full")
    df = report.trials_frame(study, cfg.tie_tolerance, cfg.requirement)
    front = df[df["pareto"]]
    noise = df.attrs["noise"]
    page = html.page(study, cfg, df)
    block = re.search(r'<div class="command" data-prefer="single-stream".*?</div></div>', page, re.S)
    assert '<p class="ties">on single-stream speed, trials 2, 4, 8' in block.group(0)
    # a pick beyond the noise of every other member on its objective has nothing to say, nor
    # has balanced (it weighs every objective already)
    ttft = export.choose(front, "ttft", noise, cfg.tie_tolerance)
    assert int(ttft["trial"]) == 4
    assert export.objective_tie_note(front, ttft, "ttft", noise, cfg.tie_tolerance) == ""
    balanced = export.choose(front, "balanced", noise, cfg.tie_tolerance)
    assert export.objective_tie_note(front, balanced, "balanced", noise, cfg.tie_tolerance) == ""
    # one tied member: "ties", singular
    cfg16, study16 = study_and_config(tmp_path / "16gb", "h200-16gb")
    df16 = report.trials_frame(study16, cfg16.tie_tolerance, cfg16.requirement)
    front16 = df16[df16["pareto"]]
    row = export.choose(front16, "single-stream", df16.attrs["noise"], cfg16.tie_tolerance)
    note = export.objective_tie_note(front16, row, "single-stream", df16.attrs["noise"])
    assert note.startswith("on single-stream speed, trial 4 (370.4 tok/s) ties with trial 1 "
                           "(371.0 tok/s) within the noise")


def test_show_prints_int_flags_as_ints_and_blank_not_NA_for_trials_without_params(tmp_path):
    # a pruned or failed trial with no params turns the flag columns float (131072.0), and a
    # trial still running with none printed <NA> in every column
    cfg, study = study_and_config(tmp_path, "h200-full")
    study.tell(study.ask(), state=optuna.trial.TrialState.PRUNED)
    study.ask()   # left running
    df = report.trials_frame(study, cfg.tie_tolerance, cfg.requirement)
    text = report.table(df)
    assert "<NA>" not in text and "131072.0" not in text and "256.0" not in text
    first = text.splitlines()[1].split()
    assert first[:6] == ["0", "COMPLETE", "0.90", "131072", "256", "208.7"]
    assert re.search(r"^\s+11\s+PRUNED\s+False\s*$", text, re.M)
    assert re.search(r"^\s+12\s+RUNNING\s+False\s*$", text, re.M)


def test_all_columns_come_one_block_per_trial_with_spreads_not_one_line_thousands_wide(tmp_path):
    cfg, study = study_and_config(tmp_path, "h200-full", "results/front-stability/demo-seed2.db",
                                  "demo-seed2")
    df = report.trials_frame(study, cfg.tie_tolerance, cfg.requirement)
    assert max(len(line) for line in df.to_string(index=False).splitlines()) > 2000
    text = report.all_columns_text(df)
    lines = text.splitlines()
    # the widest line is the longest value (the trial's command), not every column side by side
    assert max(len(line) for line in lines) < 300
    # every trial has its block; the objectives come first, with their spread
    for number in df["trial"]:
        assert re.search(rf"^trial {int(number)}  ", text, re.M), number
    block = text.split("trial 0  ", 1)[1].split("\n\n", 1)[0]
    assert block.splitlines()[0] == "COMPLETE  Pareto (a tie within the noise)  baseline vllm-defaults"
    assert re.search(r"^  single_stream_tok_s\s+86\.8 ± 1\.9$", block, re.M)
    assert re.search(r"^  ttft_ms\s+2889\.1 ± 75\.9$", block, re.M)
    assert "_tok_s_std" not in text and "ttft_ms_std" not in text   # folded into the ±
    assert re.search(r"^  kv_cache_tokens\s+373632$", block, re.M)
    assert re.search(r"^  max_model_len\s+32768$", block, re.M)
    # what every trial shares is said once, before the trials
    assert text.startswith("every trial (11 trials):")
    assert len(re.findall(r"^  gpu_name\s+CPU \(vLLM CPU build\)$", text, re.M)) == 1
    # a strict member reads "Pareto", one off the front nothing
    assert re.search(r"^trial 3  COMPLETE  Pareto$", text, re.M)
    assert re.search(r"^trial 1  COMPLETE  baseline hand-tuned$", text, re.M)
    assert report.all_columns_text(df.iloc[0:0]) == ""


def test_counts_read_as_words_in_the_report_and_its_plots(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg, study = study_and_config(tmp_path, "h200-24gb-mix", "tests/data/studies/h200-24gb-mix-3-trials.db")
    df = report.trials_frame(study, cfg.tie_tolerance, cfg.requirement)
    fig = report.projections_figure(df, cfg.name)
    title = fig._suptitle.get_text()
    labels = fig.axes[0].get_legend_handles_labels()[1]
    plt.close(fig)
    assert title.startswith("h200-24gb-mix: 1 measured config;")   # was "1 measured configs"
    # the one measured config missed the [requirement]: no SLO and no load test failed
    assert "infeasible (measured, missed a constraint)" in labels
    assert not any("SLO / load test" in label for label in labels)

    cfg, study = study_and_config(tmp_path / "steady", "h200-steady-8b")
    df = report.trials_frame(study, cfg.tie_tolerance, cfg.requirement)
    page = html.page(study, cfg, df)
    assert "1 config no other beats beyond the measured noise" in page   # was "1 configs"
    params = html.params_of(df, cfg)
    assert ("1 proposal repeated a measured config and was not launched"
            in html.failures_section(df, params, 1))
    assert ("2 proposals repeated a measured config and were not launched"
            in html.failures_section(df, params, 2))


@pytest.mark.parametrize("name", ["h200-full", "h200-16gb", "h200-16gb-32b-awq", "h200-24gb-mix",
                                  "h200-steady-8b"])
def test_the_committed_studies_read_without_a_crash_and_stay_unchanged(tmp_path, name, capsys):
    before = (ROOT / "studies" / f"{name}.db").read_bytes()
    assert run_cli(tmp_path, name, "show") == 0
    assert run_cli(tmp_path / "r", name, "report") == 0
    capsys.readouterr()
    for prefer in export.PREFERENCES:
        # a study with no feasible config is one error line and exit code 2, never a traceback
        code = run_cli(tmp_path / prefer, name, "export", "--prefer", prefer, "--json")
        err = capsys.readouterr().err
        assert code in (0, 2), err
        if code == 2:
            assert err.count("\n") == 1 and err.startswith("tuner: error: ")
    assert (ROOT / "studies" / f"{name}.db").read_bytes() == before


def test_the_cli_prints_the_blocks_the_tie_note_and_why_nothing_can_be_exported(tmp_path, capsys):
    # show --all-columns printed every column side by side (2,783 characters a line)
    assert run_cli(tmp_path / "show", "h200-steady-8b", "show", "--all-columns") == 0
    out = capsys.readouterr().out
    assert out.startswith("trial 0  COMPLETE  Pareto")
    assert out.rstrip().endswith("Pareto set: trial 0")      # one member: "trial", not "trials"
    assert max(len(line) for line in out.splitlines()) < 400
    # export said the pick's ties only in best-command.sh, not where the user reads them
    assert run_cli(tmp_path / "export", "h200-full", "export", "--prefer", "single-stream") == 0
    err = capsys.readouterr().err
    assert "# on single-stream speed, trials 2, 4, 8 (206.2-208.4 tok/s) tie with trial 0" in err
    assert "not a measured win over them" in err
    # a study whose only trial is still running: the reason read "(Pareto set: none yet (no
    # trial has been measured)" with a stray parenthesis and a repeated "Pareto set"
    storage = f"sqlite:///{tmp_path / 'running.db'}"
    optuna.create_study(study_name="h200-full", storage=storage,
                        directions=["maximize", "maximize", "minimize"]).ask()
    code = cli.main(["export", "--study", str(ROOT / "studies" / "h200-full.toml"),
                     "--storage", storage, "--results", str(tmp_path / "running")])
    err = capsys.readouterr().err
    assert code == 2
    assert "no feasible measured config yet (no trial has been measured yet)" in err
    assert "Pareto set" not in err


def test_show_into_a_closed_pipe_ends_quietly(tmp_path):
    import subprocess
    import sys

    storage = copied(tmp_path, "studies/h200-full.db")
    shell = (f"{sys.executable} -m tuner show --study {ROOT / 'studies' / 'h200-full.toml'} "
             f"--storage {storage} --all-columns | head -1")
    done = subprocess.run(["bash", "-c", shell], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.stdout.startswith("every trial")
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
