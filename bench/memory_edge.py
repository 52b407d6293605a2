"""Bench: the memory model at the edge, replayed on every recorded launch (H200 studies, CPU grid).

For each recorded study, in trial order, the memory model predicts a launch's KV budget before it
sees the outcome (only the launches before it calibrate it), then learns from the outcome, failed
launches included. Printed per launch: the available KV memory vLLM logged ("Available KV cache
memory", or the figure of its kv_cache_too_small / no_cache_blocks message) against the
prediction, the band within which the model calls itself uncertain, and whether the verdict
(fits / no_cache_blocks / kv_cache_too_small) was right. Then the failure boundaries the
calibrated model puts where the CPU grid's launches found them: the smallest gpu-memory-utilization
with any KV memory (no_cache_blocks below) and the largest max-model-len at gmu 0.05
(kv_cache_too_small above). Launches nothing.

    .venv/bin/python bench/memory_edge.py
    flock /tmp/tuner-heavy.lock .venv/bin/python bench/memory_edge.py --launch   # 6 real CPU launches

--launch records a small memory-bound table for real (vLLM CPU build, embedded tiny model): one
roomy launch calibrates the model, then five configs are placed by the calibrated model on each
side of its no_cache_blocks and kv_cache_too_small edges (the gmu from the node total read just
before each launch, which drifts here), each predicted before it starts and the model told after.
Raw outcomes go to bench/data/memory_edge_cpu.json and are reprinted without launching.
"""

from __future__ import annotations

import math
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import pandas as pd  # noqa: E402

from tuner.search import feasibility  # noqa: E402
from tuner.engines.vllm_logs import parse_capacity  # noqa: E402
from tuner.models.presets import PRESETS, TINY_MODEL, write_model_folder  # noqa: E402
from tuner.records import Capacity, LaunchFailure  # noqa: E402
from tuner.search.space import ServerParams  # noqa: E402

GIB = feasibility.GIB
GRID = REPO / "bench" / "data" / "grid-tiny-cpu.csv"
H200_STUDIES = {"h200-16gb": "llama-3.2-3b", "h200-full": "llama-3.1-8b",
                "h200-levels": "llama-3.2-3b", "h200-steady-8b": "llama-3.1-8b",
                "h200-24gb-mix": "llama-3.1-8b", "h200-16gb-32b-awq": "qwen2.5-32b-awq"}
# failures that still launched a server and logged its KV cache: the figures are a fit
LAUNCHED_KINDS = ("load_test_failed", "over_budget")
MEMORY_KINDS = ("kv_cache_too_small", "no_cache_blocks")


def _v(row, key):
    v = row.get(key)
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else v


def _params(row) -> ServerParams:
    gmu = _v(row, "launch_gpu_memory_utilization") or _v(row, "gpu_memory_utilization")
    return ServerParams(gpu_memory_utilization=gmu, max_model_len=int(row["max_model_len"]),
                        max_num_seqs=int(row["max_num_seqs"]),
                        cpu_offload_gb=_v(row, "cpu_offload_gb"),
                        kv_cache_dtype=_v(row, "kv_cache_dtype"),
                        max_num_batched_tokens=(int(row["max_num_batched_tokens"])
                                                if _v(row, "max_num_batched_tokens") else None))


def _capacity(row, log: Path | None) -> Capacity:
    logged = parse_capacity(log.read_text(errors="replace")) if log and log.exists() else Capacity()
    return Capacity(weights_gib=_v(row, "weights_gib"), kv_cache_gib=_v(row, "kv_cache_gib"),
                    kv_cache_tokens=int(row["kv_cache_tokens"]),
                    num_gpu_blocks=int(row["num_gpu_blocks"]) if _v(row, "num_gpu_blocks") else None,
                    block_size=int(row["block_size"]) if _v(row, "block_size") else None,
                    cuda_graph_gib=logged.cuda_graph_gib,
                    cuda_graph_estimate_gib=logged.cuda_graph_estimate_gib)


def _logged_available(row, model: feasibility.MemoryModel, params: ServerParams) -> float | None:
    """Available KV memory (GiB) as the launch's log implies it, finer than vLLM's 2 decimals."""
    kind = _v(row, "failure") or ""
    r = model.resolve(params)
    bpt = model.shape.kv_bytes_per_token(r.kv_dtype_bytes)
    if not kind or kind in LAUNCHED_KINDS:
        if _v(row, "num_gpu_blocks"):
            return (row["num_gpu_blocks"] + 0.5) * (_v(row, "block_size") or model.block_size) * bpt / GIB
        return _v(row, "kv_cache_gib")
    if kind == "kv_cache_too_small" and _v(row, "estimated_max_model_len"):
        return (row["estimated_max_model_len"] + model.block_size / 2) * bpt / GIB
    if kind == "no_cache_blocks" and _v(row, "needed_gib") is not None and row["needed_gib"] <= 0:
        return row["needed_gib"]          # the CPU build's "requested memory for kv (-0.23/...)"
    return _v(row, "available_gib")


def verdict(p: feasibility.Prediction) -> str:
    if p.fits:
        return "fits"
    return "no_cache_blocks" if p.kv_budget_gib <= 0 else "kv_cache_too_small"


def replay(name: str, rows: list[dict], model: feasibility.MemoryModel, logs: Path | None,
           out: list[dict]) -> None:
    for row in rows:
        kind = _v(row, "failure") or ""
        if kind and kind not in MEMORY_KINDS + LAUNCHED_KINDS:
            continue                      # skipped, interrupted: nothing was launched
        params = _params(row)
        if _v(row, "device_memory_bytes") or _v(row, "node_memory_bytes"):
            model.device_memory_bytes = int(_v(row, "device_memory_bytes") or row["node_memory_bytes"])
        p = model.predict(params)
        logged = _logged_available(row, model, params)
        actual = "fits" if kind in ("",) + LAUNCHED_KINDS else kind
        out.append({"study": name, "trial": int(row["trial"]), "gmu": params.gpu_memory_utilization,
                    "mml": params.max_model_len, "seqs": params.max_num_seqs, "actual": actual,
                    "logged_gib": logged, "predicted_gib": p.kv_budget_gib, "band_gib": p.band_gib,
                    "verdict": verdict(p), "uncertain": p.uncertain,
                    "calibrated": model.calibrated})
        if actual == "fits":
            log = logs / str(int(row["trial"])) / "server.log" if logs else None
            model.observe_ready(params, _capacity(row, log))
        else:
            model.observe_failure(params, LaunchFailure(
                kind=kind, message=str(_v(row, "failure_message") or ""),
                needed_gib=_v(row, "needed_gib"), available_gib=_v(row, "available_gib"),
                estimated_max_model_len=(int(row["estimated_max_model_len"])
                                         if _v(row, "estimated_max_model_len") else None)))


def print_rows(rows: list[dict]) -> None:
    print(f"{'study':18} {'trial':>5} {'gmu':>7} {'mml':>6} {'seqs':>4}  {'outcome':18} "
          f"{'logged GiB':>10} {'pred GiB':>9} {'err GiB':>8} {'band':>6}  verdict")
    for r in rows:
        err = "-" if r["logged_gib"] is None else f"{r['predicted_gib'] - r['logged_gib']:+.3f}"
        logged = "-" if r["logged_gib"] is None else f"{r['logged_gib']:.3f}"
        right = r["verdict"] == r["actual"]
        mark = ("uncal" if not r["calibrated"] else
                ("ok" if right else "MISS") + (" (uncertain)" if r["uncertain"] else ""))
        print(f"{r['study']:18} {r['trial']:>5} {r['gmu']:>7.4g} {r['mml']:>6} {r['seqs']:>4}  "
              f"{r['actual']:18} {logged:>10} {r['predicted_gib']:>9.3f} {err:>8} "
              f"{r['band_gib']:>6.3f}  {r['verdict']} {mark}")


def summarise(rows: list[dict], label: str) -> None:
    cal = [r for r in rows if r["calibrated"] and r["logged_gib"] is not None]
    errs = [abs(r["predicted_gib"] - r["logged_gib"]) for r in cal]
    right = sum(r["verdict"] == r["actual"] for r in rows if r["calibrated"])
    certain_wrong = sum(r["verdict"] != r["actual"] and not r["uncertain"]
                        for r in rows if r["calibrated"])
    inside = sum(abs(r["predicted_gib"] - r["logged_gib"]) <= r["band_gib"] for r in cal)
    if errs:
        print(f"{label}: available-KV error after calibration median {1024 * statistics.median(errs):.1f}"
              f" MiB, max {1024 * max(errs):.1f} MiB (n={len(errs)}); within the band {inside}/{len(cal)};"
              f" verdict right {right}/{sum(r['calibrated'] for r in rows)}, certain and wrong "
              f"{certain_wrong}")


def boundaries(model: feasibility.MemoryModel, table: pd.DataFrame) -> None:
    """The calibrated CPU model's edges against the grid's."""
    total = int(table["node_memory_bytes"].median())
    model.device_memory_bytes = total
    print(f"\nCPU grid edges (node total {total / GIB:.2f} GiB), the model calibrated on all 36 launches:")
    for seqs in (1, 4, 16):
        lo = next(g / 1000 for g in range(1, 200)
                  if model.predict(ServerParams(gpu_memory_utilization=g / 1000, max_model_len=2048,
                                                max_num_seqs=seqs)).kv_budget_gib > 0)
        fails = table[(table.failure == "no_cache_blocks") & (table.max_num_seqs == seqs)]
        logged = (fails.gpu_memory_utilization * total / GIB - fails.needed_gib).median() * GIB / total
        print(f"  max-num-seqs {seqs:>2}: no_cache_blocks below gmu {lo:.3f} predicted, "
              f"{logged:.4f} from the logged (-needed) figures (launched: 0.03 fails, 0.05 starts)")
    for seqs in (1, 4, 16):
        p = model.predict(ServerParams(gpu_memory_utilization=0.05, max_model_len=32768, max_num_seqs=seqs))
        logged = table[(table.gpu_memory_utilization == 0.05) & (table.max_model_len == 32768)
                       & (table.max_num_seqs == seqs)].estimated_max_model_len.iloc[0]
        print(f"  gmu 0.05, max-num-seqs {seqs:>2}: largest max-model-len predicted "
              f"{p.max_model_len_fit}, vLLM estimated {int(logged)} ({p.max_model_len_fit - logged:+.0f})")


EDGE_DATA = REPO / "bench" / "data" / "memory_edge_cpu.json"
# (what to place, offset): gmu relative to the no_cache_blocks edge (GiB of KV budget), or
# max-model-len relative to the largest that fits at a fixed budget (blocks of 128 tokens)
EDGE_PLAN = [("calibrate", 0.0), ("budget", -0.06), ("budget", +0.06), ("mml", +8), ("mml", -8),
             ("budget", +0.02)]


def launch_edges() -> None:
    import json
    from dataclasses import asdict

    from prediction_accuracy import launch
    model = feasibility.MemoryModel(feasibility.model_shape(str(TINY_MODEL)), 0, "cpu")
    tmp = Path(tempfile.mkdtemp(prefix="memory-edge-launch-"))
    bpt = model.shape.kv_bytes_per_token()
    runs = []
    for i, (what, offset) in enumerate(EDGE_PLAN):
        total = feasibility.device_memory_bytes("cpu")
        model.device_memory_bytes = total
        if what == "calibrate":
            params = ServerParams(gpu_memory_utilization=0.10, max_model_len=2048, max_num_seqs=4)
        else:
            probe = ServerParams(gpu_memory_utilization=0.1, max_model_len=2048, max_num_seqs=4)
            overhead = model.overhead_bytes(model.resolve(probe))
            if what == "budget":      # KV budget of offset GiB: below 0 -> no_cache_blocks
                gmu = (overhead + offset * GIB) / total
                params = ServerParams(gpu_memory_utilization=round(gmu, 4), max_model_len=2048,
                                      max_num_seqs=4)
            else:                     # 0.08 GiB of KV (~20k tokens, under the model's 32768): a
                                      # max-model-len offset blocks past the largest that fits
                gmu = round((overhead + 0.08 * GIB) / total, 4)
                fit = model.predict(ServerParams(gpu_memory_utilization=gmu, max_model_len=2048,
                                                 max_num_seqs=4)).max_model_len_fit
                params = ServerParams(gpu_memory_utilization=gmu, max_model_len=fit + int(offset) * 128,
                                      max_num_seqs=4)
        p = model.predict(params)
        row = launch(str(TINY_MODEL), params, tmp / f"{i}.log")
        row["predicted"] = {"kv_budget_gib": p.kv_budget_gib, "band_gib": p.band_gib,
                            "verdict": verdict(p), "uncertain": p.uncertain,
                            "max_model_len_fit": p.max_model_len_fit}
        runs.append(row)
        if "ready" in row:
            model.observe_ready(params, Capacity(**row["ready"]), device_memory_bytes=total)
        else:
            model.observe_failure(params, LaunchFailure(**row["failure"]), device_memory_bytes=total)
        print(f"launched {params.vllm_flags()}: predicted {verdict(p)} "
              f"({p.kv_budget_gib:+.3f} GiB, band {p.band_gib:.3f}), got "
              f"{'ready' if 'ready' in row else row['failure']['kind']}", file=sys.stderr)
        EDGE_DATA.write_text(json.dumps(runs, indent=1) + "\n")
    del asdict


def print_edges() -> None:
    import json

    if not EDGE_DATA.exists():
        return
    print(f"\nReal CPU launches placed at the edges ({EDGE_DATA.name}): prediction made before each")
    print(f"{'gmu':>7} {'mml':>6}  {'predicted':18} {'pred GiB':>8} {'band':>6}  {'outcome':18} "
          f"{'logged GiB':>10}")
    model = feasibility.MemoryModel(feasibility.model_shape(str(TINY_MODEL)), 0, "cpu")
    right = 0
    runs = json.loads(EDGE_DATA.read_text())
    for row in runs:
        params = ServerParams(**row["params"])
        model.device_memory_bytes = row["device_memory_bytes"]
        kind = "fits" if "ready" in row else row["failure"]["kind"]
        flat = {**row.get("ready", {}), **row.get("failure", {}), "failure": "" if kind == "fits" else kind}
        logged = _logged_available(flat, model, params)
        pred = row["predicted"]
        right += pred["verdict"] == kind
        print(f"{params.gpu_memory_utilization:>7.4g} {params.max_model_len:>6}  "
              f"{pred['verdict'] + (' (unc.)' if pred['uncertain'] else ''):18} "
              f"{pred['kv_budget_gib']:>+8.3f} {pred['band_gib']:>6.3f}  {kind:18} "
              f"{'-' if logged is None else f'{logged:+.3f}':>10}")
    print(f"verdict right {right}/{len(runs)}")


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--launch", action="store_true",
                    help="also launch the real CPU build at the predicted edges")
    if ap.parse_args().launch:
        launch_edges()
    tmp = Path(tempfile.mkdtemp(prefix="memory-edge-"))
    rows: list[dict] = []
    for study, preset in H200_STUDIES.items():
        csv = REPO / "results" / study / "trials.csv"
        if not csv.exists():
            continue
        shape = feasibility.model_shape(str(write_model_folder(PRESETS[preset], tmp / preset)))
        df = pd.read_csv(csv).sort_values("trial")
        model = feasibility.MemoryModel(shape, int(df["device_memory_bytes"].dropna().iloc[0]), "cuda",
                                        device_name=str(df["gpu_name"].dropna().iloc[0]))
        replay(study, df.to_dict("records"), model, REPO / "results" / study / "trials", rows)
    table = pd.read_csv(GRID)
    table = table[table.state == "COMPLETE"]
    cpu = feasibility.MemoryModel(feasibility.model_shape(str(TINY_MODEL)), 0, "cpu")
    order = table.sort_values(["study", "trial"]).to_dict("records")
    for r in order:
        r["study_name"] = r["study"]
    replay("grid-tiny-cpu", order, cpu, None, rows)
    for r, src in zip([r for r in rows if r["study"] == "grid-tiny-cpu"],
                      [o for o in order if (_v(o, "failure") or "") in MEMORY_KINDS + ("",) + LAUNCHED_KINDS]):
        r["study"] = src["study_name"]
    print_rows(rows)
    print()
    summarise([r for r in rows if r["study"].startswith("h200")], "GPU studies (H200 and H100, vLLM 0.24)")
    summarise([r for r in rows if r["study"].startswith("grid")], "CPU grid (vLLM 0.32)")
    boundaries(cpu, table)
    print_edges()
    return 0


if __name__ == "__main__":
    sys.exit(main())
