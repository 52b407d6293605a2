"""Does the exported command deliver what the study claimed? `vllm bench serve` against it (issue 12, 7c).

Against a server started from the study's exported command (plain `vllm serve`, see
bench/h200_verify.sh), runs vLLM's own benchmark client at each closed-loop level of the study's
workload (random prompts of the workload's length, fixed output length, --ignore-eos, the same
request count as the study's level) and prints, per level, vLLM's output throughput and median
TTFT beside the study's figures for the exported config (mean over its launches), with the ratios.
Target: throughput within 3 %, TTFT within 10 %.

  python3 bench/verify_export.py --study studies/h200-levels.toml --base-url URL --model PATH
  python3 bench/verify_export.py --study studies/h200-steady-8b.toml --summarize results/h200-steady-8b/verify-*.txt

--summarize reads the tables that earlier runs printed (any number of verify launches, any number
of runs each) and sets every vllm bench run beside the study's launches, per level: the claim is
the mean over the study's launches, the check is the mean over vLLM's runs, and each side's
min-max shows its own spread.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tuner.results import export, report  # noqa: E402
from tuner.config import load_study  # noqa: E402
from tuner.errors import TunerError  # noqa: E402
from tuner.load.client import load_plan  # noqa: E402
from tuner.search.storage import load_existing  # noqa: E402
from tuner.search.trial import extra_runs  # noqa: E402

# vLLM's client, every run in one process (its imports take ~15 s a process on the GPU machine):
# argv[1] is a JSON list of {"name", "argv"}; the server's /metrics text is saved before and after
# each run, so the server's own TTFT histogram referees what each run offered
VLLM_BENCH = """
import json, sys, urllib.request
try:
    from vllm.utils.argparse_utils import FlexibleArgumentParser
except ImportError:
    from vllm.utils import FlexibleArgumentParser
from vllm.benchmarks.serve import add_cli_args, main
runs, base_url, out = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
def scrape(path):
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as r, open(path, "wb") as f:
        f.write(r.read())
for run in runs:
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    scrape(f"{out}/{run['name']}.before.prom")
    main(parser.parse_args(run["argv"]))
    scrape(f"{out}/{run['name']}.after.prom")
    print("done", run["name"], flush=True)
"""


def study_levels(study, number: int) -> dict[str, list[dict]]:
    """Every launch's figures of each level for trial `number` (the trial and its extra runs)."""
    t = study.trials[number]
    launches = [t.user_attrs.get("levels", [])] + [r.get("levels", []) for r in
                                                     extra_runs(study, number)
                                                     if not r.get("failure")]
    out: dict[str, list[dict]] = {}
    for levels in launches:
        for lv in levels:
            out.setdefault(lv["name"], []).append(lv)
    return out


def mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def bench_argv(base_url: str, model: str, w, concurrency: int, requests: int, out: Path,
               name: str, seed: int) -> list[str]:
    # vLLM's random dataset draws the same prompts for the same seed: one seed per run, or every
    # level would reuse the warm-up's and the levels' before it (prefix cache hits up to 87.5 %)
    return ["--backend", "vllm", "--base-url", base_url,
            "--model", model, "--dataset-name", "random", "--random-input-len", str(w.prompt_tokens),
            "--random-output-len", str(w.output_tokens), "--num-prompts", str(requests),
            "--max-concurrency", str(concurrency), "--ignore-eos", "--temperature", "0",
            "--seed", str(seed), "--disable-tqdm", "--save-result", "--result-dir", str(out),
            "--result-filename", name + ".json"]


def run_vllm_bench(base_url: str, runs: list[dict], out: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", VLLM_BENCH, json.dumps(runs), base_url, str(out)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"vllm bench serve failed (rc {proc.returncode}): {proc.stderr[-2000:]}")


def server_ttft_ms(out: Path, name: str) -> float | None:
    """The server's own mean TTFT (its histogram's delta) over run `name`."""
    from fidelity import server_figures
    from tuner.load.client import parse_prometheus

    before, after = (dict(parse_prometheus((out / f"{name}.{when}.prom").read_text(), "vllm"))
                     for when in ("before", "after"))
    return server_figures(before, after)["server_ttft_ms_mean"]


def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def bench_runs(paths: list[Path]) -> dict[str, list[tuple[float, float]]]:
    """(vllm bench tok/s, vllm bench TTFT p50 ms) per level over every run of every file."""
    got: dict[str, list[tuple[float, float]]] = {}
    for path in paths:
        for line in path.read_text().splitlines():
            cells = [c.strip() for c in line.split("|")]
            if len(cells) >= 7 and cells[1].isdigit():
                got.setdefault(cells[0], []).append((float(cells[3]), float(cells[6])))
    return got


def span(values) -> str:
    return f"{mean(values):.1f} ({min(values):.1f}-{max(values):.1f}, n={len(values)})"


def summarize(study, number: int, paths: list[Path]) -> None:
    claimed, got = study_levels(study, number), bench_runs(paths)
    print(f"trial {number}: the study's launches against every vllm bench run in {len(paths)} file(s); "
          "mean (min-max, n); ratio = study mean / vllm bench mean; targets: 3 % and 10 %")
    print("level | study tok/s (wall) | vllm bench tok/s | ratio | study TTFT p50 ms (all requests) | "
          "vllm bench TTFT p50 ms | ratio")
    for name, runs in got.items():
        ours = claimed.get(name, [])
        if not ours:
            continue
        wall = [x["throughput_tok_s_wall"] for x in ours]
        ttft = [x.get("ttft_ms_all", x["ttft_ms"]) for x in ours]
        thr, their_ttft = [r[0] for r in runs], [r[1] for r in runs]
        print(f"{name} | {span(wall)} | {span(thr)} | {mean(wall) / mean(thr):.3f} | {span(ttft)} | "
              f"{span(their_ttft)} | {mean(ttft) / mean(their_ttft):.3f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--study", required=True)
    ap.add_argument("--summarize", nargs="+", type=Path, metavar="VERIFY_TXT",
                    help="no server: set the vllm bench runs printed in these files beside the study")
    ap.add_argument("--storage", help="the study's storage URL, when not the study file's")
    ap.add_argument("--base-url")
    ap.add_argument("--model")
    ap.add_argument("--seed", type=int, default=1000, help="first of the seeds used, one per level")
    ap.add_argument("--scale", type=int, default=1,
                    help="send SCALE times each level's request count (longer phases)")
    args = ap.parse_args()
    try:
        cfg = load_study(args.study, {"storage": args.storage} if args.storage else {})
        study = load_existing(cfg)
    except TunerError as e:
        ap.error(str(e))
    df = report.trials_frame(study, cfg.tie_tolerance)
    row = export.choose(df[df["pareto"]], "balanced", df.attrs.get("noise"), cfg.tie_tolerance)
    number = int(row["trial"])
    if args.summarize:
        summarize(study, number, args.summarize)
        return 0
    if not (args.base_url and args.model):
        ap.error("--base-url and --model are needed unless --summarize is given")
    claimed = study_levels(study, number)
    print(f"exported config: trial {number}, {int(row['runs'])} launch(es); "
          + report.describe_noise(df.attrs.get("noise")))
    if cfg.workload.closed_loop_start != "together":
        print("note: the study staggered its closed-loop slots; vLLM's client starts them together "
              "(bursts), so its TTFT is not the same measurement; throughput still compares")
    print("level | requests | study tok/s (steady / wall) | vllm bench tok/s | ratio (wall) | "
          "study TTFT p50 ms, all requests (steady state) | vllm bench TTFT p50 ms | ratio | "
          "TTFT mean ms: study / vllm bench | server's own TTFT mean ms: study / vllm bench")
    levels = [lv for lv in load_plan(cfg.workload) if lv.request_rate is None]
    sent = {}
    # one discarded run first, as the study's warm-up
    runs = [{"name": "warmup", "argv": bench_argv(args.base_url, args.model, cfg.workload, 8, 16,
                                                  Path(), "warmup", args.seed)}]
    for k, lv in enumerate(levels, start=1):
        # a level with a time floor sent as many requests as fit in it: vLLM's client sends
        # the mean count of the study's launches (its count is fixed up front)
        n = mean([x.get("requests") for x in claimed.get(lv.name, [])]) or lv.requests
        sent[lv.name] = int(round(n)) * args.scale
        runs.append({"name": lv.name, "argv": bench_argv(args.base_url, args.model, cfg.workload,
                                                         lv.concurrency, sent[lv.name], Path(),
                                                         lv.name, args.seed + k)})
    with tempfile.TemporaryDirectory() as tmp:
        for run in runs:
            run["argv"][run["argv"].index("--result-dir") + 1] = tmp
        run_vllm_bench(args.base_url, runs, Path(tmp))
        for lv in levels:
            ours = claimed.get(lv.name, [])
            got = json.loads((Path(tmp) / f"{lv.name}.json").read_text())
            steady = mean([x.get("throughput_tok_s") for x in ours])
            wall = mean([x.get("throughput_tok_s_wall") for x in ours])
            # vLLM's median TTFT is over every request: the study's same-definition figure is
            # ttft_ms_all (its objective, ttft_ms, leaves out the first wave), older studies lack it
            ttft = mean([x.get("ttft_ms_all", x.get("ttft_ms")) for x in ours])
            ttft_steady = mean([x.get("ttft_ms") for x in ours])
            ttft_mean = mean([x.get("ttft_ms_mean") for x in ours])
            server_ours = mean([x.get("server_ttft_ms_mean") for x in ours])
            server_theirs = server_ttft_ms(Path(tmp), lv.name)
            thr, their_ttft = got["output_throughput"], got["median_ttft_ms"]
            print(f"{lv.name} | {sent[lv.name]} | {steady:.0f} / {wall:.0f} | {thr:.0f} | "
                  f"{wall / thr:.3f} | {ttft:.1f} (steady {ttft_steady:.1f}) | {their_ttft:.1f} | "
                  f"{ttft / their_ttft:.3f} | {fmt(ttft_mean, '.1f')} / {got['mean_ttft_ms']:.1f} | "
                  f"{fmt(server_ours, '.1f')} / {fmt(server_theirs, '.1f')}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
