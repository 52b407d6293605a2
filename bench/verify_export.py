"""Does the exported command deliver what the study claimed? `vllm bench serve` against it (issue 12, 7c).

Against a server started from the study's exported command (plain `vllm serve`, see
bench/h200_verify.sh), runs vLLM's own benchmark client at each closed-loop level of the study's
workload (random prompts of the workload's length, fixed output length, --ignore-eos, the same
request count as the study's level) and prints, per level, vLLM's output throughput and median
TTFT beside the study's figures for the exported config (mean over its launches), with the ratios.
Target: throughput within 3 %, TTFT within 10 %.

  python3 bench/verify_export.py --study studies/h200-levels.toml --base-url URL --model PATH
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
from tuner.load.client import load_plan  # noqa: E402
from tuner.search.storage import load_existing  # noqa: E402
from tuner.search.trial import extra_runs  # noqa: E402

VLLM_BENCH = """
import sys
try:
    from vllm.utils.argparse_utils import FlexibleArgumentParser
except ImportError:
    from vllm.utils import FlexibleArgumentParser
from vllm.benchmarks.serve import add_cli_args, main
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
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


def vllm_bench(base_url: str, model: str, w, concurrency: int, requests: int, out: Path,
               seed: int) -> dict:
    # vLLM's random dataset draws the same prompts for the same seed: one seed per run, or every
    # level would reuse the warm-up's and the levels' before it (prefix cache hits up to 87.5 %)
    name = f"c{concurrency}-{seed}.json"
    argv = [sys.executable, "-c", VLLM_BENCH, "--backend", "vllm", "--base-url", base_url,
            "--model", model, "--dataset-name", "random", "--random-input-len", str(w.prompt_tokens),
            "--random-output-len", str(w.output_tokens), "--num-prompts", str(requests),
            "--max-concurrency", str(concurrency), "--ignore-eos", "--temperature", "0",
            "--seed", str(seed), "--disable-tqdm", "--save-result", "--result-dir", str(out), "--result-filename", name]
    subprocess.run(argv, check=True, capture_output=True, text=True)
    return json.loads((out / name).read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--study", required=True)
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--seed", type=int, default=1000, help="first of the seeds used, one per level")
    ap.add_argument("--scale", type=int, default=1,
                    help="send SCALE times each level's request count (longer phases)")
    args = ap.parse_args()
    cfg = load_study(args.study)
    study = load_existing(cfg)
    df = report.trials_frame(study, cfg.tie_tolerance)
    row = export.choose(df[df["pareto"]], "balanced", df.attrs.get("noise"), cfg.tie_tolerance)
    number = int(row["trial"])
    claimed = study_levels(study, number)
    print(f"exported config: trial {number}, {int(row['runs'])} launch(es); "
          + report.describe_noise(df.attrs.get("noise")))
    print("level | requests | study tok/s (steady / wall) | vllm bench tok/s | ratio (wall) | "
          "study TTFT p50 ms, all requests (steady state) | vllm bench TTFT p50 ms | ratio")
    with tempfile.TemporaryDirectory() as tmp:
        # one discarded run first, as the study's warm-up
        vllm_bench(args.base_url, args.model, cfg.workload, 8, 16, Path(tmp), args.seed)
        for k, lv in enumerate(load_plan(cfg.workload), start=1):
            if lv.request_rate is not None:
                continue
            ours = claimed.get(lv.name, [])
            # a level with a time floor sent as many requests as fit in it: vLLM's client sends
            # the mean count of the study's launches (its count is fixed up front)
            sent = mean([x.get("requests") for x in ours]) or lv.requests
            n = int(round(sent)) * args.scale
            got = vllm_bench(args.base_url, args.model, cfg.workload, lv.concurrency, n, Path(tmp),
                             args.seed + k)
            steady = mean([x.get("throughput_tok_s") for x in ours])
            wall = mean([x.get("throughput_tok_s_wall") for x in ours])
            # vLLM's median TTFT is over every request: the study's same-definition figure is
            # ttft_ms_all (its objective, ttft_ms, leaves out the first wave), older studies lack it
            ttft = mean([x.get("ttft_ms_all", x.get("ttft_ms")) for x in ours])
            ttft_steady = mean([x.get("ttft_ms") for x in ours])
            thr, their_ttft = got["output_throughput"], got["median_ttft_ms"]
            print(f"{lv.name} | {n} | {steady:.0f} / {wall:.0f} | {thr:.0f} | "
                  f"{wall / thr:.3f} | {ttft:.1f} (steady {ttft_steady:.1f}) | {their_ttft:.1f} | "
                  f"{ttft / their_ttft:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
