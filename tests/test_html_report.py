"""report.html in headless Chromium: no console error, plots and tables, trials.csv's numbers, commands to copy."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import optuna
import pandas as pd
import pytest

from chromium import Page, need_chromium
from fakes import FAKE_PLATFORM, FAKE_STUDY, FakeCurveDevice
from tuner.results import export, html, report
from tuner.config import parse_study
from tuner.search.study import Tuner

ROOT = Path(__file__).resolve().parents[1]
ODD_NAME = "<b>tight</b> & co"     # a baseline name that must be shown, never parsed as markup
SECTIONS = ("summary", "commands", "front-section", "noise-section", "curves", "contexts", "roofline-section",
            "baselines", "failures-section", "trials-section")

# Every numeric cell of the page: its table, trial, column, full value and the text shown.
CELLS_JS = """[...document.querySelectorAll('tr[data-trial] td[data-value]')].map(td => ({
  table: td.closest('table').id, trial: +td.closest('tr').dataset.trial,
  col: td.dataset.col, value: td.dataset.value, text: td.textContent}))"""


def study_doc(memory_model: bool) -> dict:
    doc = {k: (dict(v) if isinstance(v, dict) else v) for k, v in FAKE_STUDY.items()}
    doc["study"] = {**doc["study"], "memory_model": memory_model, "replicates": 1}
    doc["workload"] = {"prompt_tokens": 16, "output_tokens": 8, "levels": [4, 16],
                       "max_concurrency": 16}
    doc["baselines"] = [{"name": ODD_NAME, "gpu_memory_utilization": 0.2,
                         "max_model_len": 65536, "max_num_seqs": 4}]
    return doc


@pytest.fixture(scope="module")
def curve_study(tmp_path_factory):
    """A study of the fake device with load curves, the memory model's predictions, a roofline,
    replicate noise, a failed relaunch and a launch that failed for memory; a report of it
    written by another reader while a later trial was running; then the finished report."""
    tmp = tmp_path_factory.mktemp("html")
    overrides = {"storage": f"sqlite:///{tmp}/s.db", "results_dir": str(tmp / "results")}
    cfg = parse_study(study_doc(True), "<html test>", overrides)
    # a bandwidth: the roofline is known (1 GB/s over the tiny model's 9 MB: 105 tok/s, so the
    # fake's 100 tok/s is not below [slo] min_roofline_share of it)
    platform = replace(FAKE_PLATFORM, bandwidth_gbps=1.0)
    partial = {}

    def snapshot(launch: int) -> None:
        if "path" in partial or launch < 3:
            return
        # as `python -m tuner report` would, from storage, while a trial runs
        live = optuna.load_study(study_name=cfg.name, storage=cfg.storage)
        df = report.trials_frame(live)
        if (df["state"] == "RUNNING").any():
            partial["running"] = [int(n) for n in df[df["state"] == "RUNNING"]["trial"]]
            partial["path"] = tmp / "partial.html"
            partial["path"].write_text(html.page(live, cfg), encoding="utf-8")
            # the same snapshot as if this tuner had been killed: a pid no process has any more
            dead = subprocess.Popen(["true"])
            dead.wait()
            running = next(t for t in live.get_trials(deepcopy=False) if t.state.name == "RUNNING")
            live._storage.set_trial_user_attr(running._trial_id, "tuner_pid", dead.pid)
            partial["orphaned"] = tmp / "orphaned.html"
            partial["orphaned"].write_text(html.page(live, cfg), encoding="utf-8")
            live._storage.set_trial_user_attr(running._trial_id, "tuner_pid", os.getpid())

    # the hand-tuned config (4 sequences after snapping) fails when launched again
    device = FakeCurveDevice(noise=0.03, seed=2, fail_relaunch_of={4}, during=snapshot)
    Tuner(cfg, measure=device, platform=platform, progress=False).run(5)
    # with the memory model off, a config it would have skipped is launched and fails for memory
    cfg_off = parse_study(study_doc(False), "<html test>", overrides)
    study = optuna.load_study(study_name=cfg.name, storage=cfg.storage)
    study.enqueue_trial({"gpu_memory_utilization": 0.2, "max_model_len": 65536, "max_num_seqs": 16})
    study = Tuner(cfg_off, measure=device, platform=platform, progress=False).run(6)
    folder = cfg.results_path   # the end of `run` wrote the page (report.write_all)
    return SimpleNamespace(cfg=cfg, study=study, folder=folder, page=folder / "report.html",
                           csv=pd.read_csv(folder / "trials.csv"), partial=partial)


@pytest.fixture(scope="module")
def browser():
    need_chromium()
    with Page() as page:
        yield page


def opened(browser: Page, path: Path) -> Page:
    browser.errors.clear()
    browser.open(path.resolve().as_uri())
    return browser


def assert_numbers_equal_csv(cells: list[dict], csv: pd.DataFrame, noise: dict | None = None) -> int:
    """Every number shown equals trials.csv's (full value, and the text as rounded); a front
    member's ± is its std over runs in trials.csv, else the study's noise CV times its figure;
    returns how many were compared."""
    rows = csv.set_index("trial")
    checked = 0
    for c in cells:
        if c["table"] not in ("trials", "front", "levels", "roofline", "baselines", "failures") \
                or c["col"] == "trial":
            continue
        if c["col"].endswith("_pm"):
            key = c["col"][:-len("_pm")]
            std = rows.at[c["trial"], f"{key}_std"] if f"{key}_std" in rows.columns else float("nan")
            want = float(std) if pd.notna(std) else \
                float(rows.at[c["trial"], key]) * (noise or {})[key]["cv"]
        else:
            assert c["col"] in rows.columns, c
            want = float(rows.at[c["trial"], c["col"]])
        assert float(c["value"]) == pytest.approx(want, rel=1e-12, abs=1e-12), c
        shown = c["text"].replace(",", "")
        decimals = len(shown.split(".")[1]) if "." in shown else 0
        assert abs(float(shown) - want) <= 0.5 * 10 ** -decimals + 1e-9, c
        checked += 1
    return checked


def test_page_is_self_contained_and_loads_without_console_errors(curve_study, browser):
    text = curve_study.page.read_text()
    assert "http://" not in text.replace('xmlns="http://www.w3.org/2000/svg"', "").replace(
        'xmlns:xlink="http://www.w3.org/1999/xlink"', "") and "https://" not in text
    page = opened(browser, curve_study.page)
    assert page.errors == []
    # nothing is fetched: every src/href is an anchor inside the page
    refs = page.eval("[...document.querySelectorAll('[src],[href],link,iframe,object')]"
                     ".map(e => e.getAttribute('src') || e.getAttribute('href') || e.tagName)")
    assert all(r.startswith("#") for r in refs), refs
    assert page.eval("[...document.querySelectorAll('section')].map(s => s.id)") == list(SECTIONS)


def test_plots_and_tables_are_rendered(curve_study, browser, tmp_path):
    page = opened(browser, curve_study.page)
    for plot in ("pareto", "curves", "parameters"):
        box = page.eval(f"(() => {{ const s = document.querySelector('#plot-{plot} svg');"
                        " const r = s.getBoundingClientRect(); return [r.width, r.height,"
                        " s.querySelectorAll('path, use').length]; })()")
        assert box[0] > 300 and box[1] > 200 and box[2] > 10, (plot, box)
    rows = page.eval("Object.fromEntries([...document.querySelectorAll('table')].map(t =>"
                     " [t.id, t.querySelectorAll('tbody tr').length]))")
    csv = curve_study.csv
    assert rows["trials"] == len(csv)
    assert rows["front"] == int(csv["pareto"].sum()) >= 1
    assert rows["levels"] == int(csv["c16_throughput_tok_s"].notna().sum()) >= 3
    assert rows["roofline"] == int(csv["roofline_pct"].notna().sum()) >= 1
    assert rows["baselines"] == int(csv["baseline"].notna().sum()) == 3
    assert rows["failures"] == int((csv["failure"].notna() | (csv["state"] != "COMPLETE")
                                    | csv["relaunch_failed"].notna()).sum())
    assert rows["noise"] == len(json.loads((curve_study.folder / "noise.json").read_text())) == 3
    # one row per context length a trial had, as contexts.csv has them
    assert rows["contexts"] == len(pd.read_csv(curve_study.folder / "contexts.csv")) \
        == csv["max_model_len"].nunique() >= 2
    # the screenshot shows them: the plots' area is far from blank
    import matplotlib.image

    shot = matplotlib.image.imread(page.screenshot(tmp_path / "report.png"))
    assert shot.shape[0] > 2000
    ink = (shot[..., :3].mean(axis=2) < 0.9).mean()
    assert ink > 0.03, ink


def test_numbers_shown_equal_trials_csv(curve_study, browser):
    page = opened(browser, curve_study.page)
    cells = page.eval(CELLS_JS)
    noise = json.loads((curve_study.folder / "noise.json").read_text())
    checked = assert_numbers_equal_csv(cells, curve_study.csv, noise)
    assert any(c["col"].endswith("_pm") for c in cells)     # the front's spreads are shown
    tables = {c["table"] for c in cells}
    assert {"trials", "front", "levels", "roofline", "baselines", "failures"} <= tables
    # each measured config's curve: every level's throughput and TTFT p50 is on the page
    levels = {(c["trial"], c["col"]) for c in cells if c["table"] == "levels"}
    for _, row in curve_study.csv[curve_study.csv["c16_throughput_tok_s"].notna()].iterrows():
        for name in ("single_stream", "c4", "c16"):
            for key in ("throughput_tok_s", "ttft_ms", "ttft_ms_p90"):
                assert (int(row["trial"]), f"{name}_{key}") in levels
    assert checked > 100


def test_noise_is_the_measured_one(curve_study, browser):
    page = opened(browser, curve_study.page)
    noise = json.loads((curve_study.folder / "noise.json").read_text())
    shown = page.eval("[...document.querySelectorAll('#noise tbody tr')].map(tr =>"
                      " [tr.cells[0].textContent, +tr.cells[1].dataset.value])")
    assert {k: v for k, v in shown} == pytest.approx({k: 100 * v["cv"] for k, v in noise.items()})
    assert page.eval("document.querySelector('#noise-section p').textContent") == \
        report.describe_noise(noise)


def test_a_command_per_preference_and_the_copy_button_copies_it(curve_study, browser):
    page = opened(browser, curve_study.page)
    page.send("Browser.grantPermissions", permissions=["clipboardReadWrite",
                                                       "clipboardSanitizedWrite"])
    df = report.trials_frame(curve_study.study, curve_study.cfg.tie_tolerance)
    front = df[df["pareto"]]
    for prefer in export.PREFERENCES:
        row = export.choose(front, prefer, df.attrs["noise"], curve_study.cfg.tie_tolerance)
        want = export.command(row, curve_study.study, curve_study.cfg)
        box = page.eval(f"(() => {{ const b = document.querySelector("
                        f"'button.copy[data-target=cmd-{prefer}]'); b.scrollIntoView();"
                        " const r = b.getBoundingClientRect();"
                        " return [r.x + r.width / 2, r.y + r.height / 2]; })()")
        assert page.eval(f"document.getElementById('cmd-{prefer}').textContent") == want
        assert page.eval(f"+document.querySelector('.command[data-prefer={prefer}]')"
                         ".dataset.trial") == int(row["trial"])
        for kind in ("mousePressed", "mouseReleased"):   # a real click: a user gesture
            page.send("Input.dispatchMouseEvent", type=kind, x=box[0], y=box[1], button="left",
                      clickCount=1)
        assert page.eval("navigator.clipboard.readText()") == want
        assert page.eval(f"document.querySelector('button.copy[data-target=cmd-{prefer}]')"
                         ".textContent") == "copied"
    assert page.errors == []


def test_failures_show_the_reason_and_the_memory_models_prediction(curve_study, browser):
    page = opened(browser, curve_study.page)
    rows = page.eval("[...document.querySelectorAll('#failures tbody tr')].map(tr =>"
                     " [+tr.dataset.trial, Object.fromEntries([...tr.cells].filter(td =>"
                     " td.dataset.col).map(td => [td.dataset.col, td.textContent]))])")
    csv = curve_study.csv.set_index("trial")
    kinds = set()
    for trial, cells in rows:
        want = csv.loc[trial]
        kinds.add(want["failure"] if isinstance(want["failure"], str) else "relaunch_failed")
        for col in ("failure_message", "predicted_reason", "relaunch_failed"):
            if col in want.index and isinstance(want[col], str):
                assert cells[col] == want[col], (trial, col)
    assert {"kv_cache_too_small", "predicted_infeasible", "relaunch_failed"} <= kinds
    kv = next(cells for trial, cells in rows if csv.at[trial, "failure"] == "kv_cache_too_small")
    assert kv["failure_message"].startswith("estimated maximum model length is")
    assert "estimated_max_model_len" in kv
    legend = page.eval("document.querySelector('#failures-section ul.kinds').textContent")
    assert "kv_cache_too_small ×1: the KV cache left after the weights" in legend


def test_baselines_are_marked_and_their_names_escaped(curve_study, browser):
    page = opened(browser, curve_study.page)
    badges = page.eval("[...document.querySelectorAll('#baselines .badge.baseline')]"
                       ".map(b => b.textContent)")
    assert sorted(badges) == sorted(f"baseline: {n}" for n in
                                    ("vllm-defaults", "hand-tuned", ODD_NAME))
    assert page.eval("[...document.querySelectorAll('b')].filter(b => b.textContent == 'tight')"
                     ".length") == 0
    assert "&lt;b&gt;tight&lt;/b&gt; &amp; co" in curve_study.page.read_text()


def test_report_of_a_killed_tuner_s_trial_does_not_say_the_study_is_running(curve_study, browser):
    page = opened(browser, curve_study.partial["orphaned"])
    assert page.errors == []
    assert page.eval("document.getElementById('partial')") is None
    said = page.eval("document.getElementById('orphaned').textContent")
    assert "1 trial shown as running belongs to a tuner that is gone" in said


def test_report_of_a_study_still_running_marks_the_running_trial(curve_study, browser):
    partial = curve_study.partial
    assert len(partial["running"]) == 1
    page = opened(browser, partial["path"])
    assert page.errors == []
    assert "still running: 1 trial in progress" in page.eval(
        "document.getElementById('partial').textContent")
    running = page.eval("[...document.querySelectorAll('#trials tr')].filter(tr =>"
                        " tr.querySelector('.badge.running')).map(tr => +tr.dataset.trial)")
    assert running == partial["running"]
    # what was finished by then is there, with the numbers storage held then
    assert page.eval("document.querySelectorAll('#front tbody tr').length") >= 1
    assert page.eval("document.querySelectorAll('#plot-pareto svg').length") == 1


def test_committed_h200_study_through_the_report_command(tmp_path, browser):
    """The real H200 study (no per-level records): `python -m tuner report` writes the page."""
    shutil.copy(ROOT / "studies" / "h200-full.db", tmp_path / "h200-full.db")
    out = subprocess.run([sys.executable, "-m", "tuner", "report", "--study",
                          "studies/h200-full.toml", "--storage",
                          f"sqlite:///{tmp_path}/h200-full.db", "--results", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    folder = tmp_path / "h200-full"
    csv = pd.read_csv(folder / "trials.csv")
    page = opened(browser, folder / "report.html")
    assert page.errors == []
    assert assert_numbers_equal_csv(page.eval(CELLS_JS), csv) > 100
    assert page.eval("document.querySelectorAll('#roofline tbody tr').length") == \
        int(csv["roofline_pct"].notna().sum()) > 0
    assert page.eval("document.querySelectorAll('.command').length") == len(export.PREFERENCES)
    assert "no load levels recorded" in page.eval("document.getElementById('curves').textContent")
    assert "NVIDIA H200" in page.eval("document.getElementById('summary').textContent")


MARKUP = '<img src=x onerror="console.error(1)"><script>console.error(2)</script>'


def test_every_string_from_storage_is_escaped(tmp_path, browser):
    """Markup in what storage holds (messages, names, the command, the device) stays text."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution
    from optuna.trial import TrialState, create_trial

    cfg = parse_study(study_doc(False), "<html test>", {"storage": f"sqlite:///{tmp_path}/m.db",
                                                        "results_dir": str(tmp_path)})
    study = optuna.create_study(study_name=cfg.name, storage=cfg.storage,
                                directions=["maximize", "maximize", "minimize"])
    study.set_user_attr("config", {"model": MARKUP, "workload": {"prompt_tokens": MARKUP}})
    dists = {"gpu_memory_utilization": FloatDistribution(0.1, 0.9, step=0.1),
             "max_model_len": CategoricalDistribution([1024, 4096]),
             "max_num_seqs": CategoricalDistribution([1, 4])}
    params = {"gpu_memory_utilization": 0.5, "max_model_len": 1024, "max_num_seqs": 4}
    common = {"gpu_name": MARKUP, "vllm_version": MARKUP, "baseline": MARKUP,
              "baseline_source": MARKUP, "predicted_reason": MARKUP,
              "command": shlex.join(["vllm", "serve", MARKUP, "--max-num-seqs", "4"])}
    study.add_trial(create_trial(state=TrialState.COMPLETE, values=[90.0, 400.0, 40.0],
                                 params=params, distributions=dists,
                                 user_attrs={**common, "failure": ""},
                                 constraints={"memory": 0.0, "launch": 0.0}))
    study.add_trial(create_trial(state=TrialState.COMPLETE, values=[0.0, 0.0, 1e6],
                                 params={**params, "max_model_len": 4096}, distributions=dists,
                                 user_attrs={**common, "failure": MARKUP, "failure_message": MARKUP},
                                 constraints={"memory": 1.0, "launch": 0.0}))
    path = html.write(study, cfg)
    page = opened(browser, path)
    assert page.errors == []                  # neither the img's handler nor the script ran
    assert page.eval("document.images.length") == 0
    assert page.eval("document.scripts.length") == 1          # the page's own
    text = page.eval("document.body.innerText")
    assert text.count(MARKUP) >= 5            # shown as text: summary, badges, tables, failure
    assert MARKUP in page.eval("document.getElementById('cmd-balanced').textContent")


def test_plot_text_is_escaped_in_the_inline_svg():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def draw(path):
        fig, ax = plt.subplots()
        ax.set_title(MARKUP)
        fig.savefig(path)
        plt.close(fig)
        return path

    svg = html.svg(draw, "t")
    assert svg.startswith("<svg") and "<img" not in svg and "<script" not in svg
    assert "&lt;img src=x" in svg
    assert 'id="t-' in svg and "<metadata>" not in svg


def test_every_failure_kind_an_engine_or_the_study_names_has_a_meaning():
    """The report's failure list explains each kind to a reader who has not read the engine's
    logs: every kind in the three engines' log tables, the study's own, and X_under_load."""
    import re

    from tuner.engines import llamacpp, sglang_logs, vllm_logs

    kinds = {p.kind for p in vllm_logs.FAILURE_PATTERNS}
    kinds |= {k for k, _ in llamacpp._FAILURES} | {k for k, _ in sglang_logs._FAILURES}
    source = "".join(p.read_text() for p in Path(html.__file__).parent.parent.rglob("*.py"))
    kinds |= set(re.findall(r'set_user_attr\("failure", "([a-z_]+)"', source))
    kinds |= set(re.findall(r'\["failure"\] = "([a-z_]+)"', source))
    kinds |= {"crashed", "startup_timeout"}
    missing = sorted(k for k in kinds if not html.failure_meaning(k))
    assert not missing, missing
    assert html.failure_meaning("oom_under_load").startswith(html.FAILURE_MEANING["oom"])
    assert "under load" in html.failure_meaning("crashed_under_load")


def test_the_summary_names_the_length_mix_the_trace_and_the_slo():
    from tuner.results.html import describe_workload

    trace = describe_workload({"prompt_tokens": 64, "output_tokens": 32, "length_mix": "trace",
                               "length_trace": "/x/tuner/load/traces/example.jsonl", "levels": [4, 8],
                               "max_concurrency": 64, "slo_ttft_ms": 150.0})
    assert "lengths from the trace example.jsonl" in trace and "levels [4, 8]" in trace
    assert "max_concurrency" not in trace          # unused when the levels are given
    assert "[slo] ttft_ms p90 <= 150" in trace
    mix = describe_workload({"prompt_tokens": 64, "output_tokens": 32, "length_mix": "uniform",
                             "prompt_tokens_mix": [100, 900], "output_tokens_mix": [16, 64],
                             "max_concurrency": 32, "ttft_level": 8})
    assert "uniform lengths, prompt [100, 900] output [16, 64]" in mix
    assert "max_concurrency 32" in mix and "ttft_level 8" in mix


# ---------------------------------------------------------------- studies built straight in storage

def stored_study(tmp_path: Path, trials: list[dict], name: str = "fake", study_attrs: dict | None = None,
                 doc: dict | None = None, **study_keys):
    """A study written to sqlite with optuna's create_trial, no launch: each trial a dict of
    values (single-stream, throughput, TTFT), params, attrs, constraints, state. Returns (cfg,
    study), `cfg` parsed from `doc` (default study_doc(False)) with `study_keys` in [study]."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution
    from optuna.trial import TrialState, create_trial

    doc = doc or study_doc(False)
    doc["study"] = {**doc["study"], "name": name, **study_keys}
    cfg = parse_study(doc, "<stored>", {"storage": f"sqlite:///{tmp_path}/stored.db",
                                        "results_dir": str(tmp_path / "results")})
    study = optuna.create_study(study_name=cfg.name, storage=cfg.storage,
                                directions=["maximize", "maximize", "minimize"])
    study.set_user_attr("config", {"model": "preset:tiny", "workload": {"prompt_tokens": 16}})
    for key, value in (study_attrs or {}).items():
        study.set_user_attr(key, value)
    dists = {"gpu_memory_utilization": FloatDistribution(0.1, 0.9, step=0.1),
             "max_model_len": CategoricalDistribution([1024, 4096, 16384, 65536]),
             "max_num_seqs": CategoricalDistribution([1, 4, 16, 64])}
    for t in trials:
        params = {"gpu_memory_utilization": 0.5, "max_model_len": 1024, "max_num_seqs": 4,
                  **t.get("params", {})}
        constraints = {"memory": 0.0, "launch": 0.0, **t.get("constraints", {})}
        study.add_trial(create_trial(
            state=t.get("state", TrialState.COMPLETE), values=t.get("values"), params=params,
            distributions=dists, user_attrs={"failure": "", **t.get("attrs", {})},
            constraints=constraints))
    return cfg, study


DEFAULTS = {"baseline": "vllm-defaults"}
# trial 0: the defaults baseline, launched twice (noise measured); trial 1 beats it on every
# objective by a few %, within that noise (a tie); trial 2 far below; trial 3 screened unlaunched
TIED = [{"values": [100.0, 1000.0, 50.0], "attrs": DEFAULTS},
        {"values": [103.0, 1030.0, 48.0], "params": {"max_num_seqs": 16, "max_model_len": 4096}},
        {"values": [50.0, 500.0, 100.0], "params": {"max_num_seqs": 1}},
        {"values": [0.0, 0.0, 1e6], "params": {"max_num_seqs": 64, "max_model_len": 16384},
         "attrs": {"failure": "predicted_dominated", "failure_message": "beaten by trial 1",
                   "screened_by": 1},
         "constraints": {"launch": 1.0}}]
REPLICATE = {"runs:0": [{"kind": "replicate", "failure": "", "single_stream_tok_s": 98.0,
                         "throughput_tok_s": 990.0, "ttft_ms": 51.0}]}


@pytest.fixture
def tied(tmp_path):
    cfg, study = stored_study(tmp_path, TIED, study_attrs=REPLICATE, tie_tolerance=0.1)
    df = report.trials_frame(study, cfg.tie_tolerance)
    assert list(df["pareto"]) == [True, True, False, False]
    assert list(df["strict_pareto"]) == [False, True, False, False]
    return SimpleNamespace(cfg=cfg, study=study, df=df)


def test_each_command_carries_the_tie_note_export_prints(tied):
    import re

    text = html.page(tied.study, tied.cfg, tied.df)
    front = tied.df[tied.df["pareto"]]
    noise = tied.df.attrs["noise"]
    notes = 0
    for prefer in export.PREFERENCES:
        row = export.choose(front, prefer, noise, tied.cfg.tie_tolerance)
        why = export.choice_note(front, row, prefer, noise, tied.cfg.tie_tolerance)
        block = re.search(rf'<div class="command" data-prefer="{prefer}".*?</div></div>', text, re.S)
        assert block, prefer
        if why:
            notes += 1
            assert f'<p class="why">{html.html.escape(why)}</p>' in block.group(0), prefer
            assert "the defaults baseline" in why
    assert notes == len(export.PREFERENCES)    # trial 1 is every pick; trial 0 ties it, simpler


def test_pareto_plot_numbers_the_front_marks_ties_hollow_and_draws_the_spread(tied):
    import matplotlib.pyplot as plt
    from matplotlib.container import ErrorbarContainer

    fig = report.projections_figure(tied.df, "t")
    try:
        for ax in fig.axes:
            texts = {t.get_text() for t in ax.texts}
            assert {"0", "1"} <= texts and "2" not in texts        # front members only
            assert any(isinstance(c, ErrorbarContainer) for c in ax.containers)
        labels = fig.axes[0].get_legend().get_texts()
        labels = [t.get_text() for t in labels]
        assert any("ties within noise" in label for label in labels)
        assert any(label.startswith("Pareto set (strict") for label in labels)
        hollow = [c for c in fig.axes[0].collections if c.get_label() == report.TIE_STYLE["label"]]
        assert len(hollow) == 1 and len(hollow[0].get_offsets()) == 1
        assert hollow[0].get_offsets()[0][0] == pytest.approx(tied.df.at[0, "single_stream_tok_s"])
    finally:
        plt.close(fig)


def test_parameters_plot_gives_a_screened_config_its_own_marker(tied):
    import matplotlib.pyplot as plt

    fig = report.parameters_figure(tied.df, "t")
    try:
        labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
        assert "not launched: predicted dominated" in labels
        assert not any(label.startswith("infeasible") for label in labels), labels
    finally:
        plt.close(fig)


def test_a_replicate_launch_in_progress_says_the_study_is_running(tmp_path):
    import socket

    running = {"pgid": 1, "port": 1, "host": socket.gethostname(), "tuner_pid": os.getpid(),
               "trial": 0, "kind": "replicate"}
    cfg, study = stored_study(tmp_path, TIED[:2], study_attrs={"relaunch_server": running})
    text = html.page(study, cfg)
    assert 'id="partial-relaunch"' in text
    assert "still running: a replicate launch of trial 0 is in progress" in text
    dead = subprocess.Popen(["true"])
    dead.wait()
    study.set_user_attr("relaunch_server", {**running, "tuner_pid": dead.pid})
    text = html.page(study, cfg)
    assert 'id="partial-relaunch"' not in text and 'id="orphaned-relaunch"' in text
    study.set_user_attr("relaunch_server", {})        # what the tuner leaves after the launch
    text = html.page(study, cfg)
    assert "relaunch" not in text and 'id="partial"' not in text


COALESCED_LEVELS = [
    {"name": "single_stream", "concurrency": 1, "throughput_tok_s": 90.0, "ttft_ms": 60.0,
     "tpot_ms": 0.0, "tpot_ms_p90": 0.0017, "itl_ms": 0.0, "itl_ms_p90": 0.0, "e2e_ms": 60.0},
    {"name": "c4", "concurrency": 4, "throughput_tok_s": 900.0, "ttft_ms": 80.0,
     "decode_tok_s": 120.0, "tpot_ms": 8.0, "tpot_ms_p90": 9.0, "itl_ms": 7.5, "itl_ms_p90": 9.5,
     "e2e_ms": 150.0}]


def test_a_rebuilt_report_removes_what_storage_no_longer_backs(tmp_path):
    """Report, then the study created anew at the same storage URL with nothing measured: the
    first report's command, curves and trial logs go; what the tool did not write stays."""
    from optuna.trial import TrialState

    measured = {"values": [90.0, 900.0, 80.0],
                "attrs": {**DEFAULTS, "levels": COALESCED_LEVELS, "single_stream_tok_s": 90.0,
                          "single_stream_source": "server_itl"}}
    cfg, study = stored_study(tmp_path, [measured, {"state": TrialState.RUNNING}])
    folder = cfg.results_path
    for n in ("0", "1", "7", "notes"):
        (folder / "trials" / n).mkdir(parents=True)
        (folder / "trials" / n / "server.log").write_text("log\n")
    (folder / "mine.txt").write_text("a person's notes\n")
    report.write_all(study, cfg)
    assert {"best-command.sh", "curves.png", "pareto.png", "parameters.png"} <= \
        {p.name for p in folder.iterdir()}
    assert sorted(p.name for p in (folder / "trials").iterdir()) == ["0", "1", "notes"]
    # levels.csv: the coalesced level's per-token figures blank, where single stream came from
    levels = pd.read_csv(folder / "levels.csv").set_index("name")
    assert levels.loc["single_stream", ["tpot_ms", "tpot_ms_p90", "itl_ms"]].isna().all()
    assert bool(levels.at["single_stream", "coalesced"]) and not bool(levels.at["c4", "coalesced"])
    assert levels.at["single_stream", "single_stream_source"] == "server_itl"
    assert levels.at["c4", "tpot_ms"] == 8.0
    assert "0.00" not in html.page(study, cfg).split('id="levels"')[1].split("</table>")[0]

    optuna.delete_study(study_name=cfg.name, storage=cfg.storage)
    study = optuna.create_study(study_name=cfg.name, storage=cfg.storage,
                                directions=["maximize", "maximize", "minimize"])
    report.write_all(study, cfg)
    left = {p.name for p in folder.iterdir()}
    assert "best-command.sh" not in left and "curves.png" not in left
    assert {"report.html", "trials.csv", "levels.csv", "mine.txt", "pareto.png"} <= left
    assert sorted(p.name for p in (folder / "trials").iterdir()) == ["notes"]
    assert (folder / "levels.csv").read_text().startswith("trial,launch,kind,name,")


def test_a_llamacpp_report_names_its_engine(tmp_path):
    from tuner import config, engines

    try:
        cfg = config.load_study(ROOT / "studies" / "demo-llamacpp.toml",
                                {"storage": f"sqlite:///{tmp_path}/l.db",
                                 "results_dir": str(tmp_path)})
        from optuna.distributions import CategoricalDistribution
        from optuna.trial import create_trial

        study = optuna.create_study(study_name=cfg.name, storage=cfg.storage,
                                    directions=["maximize", "maximize", "minimize"])
        study.add_trial(create_trial(
            values=[0.0, 0.0, 1e6], params={"ctx_size": 1024, "parallel": 4},
            distributions={"ctx_size": CategoricalDistribution([1024, 2048]),
                           "parallel": CategoricalDistribution([1, 4])},
            user_attrs={"failure": "load_test_failed", "vllm_version": "xllamacpp 2026.10",
                        "failure_message": "no measurement of single_stream_tok_s",
                        "needed_gib": 1.5},
            constraints={"load_test": 1.0}))
        text = html.page(study, cfg)
    finally:
        engines.use(engines.DEFAULT)
    assert "<dt>llama.cpp</dt><dd>xllamacpp 2026.10</dd>" in text
    assert "llama.cpp: what the failed launch" in text and "llama.cpp: needed GiB" in text
    assert "vLLM" not in text
