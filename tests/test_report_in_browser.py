"""report.html of the committed studies as a reader sees it in headless Chromium: an empty front,
the spreads of every table, words for yes/no, small figures, the command's line breaks, plots."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from chromium import Page, need_chromium
from tuner.results import html, report

ROOT = Path(__file__).resolve().parents[1]

# (study file or "demo", storage copied from, name)
STUDIES = {"h200-24gb-mix": ("studies/h200-24gb-mix.toml", "tests/data/studies/h200-24gb-mix-3-trials.db", None),
           "h200-steady-8b": ("studies/h200-steady-8b.toml", "studies/h200-steady-8b.db", None),
           "demo-seed2": ("demo", "results/front-stability/demo-seed2.db", "demo-seed2"),
           "demo-seed5": ("demo", "results/front-stability/demo-seed5.db", "demo-seed5")}


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """`python -m tuner report` of copies of the committed studies (the committed files untouched)."""
    tmp = tmp_path_factory.mktemp("reports")
    out = {}
    for name, (study, db, given) in STUDIES.items():
        shutil.copy(ROOT / db, tmp / f"{name}.db")
        argv = [sys.executable, "-m", "tuner", "report", "--study", study,
                "--storage", f"sqlite:///{tmp}/{name}.db", "--results", str(tmp)]
        if given:
            argv += ["--name", given]
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        out[name] = tmp / name
    return out


@pytest.fixture(scope="module")
def browser():
    need_chromium()
    with Page() as page:
        yield page


def opened(browser: Page, path: Path) -> Page:
    browser.errors.clear()
    browser.open(path.resolve().as_uri())
    assert browser.errors == []
    return browser


def test_an_empty_front_says_why_and_shows_no_table_of_headers(reports, browser):
    """h200-24gb-mix: both trials miss a constraint; the page said "0 configs no other beats
    beyond the measured noise" over a table of the headers trial and marks alone."""
    page = opened(browser, reports["h200-24gb-mix"] / "report.html")
    text = page.eval("document.getElementById('front-section').textContent")
    assert "0 configs" not in text
    assert "none yet" in text and "requirement_not_met" in text and "kv_cache_too_small" in text
    assert page.eval("document.getElementById('front') === null")
    # the commands section agrees: nothing to export
    assert "no command to export" in page.eval("document.getElementById('commands').textContent")


def test_every_trial_and_every_baseline_carry_the_spread_that_was_measured(reports, browser):
    """h200-steady-8b: trial 0 ran 3 times (std measured); the commands and the front showed
    its ±, the trials and baselines tables the bare figure."""
    folder = reports["h200-steady-8b"]
    csv = pd.read_csv(folder / "trials.csv")
    page = opened(browser, folder / "report.html")
    for table in ("trials", "baselines", "front"):
        shown = page.eval(f"Object.fromEntries([...document.querySelectorAll('#{table} "
                          "td[data-col$=\"_pm\"]')].map(td => [td.dataset.col, +td.dataset.value]))")
        for key in report.OBJECTIVES:
            assert shown[f"{key}_pm"] == pytest.approx(float(csv.at[0, f"{key}_std"])), (table, key)
        heads = page.eval(f"[...document.querySelectorAll('#{table} th')].map(th => th.textContent)")
        assert "TTFT p50 ms ±" in heads
    # a study with no noise and one run each shows no empty ± columns
    page = opened(browser, reports["h200-24gb-mix"] / "report.html")
    assert page.eval("document.querySelectorAll('#trials td[data-col$=\"_pm\"]').length") == 0


def test_the_trials_spread_is_the_one_show_prints(reports, browser):
    """demo-seed2: a config run once carries the study's noise × its figure, as `show` prints."""
    folder = reports["demo-seed2"]
    csv = pd.read_csv(folder / "trials.csv").set_index("trial")
    import json

    noise = json.loads((folder / "noise.json").read_text())
    page = opened(browser, folder / "report.html")
    cells = page.eval("[...document.querySelectorAll('#trials td[data-value][data-col$=\"_pm\"]')].map(td =>"
                      " [+td.closest('tr').dataset.trial, td.dataset.col, +td.dataset.value])")
    assert len(cells) >= 3 * 8
    for trial, col, value in cells:
        key = col[:-len("_pm")]
        std = csv.at[trial, f"{key}_std"] if f"{key}_std" in csv.columns else float("nan")
        want = std if pd.notna(std) else csv.at[trial, key] * noise[key]["cv"]
        assert value == pytest.approx(want), (trial, col)


def test_booleans_read_as_words_and_small_figures_keep_their_digits(reports, browser):
    """demo-seed5: the failures table said "model: fits False"/"True" and a 0.0039 GiB KV need
    "0.00"; the roofline table (h200-steady-8b) said "offload suspected False"."""
    page = opened(browser, reports["demo-seed5"] / "report.html")
    fits = page.eval("[...document.querySelectorAll('#failures td[data-col=\"predicted_fits\"]')]"
                     ".map(td => td.textContent)")
    assert fits and set(fits) <= {"yes", "no", ""}, fits
    needed = page.eval("[...document.querySelectorAll('#failures td[data-col=\"predicted_needed_gib\"]')]"
                       ".map(td => [td.textContent, +td.dataset.value])")
    assert needed
    for text, value in needed:
        assert float(text.replace(",", "")) != 0 or value == 0, (text, value)
        assert float(text.replace(",", "")) == pytest.approx(value, rel=0.02, abs=0.005)
    body = page.eval("document.body.innerText")
    assert "False" not in body and "True" not in body
    page = opened(browser, reports["h200-steady-8b"] / "report.html")
    assert page.eval("[...document.querySelectorAll('#roofline td[data-col=\"offload_suspected\"]')]"
                     ".map(td => td.textContent)") == ["no"]


def test_fmt_words_and_small_numbers():
    import numpy as np

    assert html.fmt(True, None) == "yes" and html.fmt(np.bool_(False), None) == "no"
    assert html.fmt(0.0039, 2) == "0.0039" and html.fmt(-0.004, 2) == "-0.004"
    assert html.fmt(0.0, 2) == "0.00" and html.fmt(1234.5, 1) == "1,234.5"
    assert html.cell(np.bool_(True), "predicted_fits", None) == \
        '<td data-col="predicted_fits">yes</td>'


def test_failure_column_legend_only_under_a_failures_table(reports, browser):
    """h200-steady-8b: "no launch failed" was followed by the legend of the table's columns
    ("vLLM: what the failed launch's log said; model: ...") with no table to explain."""
    page = opened(browser, reports["h200-steady-8b"] / "report.html")
    text = page.eval("document.getElementById('failures-section').textContent")
    assert "no launch failed" in text and "what the failed launch's log said" not in text
    page = opened(browser, reports["demo-seed5"] / "report.html")
    text = page.eval("document.getElementById('failures-section').textContent")
    assert "what the failed launch's log said" in text


def test_a_long_command_wraps_between_flags_never_inside_one(reports, browser):
    """demo-seed2's command is longer than the page at 1400 px: word-break:break-all cut it as
    "--en" / "force-eager"; each token must sit on one line."""
    page = opened(browser, reports["demo-seed2"] / "report.html")
    page.send("Emulation.setDeviceMetricsOverride", width=900, height=1000, deviceScaleFactor=1,
              mobile=False)
    split = page.eval("""(() => {
      const codes = [...document.querySelectorAll('.cmdline code')];
      const lines = Math.max(...codes.map(code => code.getClientRects().length));  // line boxes
      const out = [];
      for (const code of codes) {
        const node = document.createTreeWalker(code, NodeFilter.SHOW_TEXT);
        while (node.nextNode()) {   // every word of the command, wherever the markup puts it
          const text = node.currentNode.textContent;
          let at = 0;
          for (const word of text.split(' ')) {
            const r = document.createRange();
            r.setStart(node.currentNode, at); r.setEnd(node.currentNode, at + word.length);
            const tops = new Set([...r.getClientRects()].filter(b => b.width > 0)
                                 .map(b => Math.round(b.top)));
            if (tops.size > 1) out.push(word);
            at += word.length + 1;
          }
        }
      }
      const copied = codes.map(code => code.textContent);
      return [out, lines, copied]; })()""")
    page.send("Emulation.clearDeviceMetricsOverride")
    broken, lines, copied = split
    assert lines >= 2          # the command did wrap at this width
    assert broken == [], broken
    # what the copy button copies is the command, one line, as `export` prints it
    assert all(c.startswith(sys.executable.split("/.venv/")[0]) or "--max-model-len" in c
               for c in copied)
    assert all("\n" not in c and "  " not in c for c in copied)


def test_a_badge_never_wraps_inside_itself(reports, browser):
    """demo-seed2's level table squeezes the marks column: "baseline: vllm-defaults" broke over
    three lines inside its badge."""
    page = opened(browser, reports["demo-seed2"] / "report.html")
    page.send("Emulation.setDeviceMetricsOverride", width=900, height=1000, deviceScaleFactor=1,
              mobile=False)
    lines = page.eval("[...document.querySelectorAll('.badge')].map(b =>"
                      " Math.round(b.getBoundingClientRect().height /"
                      " parseFloat(getComputedStyle(b).lineHeight || 16)))")
    page.send("Emulation.clearDeviceMetricsOverride")
    assert lines and max(lines) <= 1, lines


def _svg_text(draw, name: str) -> str:
    import re

    return " ".join(re.findall(r">([^<>]+)</text>", html.svg(draw, name)))


def test_parallel_coordinates_ends_are_plain_numbers_and_units_read_as_units(reports):
    import optuna

    from tuner.config import load_study

    folder = reports["demo-seed2"]
    cfg = load_study(ROOT / "studies" / "demo.toml", {"name": "demo-seed2", "storage": f"sqlite:///{folder}.db",
                              "results_dir": str(folder.parent)})
    study = optuna.load_study(study_name=cfg.name, storage=cfg.storage)
    df = report.trials_frame(study, cfg.tie_tolerance, cfg.requirement)
    text = _svg_text(lambda p: report.plot_parameters(df, p, cfg.name), "parameters")
    assert "32,768" in text and "e+0" not in text
    assert "tok/s" in text


def test_every_plot_marks_the_baselines_as_the_page_says(reports):
    """The baselines section says they are "marked in every table and plot": the fit map and
    the load curves did not."""
    import optuna

    from tuner.config import load_study

    folder = reports["demo-seed2"]
    cfg = load_study(ROOT / "studies" / "demo.toml", {"name": "demo-seed2",
                                                     "storage": f"sqlite:///{folder}.db",
                                                     "results_dir": str(folder.parent)})
    study = optuna.load_study(study_name=cfg.name, storage=cfg.storage)
    df = report.trials_frame(study, cfg.tie_tolerance, cfg.requirement)
    text = _svg_text(lambda p: report.plot_parameters(df, p, cfg.name), "parameters")
    assert "vllm-defaults" in text and "hand-tuned" in text and "baseline" in text
    levels = report.levels_frame(study)
    curves = _svg_text(lambda p: report.plot_curves(df, levels, p, cfg.name), "curves")
    assert "trial 0 (baseline vllm-defaults)" in curves     # on the front
    assert "trial 1 (baseline hand-tuned)" in curves         # off it: dashed, still named
