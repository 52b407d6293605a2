"""Is the demo's front an answer a user can trust? Two checks on real studies (issue 12, 7a and 7b).

Runs the demo study (`python -m tuner run`, real vLLM) twice with different sampler seeds, each
into its own storage and results folder, then prints for each run:

  (a) the feasible config with the highest mean throughput, and whether it is on the front; if
      not, the front member whose throughput is within the measured noise of it (the only way it
      may be left out);
  (b) across the two runs: for each front member, the members of the other run's front whose
      figures tie with it on every objective (the pooled noise of both runs), whether the other
      run measured that config too, and the exported command (balanced) of each.

  .venv/bin/python bench/front_stability.py --trials 12 --seeds 1 2 [--out DIR]   # ~30-60 min on 2 cores

Existing studies in DIR are resumed, so a killed bench goes on where it stopped; --report-only
skips the runs and prints the checks from what DIR holds.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tuner import noise as noise_module  # noqa: E402
from tuner.results import export, report  # noqa: E402
from tuner.cli import resolve_study_file  # noqa: E402
from tuner.config import load_study  # noqa: E402
from tuner.errors import TunerError  # noqa: E402
from tuner.search.storage import load_existing  # noqa: E402


def config(study: str, out: Path, seed: int):
    name = f"{Path(study).stem}-seed{seed}"
    return load_study(resolve_study_file(study), {
        "name": name, "seed": seed, "storage": f"sqlite:///{out}/{name}.db", "results_dir": str(out)})


def run(study: str, out: Path, seed: int, trials: int) -> float:
    cfg = config(study, out, seed)
    argv = [sys.executable, "-m", "tuner", "run", "--study", study, "--trials", str(trials),
            "--seed", str(seed), "--name", cfg.name, "--storage", cfg.storage,
            "--results", str(out), "--quiet"]
    t0 = time.monotonic()
    with open(out / f"{cfg.name}.log", "a") as log:
        subprocess.run(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, check=False)
    return time.monotonic() - t0


def params_of(row) -> str:
    return (f"{float(row['gpu_memory_utilization']):.2f} / {int(row['max_model_len'])} / "
            f"{int(row['max_num_seqs'])}")


def check_top_is_on_front(df) -> str:
    noise = df.attrs.get("noise")
    measured = df[df["feasible"].astype(bool) & df["throughput_tok_s"].notna()]
    if measured.empty:
        return "no feasible config measured"
    top = measured.loc[measured["throughput_tok_s"].astype(float).idxmax()]
    front = df[df["pareto"]]
    line = (f"highest mean throughput: trial {int(top['trial'])} {params_of(top)} "
            f"{top['throughput_tok_s']:.0f} tok/s over {int(top.get('runs', 1))} run(s); ")
    if bool(top["pareto"]):
        return line + "on the front: PASS"
    for _, m in front.iterrows():
        margin = noise_module.tie_margin("throughput_tok_s", float(top["throughput_tok_s"]),
                                   float(m["throughput_tok_s"]), int(top.get("runs", 1)),
                                   int(m.get("runs", 1)), noise, 0.02)
        if abs(float(top["throughput_tok_s"]) - float(m["throughput_tok_s"])) <= margin:
            return line + (f"off the front, but member trial {int(m['trial'])} "
                           f"({m['throughput_tok_s']:.0f} tok/s) is within the noise: PASS")
    return line + "off the front and no member within the noise: FAIL"


def pooled_noise(*noises: dict | None) -> dict:
    """The runs' launch-to-launch noise pooled per objective (cv² weighted by degrees of freedom)."""
    out = {}
    for k in report.OBJECTIVES:
        parts = [n[k] for n in noises if n and k in n]
        dof = sum(p["dof"] for p in parts)
        if dof:
            cv = (sum(p["cv"] ** 2 * p["dof"] for p in parts) / dof) ** 0.5
            out[k] = {"cv": cv, "dof": dof, "configs": sum(p["configs"] for p in parts)}
    return out


def counterparts(member, front, noise: dict) -> list:
    """The rows of `front` whose every objective ties with `member`'s (the same config or not)."""
    return [o for _, o in export.ties_with(front, member, noise, 0.02).iterrows()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--study", default="demo")
    ap.add_argument("--trials", type=int, default=12)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--out", type=Path, default=REPO / "results" / "front-stability")
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args()
    if args.trials < 1 or not args.seeds:
        ap.error("--trials of at least 1 and one seed or more")
    if args.report_only and not args.out.is_dir():
        ap.error(f"--report-only: no studies in {args.out}")
    args.out.mkdir(parents=True, exist_ok=True)
    frames = {}
    for seed in args.seeds:
        if not args.report_only:
            took = run(args.study, args.out, seed, args.trials)
            print(f"seed {seed}: study ran for {took / 60:.1f} min", flush=True)
        try:
            cfg = config(args.study, args.out, seed)
            study = load_existing(cfg)
        except TunerError as e:
            ap.error(f"seed {seed}: {e}")
        df = report.trials_frame(study, cfg.tie_tolerance)
        frames[seed] = (cfg, study, df)
        launched = int((~df["failure"].fillna("").isin(["predicted_infeasible", "predicted_dominated"])).sum())
        print(f"\n== seed {seed}: {len(df)} trials, {launched} launched; "
              f"{report.describe_noise(df.attrs.get('noise'))}")
        print(report.table(df[df["pareto"]]))
        print("(a) " + check_top_is_on_front(df))
    if len(frames) > 2:
        print(f"\n(b) compares the fronts of the first two seeds; the exported command is compared "
              f"over all {len(frames)}")
    if len(frames) >= 2:
        (sa, (ca, stud_a, a)), (sb, (cb, stud_b, b)) = list(frames.items())[:2]
        noise = pooled_noise(a.attrs.get("noise"), b.attrs.get("noise"))
        print(f"\n(b) seed {sa} against seed {sb}; pooled {report.describe_noise(noise)}")
        matched = True
        for label, x, y in ((f"seed {sa}", a, b), (f"seed {sb}", b, a)):
            for _, m in x[x["pareto"]].iterrows():
                twins = counterparts(m, y[y["pareto"]], noise)
                same = y[(y["gpu_memory_utilization"] == m["gpu_memory_utilization"])
                         & (y["max_model_len"] == m["max_model_len"])
                         & (y["max_num_seqs"] == m["max_num_seqs"])
                         & y["throughput_tok_s"].notna()]
                measured = ("not measured by the other run" if same.empty else
                            f"the other run has it {'on' if same.iloc[0]['pareto'] else 'off'} its front")
                matched &= bool(twins)
                print(f"  {label} front {params_of(m)}: {measured}; "
                      + ("counterpart within the noise on every objective: "
                         + ", ".join(params_of(t) for t in twins) if twins
                         else "no member of the other front within the noise: differs"))
        print(f"  every front member has a counterpart within the noise: {'PASS' if matched else 'FAIL'}")
        cmds = []
        for seed, (cfg, study, df) in frames.items():
            front = df[df["pareto"]]
            if front.empty:
                cmds.append("(empty front)")
                continue
            row = export.choose(front, "balanced", df.attrs.get("noise"), cfg.tie_tolerance)
            cmds.append(export.command(row, study, cfg))
            print(f"  exported (balanced), seed {seed}: {cmds[-1]}")
        print(f"  same exported command: {'PASS' if len(set(cmds)) == 1 else 'FAIL'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
