"""Where each launch of a study went, and the median launch once a run is under way (issue 16.1).

    .venv/bin/python bench/launch_times.py results/h200-launch [results/other-study ...]

Reads a study's `trials.csv` (launch_s and the phases the tuner parsed from vLLM's log) and each
trial's `server.log`, and prints one line per launch in launch order:
- whether a warm spare served it (`launch_preimport_s` set: the tuner process had launched before,
  so its imports were done ahead; a launch without one is the first of its `tuner run`);
- whether vLLM loaded its torch.compile artifacts from the cache ("Directly load the compiled
  graph(s)") or compiled ("Compiling a graph for compile range"). vLLM 0.24 keys that cache on
  its config hash, which holds max_model_len (ModelConfig.compute_hash), max_num_batched_tokens
  (SchedulerConfig) and the compilation config (CUDA-graph capture sizes, from max_num_seqs), and
  leaves gpu_memory_utilization out (CacheConfig);
- launch_s and its phases, and the trial's failure if any (a launch that became ready and then
  missed a requirement or the budget counts as a launch; one that failed to start does not).

Then the medians: every launch, the launches after the first of each run (a spare served them),
and those split by compile-cache hit or miss.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from pathlib import Path

from tuner.results.report import LAUNCH_PHASE_COLUMNS

# the tuner's own phase columns (launch_compile_s ...), named as `show` names them (compile ...)
PHASES = tuple(c[len("launch_"):-len("_s")] for c in LAUNCH_PHASE_COLUMNS)
HIT = "Directly load the compiled graph"
MISS = "Compiling a graph for compile range"


def compile_cache(log_text: str) -> str:
    """'hit', 'miss' or '-' (a log without torch.compile lines: eager, the CPU build, a failure)."""
    if MISS in log_text:
        return "miss"
    return "hit" if HIT in log_text else "-"


def _float(text: str | None) -> float | None:
    try:
        return float(text) if text not in (None, "") else None
    except ValueError:
        return None


def launches(results: Path) -> list[dict]:
    """One dict per launched trial of a results folder, in trial order (the order they launched)."""
    rows = []
    with open(results / "trials.csv", newline="") as f:
        for row in csv.DictReader(f):
            launch_s = _float(row.get("launch_s"))
            if launch_s is None:
                continue               # not launched: screened, inferred, a duplicate
            log = results / "trials" / row["trial"] / "server.log"
            text = log.read_text(errors="replace") if log.exists() else ""
            rows.append({
                "study": results.name, "trial": int(row["trial"]), "launch_s": launch_s,
                "config": f'{row["gpu_memory_utilization"]}/{row["max_model_len"]}/{row["max_num_seqs"]}',
                "failure": row.get("failure") or "",
                # ready_s is set once the server answered, whatever the trial's verdict after that
                "ready": _float(row.get("ready_s")) is not None,
                "spare": _float(row.get("launch_preimport_s")) is not None,
                "cache": compile_cache(text),
                **{p: _float(row.get(f"launch_{p}_s")) for p in PHASES}})
    return sorted(rows, key=lambda r: r["trial"])


def _median(values: list[float]) -> str:
    if not values:
        return "-"
    spread = f" ({min(values):.1f}-{max(values):.1f})" if len(values) > 1 else ""
    return f"{statistics.median(values):.1f} s{spread}, n={len(values)}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", type=Path, help="a study's results folder (trials.csv, trials/)")
    args = ap.parse_args(argv)
    rows = []
    for folder in args.results:
        if not (folder / "trials.csv").exists():
            print(f"launch_times: error: {folder}/trials.csv not found", file=sys.stderr)
            return 2
        rows += launches(folder)
    head = ["study", "trial", "config", "spare", "cache", "launch_s", *PHASES, "failure"]
    print(" ".join(f"{h:>12}" for h in head))
    for r in rows:
        cells = [r["study"][:12], r["trial"], r["config"], "yes" if r["spare"] else "no", r["cache"],
                 f'{r["launch_s"]:.1f}', *("-" if r[p] is None else f"{r[p]:.1f}" for p in PHASES),
                 r["failure"] or "-"]
        print(" ".join(f"{c:>12}" for c in cells))
    ok = [r for r in rows if r["ready"]]
    later = [r for r in ok if r["spare"]]
    print()
    print(f"launches that became ready: {_median([r['launch_s'] for r in ok])}")
    print(f"  first of their run (no spare): {_median([r['launch_s'] for r in ok if not r['spare']])}")
    print(f"  after the first (a spare served them): {_median([r['launch_s'] for r in later])}")
    for cache in ("miss", "hit"):
        print(f"    compile cache {cache}: {_median([r['launch_s'] for r in later if r['cache'] == cache])}")
    for p in PHASES:
        values = [r[p] for r in later if r[p] is not None]
        print(f"    {p:>12} after the first: {_median(values)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
