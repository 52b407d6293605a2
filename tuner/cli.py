"""Command line: argument parsing, and turning TunerError into one line and exit code 2.

Heavy modules (optuna, aiohttp, matplotlib, vllm) are imported inside the commands so that
`--help` stays instant.
"""

from __future__ import annotations

import argparse
import json
import math
import dataclasses
import os
import signal
import sys
from pathlib import Path

from tuner.errors import TunerError

PACKAGE_STUDIES = Path(__file__).parent / "studies"

EPILOG = """examples:
  python -m tuner run --trials 40                 tune the embedded tiny model (studies/demo.toml)
  python -m tuner run --study studies/my.toml --trials 30 --model /models/Qwen2.5-7B
  python -m tuner run --study gpu --model preset:llama-3.1-8b --memory-budget-gib 16 --trials 12
  python -m tuner show                            the trials and the Pareto set as a table
  python -m tuner export --prefer throughput      the launch command of the chosen config
  python -m tuner measure --gpu-memory-utilization 0.2 --max-model-len 4096 --max-num-seqs 8
  python -m tuner doctor                          what will be launched, and where
  python -m tuner compare --study demo --study demo-llamacpp   two engines' fronts side by side
"""


def resolve_study_file(name: str) -> Path:
    """A path, or a name under ./studies/ or the package's studies (the embedded demo)."""
    p = Path(name)
    if p.suffix == ".toml" or p.is_file() or os.sep in name:
        return p
    for folder in (Path("studies"), PACKAGE_STUDIES):
        if (folder / f"{name}.toml").exists():
            return folder / f"{name}.toml"
    return Path("studies") / f"{name}.toml"


def add_study_options(p: argparse.ArgumentParser, tuning: bool = True) -> None:
    g = p.add_argument_group("study")
    g.add_argument("--study", default="demo", metavar="FILE|NAME",
                   help="study file, or a name under studies/ (default: demo, the embedded tiny model)")
    g.add_argument("--name", help="study name (default: the file's [study] name or stem)")
    g.add_argument("--storage", metavar="URL",
                   help="Optuna storage URL (default: sqlite:///studies/NAME.db; "
                        "postgresql://... lets several hosts share a study)")
    g.add_argument("--results", dest="results_dir", metavar="DIR",
                   help="results folder (default: results; files land in DIR/NAME/)")
    if not tuning:
        return
    from tuner.models.presets import PRESETS

    g.add_argument("--model", help="model folder, HF id or preset:NAME (overrides the study file); "
                                   f"presets: tiny, {', '.join(PRESETS)}")
    g.add_argument("--engine", metavar="CMD",
                   help="command that starts vLLM, e.g. '/opt/venv/bin/vllm serve' "
                        "(default: `vllm serve`, else python -m vllm.entrypoints.openai.api_server)")
    g.add_argument("--host", help="address the server binds (default 127.0.0.1)")
    g.add_argument("--launch-timeout", dest="launch_timeout_s", type=finite_float, metavar="S",
                   help="seconds a launch may take before it counts as startup_timeout")
    g.add_argument("--memory-budget-gib", dest="memory_budget_gib", type=finite_float, metavar="GIB",
                   help="give the instance only this much device memory (e.g. 16 to tune for a "
                        "16 GB card on a bigger one); gpu-memory-utilization is then a share of it")


def overrides(args: argparse.Namespace) -> dict:
    keys = ("name", "storage", "results_dir", "model", "host", "launch_timeout_s",
            "memory_budget_gib", "sampler", "seed", "confirm", "replicates", "patience")
    out = {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}
    if getattr(args, "engine", None):
        out["engine"] = args.engine
    return out


def load_config(args: argparse.Namespace):
    from tuner.config import load_study

    return load_study(resolve_study_file(args.study), overrides(args))


def checked_config(args: argparse.Namespace, values: dict | None = None):
    """The study, its values checked against vLLM's ranges and the model's config.json before any
    launch: `values` (one config, for `measure`) must fit; a searched max_model_len range partly
    over the model's limit is clipped with one warning line."""
    from tuner.models import checkpoint
    from tuner import config

    cfg = load_config(args)
    check_host(cfg.host)
    if values is not None:
        config.check_flag_values(values, "command line", cfg.extra_args)
    else:
        config.check_space(cfg)
    # no download here: an HF id not in the cache yet is judged by vLLM after the fetch
    found = config.read_model_configs(checkpoint.resolve_model(cfg, fetch=False, quiet=True)[0])
    if found is None:
        return cfg
    if values is None:
        return config.fit_space_to_model(cfg, *found, warn=lambda line: print(line, file=sys.stderr))
    if values.get("max_model_len") and not config.long_max_model_len_allowed(cfg.env):
        config.check_max_model_len(values["max_model_len"], *found)
    return cfg


def check_tokenizer(cfg, model: str | None = None, extra_args=None) -> None:
    """A vLLM model folder without a tokenizer crashes every launch the same way: refused before
    the first (an HF id not fetched yet is judged once it is)."""
    from tuner.models import checkpoint

    if cfg.engine_name != "vllm":
        return
    if model is None:
        model, extra_args = checkpoint.resolve_model(cfg, fetch=False, quiet=True)
    if problem := checkpoint.tokenizer_problem(model, extra_args or ()):
        raise TunerError(f"model {cfg.model!r}: {problem}")


def check_host(host: str) -> None:
    """The address every server binds and every request goes to: a name that does not resolve
    would fail each launch the same way, so it is refused before the first."""
    import socket

    try:
        socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError) as e:
        raise TunerError(f"--host {host}: not an address or a name this machine resolves ({e})")


def _whole_number(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}")
    if value < least:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}" if least == 1
                                         else f"must be {least} or more, got {value}")
    return value


def positive_int(text: str) -> int:
    return _whole_number(text, 1)


def nonneg_int(text: str) -> int:
    return _whole_number(text, 0)


def finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}")
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def positive_minutes(text: str) -> float:
    """Minutes on the command line, seconds inside."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected minutes, e.g. 90 or 7.5, got {text!r}")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 minutes, got {text}")
    return value * 60


def add_flag_options(p: argparse.ArgumentParser) -> None:
    """One option per row of the engine's flag table, spelled as the engine spells it; the values
    are checked against the table's ranges later, with the other errors (`checked_config`)."""
    from tuner import engines

    for f in engines.flags():
        if f.kind == "bool":
            p.add_argument(f.cli, dest=f.name, action="store_true", help=f.help or None)
            continue
        kind = {"float": finite_float, "int": positive_int if f.low == 1 else int, "str": str}[f.kind]
        p.add_argument(f.cli, dest=f.name, type=kind, required=f.required, help=f.help or None)


class _Parser(argparse.ArgumentParser):
    """Bad command-line values end as one line, like every other error (not usage + error)."""

    def error(self, message: str):
        self.exit(2, f"tuner: error: {self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m tuner", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Pareto autotuner for vLLM launch flags: launches real servers with candidate "
                    "--gpu-memory-utilization / --max-model-len / --max-num-seqs, load-tests them "
                    "and keeps the configs no other beats on single-stream speed, throughput and TTFT.",
        epilog=EPILOG)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def command(name: str, help_text: str, examples: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help_text, description=help_text,
                              epilog="examples:\n" + examples,
                              formatter_class=argparse.RawDescriptionHelpFormatter)

    run = command("run", "search launch flags: launch, load-test and record trials until N are done",
                  "  python -m tuner run --trials 40\n"
                  "  python -m tuner run --study studies/gpu.toml --trials 12 --confirm 2\n"
                  "  python -m tuner run --study studies/gpu.toml --trials 40 --time-limit 120\n"
                  "  python -m tuner run --study studies/gpu.toml --trials 40 --patience 8\n"
                  "  python -m tuner run --trials 40 --sampler random --name demo-random\n"
                  "  python -m tuner run --study studies/gpu.toml --trials 40 --gpus 0,1,2,3\n"
                  "  python -m tuner run --trials 40 --parallel 2 --storage postgresql://tuner@db/tuner\n"
                  "A killed run resumes: run the same command again.\n")
    run.add_argument("--trials", type=positive_int, default=20,
                     help="stop when the study holds this many launched trials (default 20)")
    run.add_argument("--sampler", choices=("auto", "gp", "tpe", "random", "grid"),
                     help="search strategy (default auto: GP when scipy and torch import, else TPE)")
    run.add_argument("--seed", type=nonneg_int, help="sampler seed (0 to 2**32 - 1)")
    run.add_argument("--confirm", type=int, metavar="K",
                     help="relaunch each Pareto member K times at the end; the front is then "
                          "formed from the mean of all runs, and a member whose relaunch fails leaves it")
    run.add_argument("--replicates", type=int, metavar="R",
                     help="relaunch each baseline R more times to measure launch-to-launch noise, "
                          "which decides ties on the front (default 2; 0 = no noise measurement)")
    run.add_argument("--time-limit", dest="time_limit", type=positive_minutes, metavar="MIN",
                     help="start no launch that would end after MIN minutes, judged by this "
                          "study's median launch (a study with none measured yet starts its first "
                          "launch whatever its length); then stop with everything kept (run again to go on)")
    run.add_argument("--patience", type=int, metavar="N",
                     help="stop early once N launches in a row have not changed the Pareto front "
                          "beyond the measured noise (default 0: off; [study] patience)")
    run.add_argument("--quiet", action="store_true", help="no live load-test lines")
    g = run.add_argument_group("many workers on one study")
    g.add_argument("--parallel", type=positive_int, metavar="N",
                   help="N worker processes on this host, asking and telling on the study's "
                        "storage; --trials is their shared budget (default 1, or one per --gpus)")
    g.add_argument("--gpus", metavar="LIST",
                   help="one worker per GPU, each with CUDA_VISIBLE_DEVICES set to its own "
                        "(e.g. 0,1 or GPU-UUIDs)")
    g.add_argument("--first-worker", dest="first_worker", type=nonneg_int, default=0, metavar="K",
                   help="number this host's workers from K (their sampler seeds are seed + number): "
                        "on a second host sharing a PostgreSQL study, the count of workers before it")
    g.add_argument("--ports", metavar="LOW-HIGH",
                   help="the ports this run's servers bind (default: any free port; each --parallel "
                        "worker gets its own range)")
    g.add_argument("--worker", type=int, help=argparse.SUPPRESS)   # set by --parallel for its workers
    add_study_options(run)

    report = command("report", "rebuild results/NAME/ (CSV files, plots, best command, report.html) "
                     "from storage, also while a run is going",
                     "  python -m tuner report\n  python -m tuner report --study studies/h200-full.toml\n")
    add_study_options(report, tuning=False)

    show = command("show", "print the trials and the Pareto set as a table",
                   "  python -m tuner show\n  python -m tuner show --all-columns\n")
    show.add_argument("--all-columns", action="store_true", help="every recorded column")
    add_study_options(show, tuning=False)

    export = command("export", "print the launch command of a Pareto config (and write best-command.sh)",
                     "  python -m tuner export\n  python -m tuner export --prefer ttft\n"
                     "  python -m tuner export --json | jq .max_num_seqs\n"
                     "  python -m tuner export --study studies/h200-16gb.toml   "
                     "the value for a 16 GB card\n"
                     "  python -m tuner export --keep-dummy     serve random weights, as the trials did\n"
                     "  python -m tuner export --min-context 16384 --prefer throughput   "
                     "the best config for 16k requests\n"
                     "  python -m tuner export --trial 21       a trial `show` names, whether on the "
                     "front or not\n"
                     "The command is the argv the trial ran: its fixed flags and --host, no --port "
                     "(vLLM's 8000),\n`vllm serve MODEL`, and under a memory budget the value for "
                     "a card of the budget's size.\nA preset's dummy weights become the model it "
                     "stands for. Notes go to stderr and best-command.sh.\nAmong the front "
                     "members that tie with the preference's pick on every objective (within the "
                     "measured\nnoise), the one that changes the fewest of vLLM's defaults is "
                     "exported; a note names the others.\n")
    export.add_argument("--prefer", choices=("balanced", "throughput", "single-stream", "ttft"),
                        default="balanced", help="which Pareto config to pick (default balanced)")
    export.add_argument("--json", action="store_true", help="print the params as JSON instead")
    export.add_argument("--keep-dummy", action="store_true",
                        help="keep --load-format dummy (random weights) instead of naming the "
                             "model a preset stands for")
    which = export.add_mutually_exclusive_group()
    which.add_argument("--min-context", type=positive_int, metavar="TOKENS",
                       help="pick among the measured configs that serve requests of at least this "
                            "many tokens (their own Pareto set), e.g. 16384")
    which.add_argument("--trial", type=nonneg_int, metavar="N",
                       help="export this trial's command (a feasible measured one), front or not")
    add_study_options(export, tuning=False)

    measure = command("measure", "launch one config, run the study's load test, print one JSON object "
                      "(exit 1 when the config failed to launch or under load)",
                      "  python -m tuner measure --gpu-memory-utilization 0.2 --max-model-len 4096 "
                      "--max-num-seqs 8\n"
                      "  python -m tuner measure --model preset:llama-3.1-8b "
                      "--gpu-memory-utilization 0.9 --max-model-len 8192 --max-num-seqs 64\n")
    add_flag_options(measure)
    add_study_options(measure)

    doctor = command("doctor", "show what vLLM will be launched and how, the GPUs, and whether "
                     "storage and results are writable", "  python -m tuner doctor\n"
                     "  python -m tuner doctor --study studies/h200-16gb.toml && python -m tuner run "
                     "--study studies/h200-16gb.toml\nEvery check is listed; exit code 1 when one "
                     "found a PROBLEM.\n")
    add_study_options(doctor)

    compare = command("compare", "put the Pareto fronts of two or more studies (same model and "
                      "workload, e.g. one per engine) side by side: a table, compare.csv, compare.png",
                      "  python -m tuner compare --study demo --study demo-llamacpp\n"
                      "  python -m tuner compare --study studies/a.toml --study studies/b.toml "
                      "--out results/a-vs-b\n"
                      "Reads storage only (run each study first). Differing workloads or models "
                      "are warned about:\nthen the figures are not like for like.\n")
    compare.add_argument("--study", action="append", default=[], metavar="FILE|NAME",
                         help="a study file, or a name under studies/; give two or more")
    compare.add_argument("--storage", action="append", default=[], metavar="URL",
                         help="Optuna storage URL, as show/export/report take it: once for every "
                              "study, or once per --study in the same order (default: each "
                              "study file's own)")
    compare.add_argument("--out", metavar="DIR",
                         help="where compare.csv and compare.png go "
                              "(default: results/compare-A-B/)")
    return parser


# the top-level modules of pyproject.toml's dependencies: a Python without one gets a one-line answer
REQUIRED_MODULES = {"optuna", "pandas", "aiohttp", "pynvml", "matplotlib", "numpy", "scipy",
                    "tokenizers", "xllamacpp", "gguf"}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.command is None:
        parser.print_help()
        return 2
    handler = {"run": cmd_run, "report": cmd_report, "show": cmd_show, "export": cmd_export,
               "measure": cmd_measure, "doctor": cmd_doctor,
               "compare": cmd_compare}[args.command]
    # SIGTERM unwinds like Ctrl-C, so every `with ServerProcess` stops its server before exit.
    # a run started with `&` from a script inherits SIGINT ignored: Ctrl-C / kill -INT must still stop it
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGHUP, _raise_interrupt)
    try:
        return handler(args) or 0
    except TunerError as e:
        print(f"tuner: error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        if e.name not in REQUIRED_MODULES:
            raise
        print(f"tuner: error: {sys.executable} has no {e.name} (a dependency of the tuner): run "
              "`bash install.sh` and use .venv/bin/python, or `pip install -e .` into this Python",
              file=sys.stderr)
        return 2
    except BrokenPipeError:
        try:   # is it stdout whose reader left? (a write there fails again; the failed one was dropped)
            sys.stdout.write("\n")
            sys.stdout.flush()
        except BrokenPipeError:
            # `tuner show | head`: the reader left; say nothing more (stdout is gone)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
        raise   # another pipe broke: a fault, not the reader leaving
    except KeyboardInterrupt:
        print("tuner: interrupted; servers stopped, finished trials kept: "
              "run the same command again to resume", file=sys.stderr)
        return 130


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def parse_ports(text: str) -> range:
    low, sep, high = text.partition("-")
    if not (sep and low.isdigit() and high.isdigit() and 0 < int(low) <= int(high) < 65536):
        raise TunerError(f"--ports {text!r}: give a range LOW-HIGH, e.g. --ports 20000-20199")
    return range(int(low), int(high) + 1)


def cmd_run(args) -> int:
    from tuner.run import process, spare
    from tuner.search import parallel
    from tuner.search.study import Tuner

    cfg = checked_config(args)
    check_tokenizer(cfg)
    if args.ports:
        process.PORT_RANGE = parse_ports(args.ports)
    spare.enable()   # each launch's imports are done ahead, while the one before starts
    gpus = parallel.parse_gpus(args.gpus)
    n_workers = args.parallel or max(1, len(gpus))
    if args.worker is None and (n_workers > 1 or gpus):
        study = parallel.run(cfg, args.argv, n_workers, args.trials, gpus, args.first_worker)
        print_summary(study, cfg)
        return 0
    if args.worker is not None:   # one of `--parallel`'s workers: the supervisor writes results/
        tuner = Tuner(cfg, progress=False, worker=args.worker, report_at_end=False)
        tuner.run(args.trials, args.time_limit)
        return 0
    # one tuner; numbered only when told (a host of its own on a shared PostgreSQL study)
    tuner = Tuner(cfg, progress=not args.quiet, worker=args.first_worker or None)
    study = tuner.run(args.trials, args.time_limit)
    print_summary(study, cfg)
    return 0


def print_summary(study, cfg) -> None:
    from tuner.results import contexts, export, report

    df = report.trials_frame(study, cfg.tie_tolerance, cfg.requirement)
    front, warning = export.offered_front(df, cfg.tie_tolerance)
    counts = df["failure"].replace("", "measured").value_counts().to_dict()
    print(f"study {cfg.name}: {len(df)} trials ({', '.join(f'{k} {v}' for k, v in counts.items())})",
          file=sys.stderr)
    print(report.describe_noise(df.attrs.get("noise")), file=sys.stderr)
    if machines := report.describe_machines(df):
        print(machines, file=sys.stderr)
    for line in contexts.headline(contexts.context_frame(df)):
        print(line, file=sys.stderr)
    if len(front):
        print(f"Pareto set ({report.plural(len(front), 'config')}):", file=sys.stderr)
        print(report.table(front), file=sys.stderr)
        if held := report.describe_front_watch(study, cfg.patience):
            print(held, file=sys.stderr)
    else:
        print(report.describe_empty_front(df), file=sys.stderr)
    written = [n for n in report.REPORT_OUTPUTS if (cfg.results_path / n).exists()]
    print(f"results: {cfg.results_path}/ ({', '.join(written)})", file=sys.stderr)
    if len(front):
        if warning:
            print(f"tuner: {warning}", file=sys.stderr)
        print(export.exported(export.choose(front, "balanced", df.attrs.get("noise"),
                                            cfg.tie_tolerance), study, cfg).command())


def _study_and_frame(args):
    from tuner.results import report
    from tuner.search.storage import load_existing

    cfg = load_config(args)
    study = load_existing(cfg)
    return cfg, study, report.trials_frame(study, cfg.tie_tolerance, cfg.requirement)


def cmd_report(args) -> int:
    from tuner.results import report
    from tuner.search.storage import load_existing
    from tuner.search.study import check_results_dir

    cfg = load_config(args)
    study = load_existing(cfg)
    check_results_dir(cfg)
    df = report.write_all(study, cfg)
    print(f"wrote {cfg.results_path}/ from {report.plural(len(df), 'trial')}", file=sys.stderr)
    return 0


def cmd_show(args) -> int:
    from tuner.results import contexts, report

    cfg, study, df = _study_and_frame(args)
    if df.empty:
        print("no trials yet", file=sys.stderr)
        return 0
    print(report.all_columns_text(df) if args.all_columns else report.table(df))
    front = df[df["pareto"]]
    print(f"\n{report.describe_noise(df.attrs.get('noise'))}")
    if machines := report.describe_machines(df):
        print(machines)
    if launch := report.describe_launch(df):
        print(launch)
    if lines := contexts.describe(contexts.context_frame(df)):
        print("\n".join(lines))
    if len(front):
        print(f"Pareto set: trial{'s' if len(front) > 1 else ''} "
              f"{', '.join(str(int(t)) for t in front['trial'])}")
        if held := report.describe_front_watch(study, cfg.patience):
            print(held)
    else:
        print(report.describe_empty_front(df))
    return 0


def cmd_export(args) -> int:
    from tuner.results import contexts, export, report

    cfg, study, df = _study_and_frame(args)
    asked = (f"--trial {args.trial}" if args.trial is not None else f"--prefer {args.prefer}"
             + (f" --min-context {args.min_context}" if args.min_context else ""))
    if args.trial is not None:
        df = export.one_trial(df, args.trial, cfg.name)
    elif args.min_context:
        df = contexts.at_least(df, args.min_context, cfg.tie_tolerance, cfg.name)
    front, warning = export.offered_front(df, cfg.tie_tolerance)
    if front.empty:
        measured = (df["failure"] != "").any() if len(df) else False
        why = (report.describe_empty_front(df).split("; ", 1)[-1] if measured
               else "no trial has been measured yet")
        last = df.loc[df["failure"] != "", "failure_message"].dropna() if "failure_message" in df else []
        hint = f"; the last said: {str(last.iloc[-1])[:200]}" if len(last) else ""
        raise TunerError(f"study {cfg.name} has no feasible measured config yet ({why}{hint}): "
                         "fix that, or run more trials")
    row = export.choose(front, args.prefer, df.attrs.get("noise"), cfg.tie_tolerance)
    exported = export.exported(row, study, cfg, keep_dummy=args.keep_dummy, warning=warning)
    label = "" if args.trial is not None else f"{args.prefer}: "   # describe_figures names the trial
    print(f"# {label}{report.describe_figures(row, df.attrs.get('noise'))}", file=sys.stderr)
    why = export.choice_note(front, row, args.prefer, df.attrs.get("noise"), cfg.tie_tolerance)
    if why:
        print(f"# {why}", file=sys.stderr)
    ties = export.objective_tie_note(front, row, args.prefer, df.attrs.get("noise"),
                                     cfg.tie_tolerance)
    if ties:
        print(f"# {ties}", file=sys.stderr)
    for note in exported.notes:
        print(f"# {note}", file=sys.stderr)
    if args.json:
        print(json.dumps({**export.params_dict(row), "command": exported.command()}, indent=2))
    else:
        print(exported.command())
    cfg.results_path.mkdir(parents=True, exist_ok=True)
    (cfg.results_path / "best-command.sh").write_text(
        export.script(row, study, cfg, keep_dummy=args.keep_dummy, warning=warning,
                      prefer=args.prefer, why=why, df=df, asked=asked))
    return 0


def cmd_measure(args) -> int:
    import time

    from tuner.run import devices
    from tuner.run.process import check_engine_cmd
    from tuner.run.measure import measure_config
    from tuner import engines
    from tuner.search.space import params_from, scaled
    from tuner.models.checkpoint import resolve_model
    from tuner.search.study import budget_pins, detect_platform, launch_spec, memory_scale
    from tuner.search.trial import outcome_dict

    # a bool flag not given is the engine's default (absent), not False
    values = {f.name: getattr(args, f.name) or None if f.kind == "bool" else getattr(args, f.name)
              for f in engines.flags()}
    cfg = checked_config(args, values)
    from tuner.load import plan

    from tuner.search import requirement

    context = engines.get().request_context(params_from(values).values())
    too_short = plan.context_too_short(cfg.workload, context)
    if too_short is not None:
        refused = ("every request" if too_short[0] >= 1
                   else "more of a level's requests than the load test tolerates")
        raise TunerError(f"{engines.get().request_context_name} {context} < {too_short[1]}: "
                         f"{refused} would be refused for length; give a longer context or shorter "
                         f"[workload] lengths")
    if requirement.context_shortfall(context, cfg.requirement) > 0:
        raise TunerError(requirement.context_message(engines.get().request_context_name, context,
                                                     cfg.requirement) + ": the study never offers it")
    platform = detect_platform(cfg)
    check_engine_cmd(platform.engine)
    model, extra = resolve_model(cfg)
    extra = (*extra, *budget_pins(cfg, platform, given={k for k, v in values.items() if v is not None}))
    check_tokenizer(cfg, model, extra)
    if cfg.use_memory_model and os.path.isdir(model):
        # a config.json the memory model cannot read is refused as `run` refuses it (exit 2)
        engines.get().memory_model(model, platform.memory_total_bytes, platform.kind, extra,
                                   platform.device_name)
    params = scaled(params_from(values), memory_scale(cfg, platform))
    if platform.kind == "cuda":
        devices.check_gpu_free(int(params.gpu_memory_utilization * platform.memory_total_bytes),
                           env=cfg.env)
    folder = cfg.results_path / "measure" / time.strftime("%Y%m%d-%H%M%S")
    folder.mkdir(parents=True, exist_ok=True)
    spec = launch_spec(cfg, platform, model, extra, params, folder / "server.log")
    outcome = measure_config(spec, cfg.workload)
    out = outcome_dict(outcome)
    for key in ("peak_gpu_memory_bytes", "peak_gpu_server_bytes", "peak_gpu_stranger_bytes"):
        if getattr(outcome, key, None) is not None:
            out[key.replace("_bytes", "_gib")] = round(getattr(outcome, key) / 2**30, 3)
    if cfg.memory_budget_gib:   # the flag as given is a share of the budget; the launch's of the card
        out.update(memory_budget_gib=cfg.memory_budget_gib,
                   searched_gpu_memory_utilization=values.get("gpu_memory_utilization"))
    if not out["failure"]:   # what a study would also hold against it: [requirement], [slo]
        from tuner.search.trial import slo_message, slo_violation

        kv = outcome.capacity.kv_cache_tokens if outcome.capacity is not None else None
        if requirement.capacity_shortfall(kv, cfg.requirement) > 0:
            out.update(failure="requirement_not_met",
                       failure_message=requirement.capacity_message(kv, cfg.requirement) + " (not load-tested)")
        elif outcome.metrics is not None and slo_violation(cfg, outcome.metrics) > 0:
            out.update(failure="slo_not_met", failure_message=slo_message(cfg, outcome.metrics))
    print(json.dumps(out, indent=2, default=str))
    return 1 if out["failure"] else 0


def cmd_doctor(args) -> int:
    from tuner.models.checkpoint import resolve_model
    from tuner.records import Platform
    from tuner.run.process import check_engine_cmd
    from tuner.search.storage import check_storage
    from tuner.search.study import check_results_dir, detect_platform

    cfg = load_config(args)
    lines = [f"study      {cfg.source} (name {cfg.name})"]
    platform = None
    try:
        platform = detect_platform(cfg)
        check_engine_cmd(platform.engine)
        lines.append(f"engine     {' '.join(platform.engine)}")
    except TunerError as e:
        lines.append(f"engine     PROBLEM: {e}")
    if platform is None:   # the engine is not installed here: the other checks still run
        from tuner.search import feasibility

        platform = Platform("cpu", "", feasibility.device_memory_bytes("cpu"), None, (), "")
    from tuner import engines

    label = engines.get(cfg.engine_name).label
    if any(ln.startswith("engine     PROBLEM") for ln in lines):
        lines.append(f"{label:<10} unknown (its command was not found)")
    else:
        lines.append(f"{label:<10} {platform.vllm_version or 'unknown (not installed in this Python)'}")
    model, extra = None, cfg.extra_args
    try:
        model, extra = resolve_model(cfg, fetch=False)  # a check: never a download
        if model == cfg.model and not os.path.exists(model) and not model.startswith("preset:"):
            lines.append(f"model      {model}: HF id not in the local cache; `run` fetches it "
                         "before the first launch")
        else:
            lines.append(f"model      {model} {' '.join(extra)}")
        check_tokenizer(cfg, model, extra)
    except TunerError as e:
        lines.append(f"model      PROBLEM: {e}")
    lines += doctor_gpu_lines(cfg, platform, model, extra)
    lines += doctor_budget_lines(cfg, platform)
    try:
        fitted = checked_config(args)   # the space as searched: cut at the model's limit
        values_line = "values     space and fixed flags within vLLM's ranges and the model's limit"
        from tuner.config import read_model_configs

        if model and os.path.isfile(os.path.join(model, "config.json")) and read_model_configs(model) is None:
            values_line = ("values     space and fixed flags within vLLM's ranges; the model's limit "
                           "unchecked (its config.json cannot be read)")
    except TunerError as e:
        fitted, values_line = cfg, f"values     PROBLEM: {e}"
    lines += doctor_fit_lines(fitted, platform, model, extra)
    lines.append(values_line)
    lines += doctor_workload_lines(fitted)
    try:
        lines.append(f"storage    {cfg.storage}: {check_storage(cfg.storage)}")
    except TunerError as e:
        lines.append(f"storage    PROBLEM: {e}")
    try:
        check_results_dir(cfg)
        lines.append(f"results    {cfg.results_path}/: writable")
    except TunerError as e:
        lines.append(f"results    PROBLEM: {e}")
    print("\n".join(lines))
    return 1 if any(" PROBLEM: " in ln for ln in lines) else 0


def cmd_compare(args) -> int:
    from tuner.results import compare

    sides = compare.load_sides(args.study, resolve_study_file, args.storage)
    if warning := compare.mismatch(sides):
        print(f"tuner: {warning}", file=sys.stderr)
    out = Path(args.out) if args.out else compare.default_out(sides)
    paths = compare.write(sides, out)   # first: an unwritable --out is an error before any output
    print(compare.table(sides))
    print(f"wrote {', '.join(str(p) for p in paths)}", file=sys.stderr)
    return 0


def doctor_workload_lines(cfg) -> list[str]:
    """Whether the space's contexts hold the workload's requests: none does is a problem (every
    launch would be refused for length); some do not, a line (those configs are skipped unlaunched).
    The contexts a request gets come from the engine (llama.cpp: ctx-size per slot), over every
    choice and each range's ends."""
    import itertools

    from tuner import engines
    from tuner.config import fixed_flag_values
    from tuner.load import plan

    engine = engines.get()
    fixed = fixed_flag_values(cfg.extra_args, cfg.source)
    corners = [list(d.choices) if d.choices else [d.low, d.high] for d in cfg.dimensions]
    contexts = set()
    for combo in itertools.product(*corners):
        values = {**fixed, **{d.name: v for d, v in zip(cfg.dimensions, combo)}}
        contexts.add(engine.request_context(values))
    contexts.discard(None)   # the model's own context: checked against the model elsewhere
    short = sorted(n for n in contexts if plan.context_too_short(cfg.workload, n) is not None)
    name = engine.request_context_name
    if not short:
        # a length mix may still lose a few requests to the shortest context, within the
        # load test's tolerance: said, since those configs then serve slightly less
        w = cfg.workload
        least = min(contexts) if contexts else None
        lost = plan.share_too_long(w, least) if least is not None and w.length_mix != "fixed" else 0.0
        return [f"workload   {name} {least:,} refuses up to {lost:.0%} of a level's requests of the "
                f"{w.length_mix} mix for length (within max_failed_share {w.max_failed_share:g}): "
                "such configs are launched, those requests count as rejected_for_length"] if lost else []
    why = plan.context_too_short(cfg.workload, short[-1])[1]
    if len(short) == len(contexts) and contexts:
        return [f"workload   PROBLEM: the longest {name} of the space, {max(contexts):,}, is below "
                f"{why}: every config would be refused for length; shorten the [workload] lengths "
                f"or search longer contexts"]
    return [f"workload   {name} {short[-1]:,}{' and below' if len(short) > 1 else ''} is below {why}: "
            f"such configs are skipped without a launch"]


def _doctor_pins(cfg, platform) -> tuple[str, ...]:
    """The flags a memory budget pins on every launch (search/study.py budget_pins); none when
    the budget cannot be read, which doctor's budget line reports on its own."""
    from tuner.search.study import budget_pins

    try:
        return budget_pins(cfg, platform)
    except TunerError:
        return ()


def doctor_budget_lines(cfg, platform) -> list[str]:
    """Under a memory budget, the flags each launch adds so that the engine picks what it would on
    a card of the budget's size (search/study.py budget_pins)."""
    pins = _doctor_pins(cfg, platform)
    if not pins:
        return []
    from tuner.engines.vllm_defaults import batch_defaults

    here = batch_defaults(platform.kind, platform.memory_total_bytes, platform.device_name)
    return [f"budget     launches add {' '.join(pins)}: vLLM's batch defaults on a "
            f"{cfg.memory_budget_gib:g} GiB card (this one's: {here[0]} batched tokens, {here[1]} "
            "sequences); the exported command carries them"]


def doctor_fit_lines(cfg, platform, model: str | None, extra_args=()) -> list[str]:
    """What the memory model predicts before any launch: per max-model-len of the space, the KV
    cache at the most memory the space gives it (top gmu and cpu-offload, fewest sequences, the
    fixed flags), how many requests of that length it holds, and whether vLLM would start; then
    the longest context that starts. Uncalibrated: the study's first launches correct it."""
    from tuner import engines
    from tuner.config import fixed_flag_values
    from tuner.search import space
    from tuner.search import feasibility
    from tuner.search.feasibility import kv_dtype_bytes
    from tuner.search.study import memory_scale

    if not model or not os.path.isdir(model):
        return []
    try:
        mm = engines.get(cfg.engine_name).memory_model(model, platform.memory_total_bytes,
                                                       platform.kind, extra_args, platform.device_name)
        scale = memory_scale(cfg, platform)
    except TunerError as e:
        return [f"fits       PROBLEM: {e}"]
    except (OSError, ValueError, KeyError):
        return []
    if mm is None:
        return []
    dims = {d.name: d for d in cfg.dimensions}

    def top(name, smallest=False):
        d = dims.get(name)
        return None if d is None else d.extreme(smallest)
    pins = _doctor_pins(cfg, platform)
    values = {k: v for k, v in fixed_flag_values((*cfg.extra_args, *pins), cfg.source).items()}
    for name, smallest in (("gpu_memory_utilization", False), ("cpu_offload_gb", False),
                           ("max_num_seqs", True), ("max_num_batched_tokens", True)):
        if top(name, smallest) is not None:
            values[name] = top(name, smallest)
    if (d := dims.get("kv_cache_dtype")) is not None and d.choices:   # the fewest bytes a token
        values["kv_cache_dtype"] = min(d.choices, key=lambda c: kv_dtype_bytes(c, 2))
    d = dims.get("max_model_len")
    lengths = sorted(d.choices or {int(d.low), int(d.high)}) if d else [values.get("max_model_len")]
    base = space.params_from({k: v for k, v in values.items() if k != "max_model_len"})
    at = [f"gmu {base.gpu_memory_utilization if base.gpu_memory_utilization is not None else 'default'}"
          + (f" of {cfg.memory_budget_gib:g} GiB" if cfg.memory_budget_gib else "")
          + (" (a ballast holds the rest of the card)" if cfg.memory_budget_gib
             and cfg.memory_budget_mode == "ballast" else "")]
    if base.cpu_offload_gb:
        at.append(f"cpu-offload {base.cpu_offload_gb:g} GiB")
    if base.max_num_seqs:
        at.append(f"max-num-seqs {base.max_num_seqs}")
    if base.kv_cache_dtype not in (None, "auto"):
        at.append(f"kv-cache-dtype {base.kv_cache_dtype}")
    lines = [f"fits       predicted before any launch (the first launches calibrate it), at the most "
             f"KV memory the space gives: {', '.join(at)}"]
    longest = pred = None
    for length in lengths:
        params = space.scaled(dataclasses.replace(base, max_model_len=length), scale)
        pred = mm.predict(params)
        longest = pred.max_model_len_fit
        verdict = "starts" if pred.fits else "does not start"
        lines.append(f"           max-model-len {pred.max_model_len}: KV cache ~{pred.kv_cache_tokens:,} "
                     f"tokens, {_count(pred.max_concurrency)} requests of that length at once; "
                     f"{verdict}{' (uncertain)' if pred.uncertain else ''}")
    # Nothing starts, and by more than the model's margin of error: doctor exits 1 before the user
    # spends a launch on it (within the margin, uncalibrated, it is a line, not a problem).
    clearly_none = longest is not None and longest <= 0 and pred.kv_budget_gib < -pred.band_gib
    too_big = feasibility.weights_exceed_device(mm, base.cpu_offload_gb, cfg.memory_budget_gib)
    if too_big:   # what `run` refuses: no share of the device holds the weights
        lines.append(f"           PROBLEM: no config of the space can start: {too_big}")
    elif clearly_none:
        lines.append(f"           PROBLEM: no context of the space starts: longest ~0 tokens "
                     f"({_nothing_starts_hint(pred, platform.kind, dims)})")
    elif longest is not None:
        lines.append(f"           longest context that starts: ~{max(0, longest):,} tokens"
                     + ("" if longest > 0 else f" ({_nothing_starts_hint(pred, platform.kind, dims)})"))
    req = cfg.requirement
    if req.context_tokens and req.sequences_at_context:
        # the KV cache at the most memory the space gives, with the shortest context that serves it
        serving = [n for n in lengths if n is None or n >= req.context_tokens]
        if not serving:
            lines.append(f"requirement PROBLEM: no max-model-len of the space reaches [requirement] "
                         f"context_tokens {req.context_tokens:,} (longest {max(lengths):,}, the "
                         "model's limit included)")
            return lines
        pred = mm.predict(space.scaled(dataclasses.replace(base, max_model_len=serving[0]), scale))
        need = req.sequences_at_context * req.context_tokens
        held = pred.kv_cache_tokens / req.context_tokens
        said = (f"{req.sequences_at_context} requests of {req.context_tokens:,} tokens at once need "
                f"~{need:,} KV tokens; the space gives at most ~{pred.kv_cache_tokens:,} ({_count(held)} at once)"
                + (" (uncertain)" if pred.uncertain else ""))
        if pred.kv_cache_tokens >= need:
            lines.append(f"requirement {said}: met")
        else:
            lines.append(f"requirement PROBLEM: {said}: no config of the space meets [requirement]; "
                         "raise the budget or gmu's top, or ask for fewer sequences or a shorter context")
    return lines


def _count(x: float) -> str:
    """A number of requests: a fraction matters below ten (0.8: not even one at full length);
    above, whole requests (250.7 is 250 at once, not 251)."""
    if x < 10:   # floored: 0.99 is not one request
        # rounded first: 0.29 * 100 is 28.999999999999996 in binary
        return (f"{math.floor(round(x * 10, 6)) / 10:.1f}" if x >= 1
                else f"{math.floor(round(x * 100, 6)) / 100:.2f}")
    return f"{int(x):,}"


def _nothing_starts_hint(pred, platform_kind: str, dims) -> str:
    """What to change when no context starts, from what fills the share: where the weights alone
    outgrow it, more gmu cannot help, so name what can (offloading weights on a GPU, a bigger
    budget or card); else the weights and the runtime's other use, and room to raise gmu."""
    from tuner.search.feasibility import GIB

    offload = " or cpu-offload" if "cpu_offload_gb" in dims else ""
    terms = pred.terms
    if terms is None:
        return "nothing starts: raise gmu" + offload
    share = pred.overhead_gib + pred.kv_budget_gib
    weights, other = terms.weights / GIB, pred.overhead_gib - terms.weights / GIB
    if weights < share:
        return (f"nothing starts: the weights on the device, ~{weights:.1f} GiB, and ~{other:.1f} GiB of "
                f"other non-KV use fill the {share:.1f} GiB share; raise gmu{offload} or the budget")
    said = f"nothing starts: the weights on the device, ~{weights:.1f} GiB, fill the {share:.1f} GiB share"
    if platform_kind == "cpu":
        return f"{said}; the CPU build holds every weight in that memory, so only a larger share or budget helps"
    if "cpu_offload_gb" in dims:
        return f"{said}; search more cpu_offload_gb or a larger budget"
    return f"{said}; add cpu_offload_gb to [space] or use a larger card or budget"


def doctor_gpu_lines(cfg, platform, model: str | None, extra_args) -> list[str]:
    """Which GPUs the server will see (CUDA_VISIBLE_DEVICES mapped to NVML), what strangers hold
    on them, and the dtype the model runs with there."""
    from tuner.run import devices
    from tuner.config import read_model_configs

    v = devices.visibility(cfg.env)
    lines = []
    if v.setting is not None:
        shown = ", ".join(d.label for d in v.devices) or "none"
        lines.append(f"CUDA       CUDA_VISIBLE_DEVICES={v.setting!r} ({v.source}): visible {shown}"
                     + (f"; hidden {', '.join(d.label for d in v.hidden)}" if v.hidden else ""))
    if v.note:
        lines.append(f"CUDA       NOTE: {v.note}")
    for d in v.devices:
        bw = f", ~{d.memory_bandwidth_gbps:.0f} GB/s" if d.memory_bandwidth_gbps else ""
        cc = f", compute {d.compute_capability[0]}.{d.compute_capability[1]}" if d.compute_capability else ""
        role = " (vLLM's device)" if d.cuda_index == 0 else ""
        lines.append(f"{d.label:<10} cuda:{d.cuda_index}{role} {d.name}: "
                     f"{d.memory_total_bytes / 2**30:.1f} GiB total, "
                     f"{d.memory_free_bytes / 2**30:.1f} GiB free{bw}{cc}")
        holders = devices.gpu_processes(d)
        if holders:
            held = sum(p.used_bytes for p in holders) / 2**30
            lines.append(f"           strangers hold {held:.1f} GiB (no trial server is running now):")
        for p in holders:
            lines.append(f"           pid {p.pid} ({p.used_bytes / 2**30:.1f} GiB): "
                         f"{p.cmdline[:80] or '(not in this PID namespace)'}")
    if not v.devices:
        why = ("CUDA_VISIBLE_DEVICES hides every GPU" if v.setting is not None and (v.hidden or v.note)
               else "none seen by NVML")
        lines.append(f"GPU        {why}: trials use vLLM's CPU build "
                     f"({platform.memory_total_bytes / 2**30:.1f} GiB for the KV cache and model)")
    found = read_model_configs(model) if model else None
    if found is not None:
        choice = devices.supported_dtype(v.devices[0] if v.devices else None, found[0], extra_args)
        lines.append(f"dtype      {choice.dtype or 'auto'}: {choice.reason}")
        problem = devices.quantization_problem(v.devices[0] if v.devices else None, found[0], extra_args)
        if problem:
            lines.append(f"quantize   PROBLEM: {problem}")
    return lines
