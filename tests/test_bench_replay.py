"""The tabular replay behind bench/search_efficiency.py and bench/wasted_launches.py, on a made-up grid."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import search_efficiency as se  # noqa: E402
from tuner.run.process import LaunchSpec  # noqa: E402
from tuner.search.space import ServerParams  # noqa: E402


def test_hypervolume_of_boxes_anchored_at_the_origin():
    assert se.hypervolume([(1.0, 1.0, 1.0)]) == pytest.approx(1.0)
    assert se.hypervolume([(0.5, 1.0, 1.0), (1.0, 0.5, 1.0)]) == pytest.approx(0.75)
    # a dominated point adds nothing; a point on the reference plane adds nothing
    assert se.hypervolume([(1.0, 1.0, 0.5), (0.5, 0.5, 0.5), (0.0, 1.0, 1.0)]) == pytest.approx(0.5)
    # two boxes that overlap in all three: 0.5 + 0.5 - 0.25
    assert se.hypervolume([(1.0, 1.0, 0.5), (0.5, 0.5, 1.0)]) == pytest.approx(0.5 + 0.25 - 0.125)


def test_table_answers_like_the_launcher():
    table = se.synthetic_table(node_gib=12.0)
    spec = lambda gmu, mml, mns: LaunchSpec(model="m", params=ServerParams(  # noqa: E731
        gpu_memory_utilization=gmu, max_model_len=mml, max_num_seqs=mns), log_path="x.log")
    failed = table.outcome(spec(0.05, 2048, 1))
    assert failed.failure.kind == "no_cache_blocks" and failed.failure.is_memory
    ran = table.outcome(spec(0.12, 8192, 4))
    assert ran.failure is None and ran.metrics.throughput_tok_s > 0
    assert ran.capacity.kv_cache_tokens > 8192
    with pytest.raises(se.TableError, match="not in the table"):
        table.outcome(spec(0.3, 8192, 4))


def test_the_replay_refuses_bad_input_in_one_line(tmp_path, capsys):
    # a reviewer's tables: none there, none that ran, one missing configs of the study's space
    assert se.main(["--table", str(tmp_path / "none.csv"), "--seeds", "1"]) == 2
    assert "no table at" in capsys.readouterr().err
    import pandas as pd

    grid = pd.read_csv(se.TABLE)
    failed = tmp_path / "failed.csv"
    grid.assign(failure="no_cache_blocks", feasible=False).to_csv(failed, index=False)
    assert se.main(["--table", str(failed), "--seeds", "1"]) == 2
    assert "no config of the table ran" in capsys.readouterr().err
    short = tmp_path / "short.csv"
    grid.iloc[:-3].to_csv(short, index=False)
    assert se.main(["--table", str(short), "--seeds", "1"]) == 2
    assert "are not in the table" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        se.main(["--seeds", "0"])


def test_replay_reaches_the_grid_hypervolume_and_counts_launches():
    table = se.synthetic_table(node_gib=12.0)
    run = se.replay(table, "random", 0, memory_model=False)
    assert run.reached_at is not None and run.reached_at == len(run.launches)
    assert len(set(run.launches)) == len(run.launches)       # the tuner never launches twice
    assert run.launches[0] == (0.12, 32768, 16)              # baselines go first
    assert not run.skipped


def test_memory_model_skips_configs_that_cannot_fit():
    table = se.synthetic_table(node_gib=10.0)   # gmu 0.03, 0.05 and 0.08 leave no KV at all
    run = se.replay(table, "grid", 0, memory_model=True, max_launches=8, stop_at_target=False)
    wasted = [k for k in run.launches if table.rows[k]["failure"]]
    assert run.skipped                           # learned from the first failure(s)
    assert all(table.rows[k]["failure"] for k in run.skipped)   # no false skips here
    assert len(wasted) < len([k for k in table.rows if table.rows[k]["failure"]])


def _levels_table(noise_cv: float = 0.05) -> se.GridTable:
    """The synthetic grid with same-load level columns (levels 4 and 16: n slots serve n clients,
    the rest queue) and a recorded noise, as grid-levels-cpu.csv has them."""
    table = se.synthetic_table(node_gib=12.0)
    rows = {}
    for key, row in table.rows.items():
        row = dict(row)
        if not row["failure"]:
            mns, stream = row["max_num_seqs"], 40.0
            for c in (4, 16):
                run = min(c, mns)
                row[f"c{c}_throughput_tok_s"] = 0.9 * stream * run
                row[f"c{c}_ttft_ms"] = 20.0 + max(0.0, c / run - 1) * 1000.0 * 32 / stream
            row.update(single_stream_tok_s=stream, throughput_tok_s=row["c16_throughput_tok_s"],
                       ttft_ms=row["c16_ttft_ms"])
        rows[key] = row
    noise = {k: {"cv": noise_cv, "dof": 4, "configs": 2} for k in se.OBJECTIVES}
    return se.GridTable(rows, noise)


def test_a_table_with_levels_and_noise_replays_noisy_launches_and_the_screen_skips():
    table = _levels_table()
    spec = LaunchSpec(model="m", params=ServerParams(gpu_memory_utilization=0.12, max_model_len=8192,
                                                     max_num_seqs=4), log_path="x.log")
    answer = table.outcome(spec)
    assert [lv.name for lv in answer.metrics.levels] == ["c4", "c16"]
    assert answer.metrics.levels[0].throughput_tok_s == pytest.approx(0.9 * 40 * 4)
    # replayed, each launch reads the mean times the recorded noise; replicates are launched
    off = se.replay(table, "random", 0, memory_model=True, study_path=se.STUDY_LEVELS,
                    stop_at_target=False, max_launches=12)
    on = se.replay(table, "random", 0, memory_model=True, study_path=se.STUDY_LEVELS,
                   stop_at_target=False, max_launches=12, screen=True)
    assert off.launches.count(off.launches[0]) == 3          # the first baseline and its 2 replicates
    assert "predicted_dominated" not in off.kinds
    assert "predicted_dominated" in on.kinds
    assert on.dominated and all(k[2] < 16 for k in on.dominated)   # only configs with fewer slots
    assert not set(on.dominated) & set(on.launches)                # and those were not launched


def test_wasted_launches_counts_a_capacity_short_of_the_requirement(capsys):
    # the KV-bound CPU table: 4 requests of 4,096 tokens need 16,384 KV tokens; gmu 0.0305 and
    # 0.031 hold 6,144 and 9,216 (they start), and fail at 16,384 tokens of context
    import wasted_launches as wl

    rows = {"max_model_len": 4096, "failure": "", "kv_cache_tokens": 9216.0}
    assert wl.short_of(rows, (4096, 4)) and wl.wasted(rows, (4096, 4))
    assert not wl.short_of({**rows, "kv_cache_tokens": 21376.0}, (4096, 4))
    assert not wl.short_of(rows, None) and not wl.wasted(rows, None)
    assert wl.wasted({**rows, "failure": "kv_cache_too_small", "kv_cache_tokens": None}, (4096, 4))
    root = Path(__file__).resolve().parent.parent
    assert wl.main(["--table", str(root / "bench/data/grid-kv-cpu.csv"), "--study", str(root / "bench/grid-kv.toml"),
                    "--requirement", "4096", "4", "--samplers", "random", "--seeds", "1",
                    "--launches", "3"]) == 0
    out = capsys.readouterr().out
    assert "of the 24 configs whose context serves it, 6 fail for memory and 6 start but hold fewer" in out
    assert "launches failed for memory or held too few" in out


def test_launch_times_splits_the_h200_launch_study_by_spare_and_compile_cache(capsys):
    import launch_times

    repo = Path(__file__).resolve().parent.parent
    rows = launch_times.launches(repo / "results" / "h200-launch")
    # trials 0 and 14 began their runs (no spare); 7, 15 and 16 reused an earlier launch's compile
    assert [r["trial"] for r in rows if not r["spare"]] == [0, 14]
    assert [r["trial"] for r in rows if r["cache"] == "hit"] == [7, 15, 16]
    assert launch_times.main([str(repo / "results" / "h200-launch")]) == 0
    out = capsys.readouterr().out
    assert "after the first (a spare served them): 45.0 s (18.6-51.6), n=9" in out
    assert "compile cache hit: 22.0 s (18.6-34.1), n=3" in out
    assert launch_times.main(["/nonexistent"]) == 2
