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
    with pytest.raises(KeyError):
        table.outcome(spec(0.3, 8192, 4))


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
