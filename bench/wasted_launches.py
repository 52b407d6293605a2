"""Bench: the share of launches that fail for memory, with the memory model and without it.

Replays the real `Tuner` against the recorded grid (bench/data/grid-tiny-cpu.csv, see
bench/search_efficiency.py) for a fixed number of launches, once with the memory model and once
without, over a few seeds of each sampler. A launch is wasted when the table says the config failed
for memory (kv_cache_too_small, no_cache_blocks, insufficient_free_memory, oom). With the model on
it also counts the configs recorded as predicted_infeasible without launching, and the false skips
among them: skipped configs that the table says started.

    .venv/bin/python bench/wasted_launches.py                  # GP and TPE, 12 launches per run
    .venv/bin/python bench/wasted_launches.py --samplers tpe random --seeds 10 --launches 15
    .venv/bin/python bench/wasted_launches.py --gmu 0.03 0.05 --launches 8   # a memory-bound space
    .venv/bin/python bench/wasted_launches.py --table bench/data/grid-kv-cpu.csv \
        --study bench/grid-kv.toml --requirement 4096 4      # a context the user needs, 4 at once

--gmu narrows the searched gpu-memory-utilization to those grid levels (a study file written next
to the replay's storage), so most of the space fails for memory: 0.03 and 0.05 hold 12 failures in
18 configs. Shares are printed over all launches and over the launches after the first (the first
is launched before anything is calibrated, so no model can save it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tempfile  # noqa: E402

from search_efficiency import (SAMPLERS, STUDY, TABLE, GridTable, TableError,  # noqa: E402
                               check_covers, checked_table, describe_table, refusing, replay)
from tuner.cli import positive_int  # noqa: E402
from tuner.records import Requirement  # noqa: E402
from tuner.run.process import MEMORY_FAILURES  # noqa: E402
from tuner.search.requirement import capacity_shortfall  # noqa: E402

TARGET_SHARE = 0.10


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", help=f"grid CSV (default {TABLE.name}; 'synthetic' for a made-up one)")
    ap.add_argument("--samplers", nargs="+", default=["gp", "tpe"], choices=SAMPLERS)
    ap.add_argument("--seeds", type=positive_int, default=5)
    ap.add_argument("--launches", type=positive_int, default=12, help="launches per run")
    ap.add_argument("--study", type=Path, default=STUDY,
                    help=f"the study file the table was recorded with (default {STUDY.name})")
    ap.add_argument("--gmu", nargs="+", type=float,
                    help="search only these gpu-memory-utilization levels of the grid "
                         "(with the default study)")
    ap.add_argument("--requirement", nargs=2, type=positive_int, metavar=("CONTEXT", "SEQUENCES"),
                    help="add [requirement] context_tokens / sequences_at_context to the study: a "
                         "launch whose recorded KV cache holds fewer such requests is wasted too")
    return refusing("wasted_launches", run, ap.parse_args(argv))


def short_of(row: dict, requirement) -> bool:
    """The recorded launch started but its KV cache holds fewer than the required requests (the
    tuner's own test: requirement.capacity_shortfall)."""
    if not requirement or row["failure"]:
        return False
    tokens = row.get("kv_cache_tokens")
    return (tokens is not None and tokens == tokens
            and capacity_shortfall(int(tokens), Requirement(*requirement)) > 0)


def wasted(row: dict, requirement) -> bool:
    return row["failure"] in MEMORY_FAILURES or short_of(row, requirement)


def written_study(text: str) -> Path:
    """The replay's own copy of a study file, changed by an option (beside the replay's storage)."""
    study = Path(tempfile.mkdtemp(prefix="wasted-")) / "grid.toml"
    study.write_text(text)
    return study


def run(args) -> int:
    if not Path(args.study).is_file():
        raise TableError(f"no study file at {args.study}")
    table = checked_table(args.table, need_feasible=False)   # a grid where all fail is a case here
    study = args.study
    if args.gmu:
        levels = sorted(args.gmu)
        known = sorted({k[0] for k in table.rows})
        if not set(levels) <= set(known):
            raise TableError(f"--gmu {' '.join(map(str, levels))}: the table's levels are "
                             f"{', '.join(map(str, known))}")
        line = "gpu_memory_utilization = { choices = [0.03, 0.05, 0.08, 0.12] }"
        if line not in Path(args.study).read_text():
            raise TableError(f"--gmu rewrites {STUDY.name}'s gmu choices; {args.study} has others")
        table = GridTable({k: r for k, r in table.rows.items() if k[0] in levels})
        text = Path(args.study).read_text().replace(
            line, f"gpu_memory_utilization = {{ choices = {levels} }}")
        study = written_study(text)
    if args.requirement:
        context, sequences = args.requirement
        text = Path(study).read_text() + (f"\n[requirement]\ncontext_tokens = {context}\n"
                                          f"sequences_at_context = {sequences}\n")
        study = written_study(text)
        served = [r for r in table.rows.values() if r["max_model_len"] >= context]
        short = sum(1 for r in served if short_of(r, args.requirement))
        failed = sum(1 for r in served if r["failure"] in MEMORY_FAILURES)
        print(f"requirement: {sequences} requests of {context} tokens at once; of the {len(served)} "
              f"configs whose context serves it, {failed} fail for memory and {short} start but hold fewer")
    if args.table != "synthetic":
        check_covers(table, study, said_as=args.study)
    print(f"table: {describe_table(table)}")
    memory_rows = sum(1 for r in table.rows.values() if r["failure"] in MEMORY_FAILURES)
    print(f"the whole grid: {memory_rows}/{len(table.rows)} configs fail for memory "
          f"({memory_rows / len(table.rows):.0%}); {args.launches} launches per run, "
          f"{args.seeds} seeds per sampler")
    for name in args.samplers:
        for memory_model in (False, True):
            launched = lost = skipped = false_skips = later = later_wasted = 0
            shares = []
            for seed in range(args.seeds):
                run = replay(table, name, seed, memory_model, max_launches=args.launches,
                             stop_at_target=False, study_path=study)
                flags = [wasted(table.rows[k], args.requirement) for k in run.launches]
                w = sum(flags)
                launched += len(run.launches)
                lost += w
                later += max(len(run.launches) - 1, 0)
                later_wasted += sum(flags[1:])
                shares.append(w / max(len(run.launches), 1))
                skipped += len(run.skipped)
                false_skips += sum(1 for k in run.skipped
                                   if not table.rows[k]["failure"] and not short_of(table.rows[k], args.requirement))
            share = lost / max(launched, 1)
            line = (f"{name:>6} model {'on ' if memory_model else 'off'}: {lost}/{launched} launches "
                    f"failed for memory{' or held too few' if args.requirement else ''} ({share:.1%}; per seed median {statistics.median(shares):.0%}, "
                    f"max {max(shares):.0%}); after the first: {later_wasted}/{later} "
                    f"({later_wasted / max(later, 1):.1%})")
            if memory_model:
                verdict = "yes" if later_wasted / max(later, 1) <= TARGET_SHARE else "NO"
                line += (f"; {skipped} skipped as predicted_infeasible, {false_skips} false skips; "
                         f"<= {TARGET_SHARE:.0%} after the first: {verdict}")
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
