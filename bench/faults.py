"""Fault scenarios, end to end, with a table of figures: orphaned processes (want 0), completed
trials lost (want 0), and whether the study reached the requested count.

    .venv/bin/python bench/faults.py            # fake engines (real processes): ~2 min
    .venv/bin/python bench/faults.py --real     # plus the real vLLM CPU build: ~6 more min

Server faults run a 2-trial study each and must end as classified trials with no process left;
tuner faults kill a real `python -m tuner run` with SIGINT/SIGTERM/SIGKILL during a launch and
during a load test, then run the same command again until it reaches the count.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import faultkit as fk  # noqa: E402

KILLS = [(sig, phase) for phase in ("launch", "load") for sig in ("SIGINT", "SIGTERM", "SIGKILL")]


def server_faults(work: Path, model: Path) -> list[dict]:
    from optuna.trial import TrialState

    from tuner.config import parse_study
    from tuner.errors import TunerError
    from tuner.search.study import SKIPPED_KINDS, Tuner

    cases = [(f"dies at start: {kind}", fk.fake_engine_study(
                 model, engine=(sys.executable, str(fk.FAKE_VLLM)),
                 env={"FAKE_MODE": "fail", "FAKE_LOG": str(fk.LOGS / log)}))
             for log, kind in [("cpu_kv_cache_too_small.log", "kv_cache_too_small"),
                               ("cpu_gmu_too_small_for_weights.log", "no_cache_blocks"),
                               ("gpu_insufficient_free_memory.log", "insufficient_free_memory"),
                               ("gpu_oom.log", "oom"),
                               ("cpu_port_in_use.log", "port_in_use"),
                               ("crashed_unknown.log", "crashed")]]
    cases += [(f"misbehaves: {mode}", fk.fake_engine_study(model, mode))
              for mode in ("http500", "drop", "garbage", "truncated")]
    cases += [("never answers /health", fk.fake_engine_study(model, "hang_health", launch_timeout_s=2.0)),
              ("port taken once", fk.fake_engine_study(model, "port_taken_once",
                                                       env={"FAKE_STATE": str(work / "once")})),
              ("port always taken", fk.fake_engine_study(model, "port_taken"))]
    rows = []
    for i, (name, doc) in enumerate(cases):
        folder = work / f"server-{i}"
        folder.mkdir()
        cfg = parse_study(doc, name, {"storage": f"sqlite:///{folder}/s.db",
                                      "results_dir": str(folder / "results")})
        tuner = Tuner(cfg, progress=False)
        stopped = ""
        try:
            study = tuner.run(2)
        except TunerError as e:
            # a server that fails every request stops the study (the workload or the client is
            # wrong, not the config): an outcome of the scenario, with its trial kept
            study = tuner.open()
            stopped = " (study stopped: every request failed)" if "requests failed" in str(e) \
                else f" (study stopped: {str(e)[:60]})"
        pgids = {t.user_attrs.get("server_pgid") for t in study.trials}
        # launched trials (skips the search made without a launch are not the scenario's outcome)
        done = [t for t in study.trials if t.state == TrialState.COMPLETE
                and t.user_attrs.get("failure") not in (*SKIPPED_KINDS, "budget_spent")]
        kinds = sorted({t.user_attrs.get("failure") or "measured" for t in done})
        rows.append({"scenario": name, "outcome": ",".join(kinds) + stopped, "exit": "",
                     "orphans": len(fk.leftovers(pgids, [str(model)])), "lost": 0,
                     "reached": f"{len(done)}/2"})
    return rows


def tuner_faults(work: Path, model: Path, doc: dict, name: str, n: int, real: bool) -> list[dict]:
    study_file = fk.write_study(work, doc)
    run = fk.TunerRun(study_file, f"sqlite:///{work}/s.db", work / "results", name, n, str(model),
                      timeout_s=420 if real else 120)
    killed = {}

    def kill_server(trial, run):
        killed["trial"] = trial.number
        os.killpg(int(trial.user_attrs["server_pgid"]), signal.SIGKILL)

    figures, final = fk.kill_chain(run, KILLS, work, on_final_load=kill_server if real else None)
    tag = "vLLM" if real else "fake"
    rows = [{"scenario": f"[{tag}] tuner {f.scenario}", "exit": f.exit_code,
             "outcome": (f"left {f.left_behind}, stopped by next run" if f.reaped_by_next_run
                         else f"left {f.left_behind}, NOT stopped" if f.reaped_by_next_run is False
                         else f.note[:40] or "stopped"),
             "orphans": f.orphans, "lost": f.lost_completed, "reached": ""} for f in figures]
    outcome = "resumed"
    if killed:
        t = next(t for t in fk.trials(run.storage, name) if t.number == killed["trial"])
        outcome = f"server SIGKILLed mid-load: {t.user_attrs.get('failure')}"
    rows.append({"scenario": f"[{tag}] same command again", "exit": final["exit_code"],
                 "outcome": outcome, "orphans": final["orphans"], "lost": final["lost_completed"],
                 "reached": f"{final['launched']}/{final['requested']}"})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real", action="store_true", help="also run the kill chain on real vLLM")
    args = parser.parse_args()
    started = time.monotonic()
    rows = []
    with tempfile.TemporaryDirectory(prefix="tuner-faults-") as tmp:
        work = Path(tmp)
        model = fk.private_model(work)
        rows += server_faults(work, model)
        (work / "fake-chain").mkdir()
        doc = fk.fake_engine_study(model, env={"FAKE_START_DELAY": "2", "FAKE_STREAM_DELAY": "0.05"},
                                   output_tokens=8)
        rows += tuner_faults(work / "fake-chain", model, doc, "faults", 3, real=False)
        if args.real:
            (work / "real-chain").mkdir()
            rows += tuner_faults(work / "real-chain", model, fk.real_vllm_study(model),
                                 "faults-vllm", 2, real=True)
    cols = ("scenario", "outcome", "exit", "orphans", "lost", "reached")
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
    print("  ".join(c.ljust(widths[c]) for c in cols))
    for r in rows:
        print("  ".join(str(r[c]).ljust(widths[c]) for c in cols))
    orphans = sum(max(r["orphans"], 0) for r in rows)
    lost = sum(max(r["lost"], 0) for r in rows)
    print(f"\n{len(rows)} scenarios in {time.monotonic() - started:.0f} s: orphaned processes {orphans}, "
          f"lost completed trials {lost}")
    return 0 if orphans == 0 and lost == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
