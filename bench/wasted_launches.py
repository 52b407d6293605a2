"""Bench: the share of launches that fail for memory, with the memory model and without it.

Replays the real `Tuner` against the recorded grid (bench/data/grid-tiny-cpu.csv, see
bench/search_efficiency.py) for a fixed number of launches, once with the memory model and once
without, over a few seeds of each sampler. A launch is wasted when the table says the config failed
for memory (kv_cache_too_small, no_cache_blocks, insufficient_free_memory, oom). With the model on
it also counts the configs recorded as predicted_infeasible without launching, and the false skips
among them: skipped configs that the table says started.

    .venv/bin/python bench/wasted_launches.py                  # GP and TPE, 12 launches per run
    .venv/bin/python bench/wasted_launches.py --samplers tpe random --seeds 10 --launches 15
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from search_efficiency import (SAMPLERS, TABLE, describe_table, load_table,  # noqa: E402
                               replay)
from tuner.run.process import MEMORY_FAILURES  # noqa: E402

TARGET_SHARE = 0.10


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", help=f"grid CSV (default {TABLE.name}; 'synthetic' for a made-up one)")
    ap.add_argument("--samplers", nargs="+", default=["gp", "tpe"], choices=SAMPLERS)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--launches", type=int, default=12, help="launches per run")
    args = ap.parse_args(argv)

    table = load_table(args.table)
    print(f"table: {describe_table(table)}")
    memory_rows = sum(1 for r in table.rows.values() if r["failure"] in MEMORY_FAILURES)
    print(f"the whole grid: {memory_rows}/{len(table.rows)} configs fail for memory "
          f"({memory_rows / len(table.rows):.0%}); {args.launches} launches per run, "
          f"{args.seeds} seeds per sampler")
    for name in args.samplers:
        for memory_model in (False, True):
            launched = wasted = skipped = false_skips = 0
            shares = []
            for seed in range(args.seeds):
                run = replay(table, name, seed, memory_model, max_launches=args.launches,
                             stop_at_target=False)
                w = sum(1 for k in run.launches if table.rows[k]["failure"] in MEMORY_FAILURES)
                launched += len(run.launches)
                wasted += w
                shares.append(w / max(len(run.launches), 1))
                skipped += len(run.skipped)
                false_skips += sum(1 for k in run.skipped if not table.rows[k]["failure"])
            share = wasted / max(launched, 1)
            line = (f"{name:>6} model {'on ' if memory_model else 'off'}: {wasted}/{launched} launches "
                    f"failed for memory ({share:.1%}; per seed median {statistics.median(shares):.0%}, "
                    f"max {max(shares):.0%})")
            if memory_model:
                verdict = "yes" if share <= TARGET_SHARE else "NO"
                line += (f"; {skipped} skipped as predicted_infeasible, {false_skips} false skips; "
                         f"<= {TARGET_SHARE:.0%}: {verdict}")
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
