"""The command line end to end, in real processes, against the fake OpenAI server as the engine."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time

import pandas as pd
import pytest

from faultkit import REPO, fake_engine_study, private_model, write_study

COMMANDS = ("run", "report", "show", "export", "measure", "doctor", "compare")


def tuner(*args, cwd, timeout=180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tuner", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_every_command_has_quick_help_with_examples(command, tmp_path):
    args = ["--help"] if command is None else [command, "--help"]
    t0 = time.monotonic()
    done = tuner(*args, cwd=tmp_path)
    assert done.returncode == 0
    assert "examples:" in done.stdout and "python -m tuner" in done.stdout
    # instant: heavy modules (optuna, aiohttp, matplotlib, vllm) are not imported for --help
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "tuner", *args], cwd=tmp_path,
                         capture_output=True, text=True, env={"PYTHONPATH": str(REPO)})
    heavy = [m for m in ("optuna", "aiohttp", "matplotlib", "vllm", "pandas")
             if f" {m}\n" in out.stderr or f"| {m}\n" in out.stderr]
    assert heavy == [], heavy
    assert time.monotonic() - t0 < 30


@pytest.fixture(scope="module")
def study_run(tmp_path_factory):
    """One short study of 4 launches on the fake engine, through `python -m tuner run`."""
    work = tmp_path_factory.mktemp("cli")
    model = private_model(work)
    study = write_study(work, fake_engine_study(model, name="cli"))
    done = tuner("run", "--study", str(study), "--trials", "4", "--quiet", cwd=work)
    assert done.returncode == 0, done.stderr[-3000:]
    return work, study, done


def test_run_leaves_results_and_prints_the_best_command(study_run):
    work, study, done = study_run
    folder = work / "results" / "cli"
    for name in ("trials.csv", "pareto.csv", "pareto.png", "parameters.png", "best-command.sh",
                 "study.json", "contexts.csv"):
        assert (folder / name).stat().st_size > 0, name
    assert (work / "studies" / "cli.db").exists()
    df = pd.read_csv(folder / "trials.csv")
    assert len(df) == 4 and set(df["state"]) == {"COMPLETE"}
    assert (folder / "trials" / "0" / "server.log").read_text()
    # stdout is exactly one shell line: the command a script would pipe
    lines = done.stdout.strip().splitlines()
    # (after the study's [server] env settings, which the trials ran with)
    argv = shlex.split(lines[0]) if len(lines) == 1 else []
    assert argv[:3] == ["FAKE_MODE=ok", "vllm", "serve"], lines
    assert "Pareto set" in done.stderr and "launch 4/4" in done.stderr
    # the summary says the longest context served, as contexts.csv has it
    contexts = pd.read_csv(folder / "contexts.csv")
    longest = int(contexts.loc[contexts["served"] > 0, "context"].max())
    assert f"longest max_model_len served: {longest:,} tokens (trial " in done.stderr
    # the phases the fake server logs (tests/fake_openai_server.py PHASE_LINES), per trial
    assert (df["launch_weights_s"] == 0.01).all() and (df["launch_compile_s"] == 0.02).all()
    assert (df["launch_graphs_s"] == 0.0).all() and (df["launch_profile_s"] == 0.03).all()
    assert (df["launch_warmup_s"] == 0.0).all()   # its graph and init lines share a second
    phases = df[["launch_weights_s", "launch_compile_s", "launch_graphs_s", "launch_profile_s",
                 "launch_warmup_s", "launch_other_s"]].sum(axis=1)
    assert phases.to_numpy() == pytest.approx(df["launch_s"].to_numpy(), abs=0.02)
    assert (df["launch_other_s"] > 0).all()


def test_show_export_report_read_the_storage_without_launching(study_run):
    work, study, _ = study_run
    shown = tuner("show", "--study", str(study), cwd=work)
    assert shown.returncode == 0 and "Pareto set: trial" in shown.stdout
    assert "launch: median" in shown.stdout and "(median phases: weights 0.0 s, compile 0.0 s" in shown.stdout
    exported = tuner("export", "--study", str(study), "--prefer", "throughput", "--json", cwd=work)
    assert exported.returncode == 0
    params = json.loads(exported.stdout)
    front = pd.read_csv(work / "results" / "cli" / "pareto.csv")
    best = front["throughput_tok_s"].max()
    if params["throughput_tok_s"] != pytest.approx(best):
        # a member within the noise of the best that changes fewer of vLLM's defaults is exported
        # instead, and the export says which members tie
        pick = int(front.loc[front["throughput_tok_s"].idxmax(), "trial"])
        assert (f"the throughput pick, trial {pick}, ties within the noise on every objective with"
                in exported.stderr), exported.stderr
        assert any(params["throughput_tok_s"] == pytest.approx(v) for v in front["throughput_tok_s"])
    (work / "results" / "cli" / "pareto.png").unlink()
    reported = tuner("report", "--study", str(study), cwd=work)
    assert reported.returncode == 0 and (work / "results" / "cli" / "pareto.png").exists()


def test_a_second_run_with_the_same_count_launches_nothing(study_run):
    work, study, _ = study_run
    again = tuner("run", "--study", str(study), "--trials", "4", "--quiet", cwd=work)
    assert again.returncode == 0
    assert "already holds 4 launched trials" in again.stderr
    assert not (work / "results" / "cli" / "trials" / "4").exists()


def test_measure_prints_one_json_object(study_run):
    work, study, _ = study_run
    done = tuner("measure", "--study", str(study), "--gpu-memory-utilization", "0.5",
                 "--max-model-len", "1024", "--max-num-seqs", "2", cwd=work)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    assert out["failure"] == "" and out["max_num_seqs"] == 2
    assert out["single_stream_tok_s"] > 0 and out["throughput_tok_s"] > 0
    assert "--max-num-seqs 2" in out["command"]


def test_doctor_fits_one_screen(study_run):
    work, study, _ = study_run
    done = tuner("doctor", "--study", str(study), cwd=work)
    assert done.returncode == 0
    lines = done.stdout.splitlines()
    assert len(lines) <= 24
    text = done.stdout
    assert "engine" in text and "storage" in text and "results" in text
    assert "GPU" in text  # a GPU line, or the CPU-build line when NVML sees none


def test_doctor_says_which_contexts_start_before_any_launch():
    from tuner.cli import doctor_fit_lines
    from tuner.config import parse_study
    from tuner.models.presets import preset_folder
    from tuner.search.study import Platform

    v100 = Platform("cuda", "Tesla V100-SXM2-16GB", int(15.77 * 2**30), 900.0, ("true",), "0.24.0")

    def fits(model: str, offload: list[float] | None, **server) -> str:
        space = {"gpu_memory_utilization": {"low": 0.8, "high": 0.92, "step": 0.01},
                 "max_model_len": {"choices": [4096, 32768]}, "max_num_seqs": {"choices": [8, 1]}}
        if offload is not None:
            space["cpu_offload_gb"] = {"choices": offload}
        cfg = parse_study({"model": {"path": f"preset:{model}"}, "server": server, "space": space},
                          "s.toml", {})
        return "\n".join(doctor_fit_lines(cfg, v100, str(preset_folder(model))))

    # the seed's 32B AWQ: its 18.0 GiB of weights leave nothing on a 16 GB card without offload
    text = fits("qwen2.5-32b-awq", None)
    assert "gmu 0.92, max-num-seqs 1" in text
    per_length = [ln for ln in text.splitlines() if "max-model-len " in ln]
    assert len(per_length) == 2 and all("does not start" in ln for ln in per_length)
    assert "max-model-len 4096: KV cache ~0 tokens" in text
    # a problem, so `doctor` exits 1 (it counts lines with " PROBLEM: "), and the one `run`
    # refuses with: the weights alone outgrow the whole card, so more gmu cannot help
    assert ("PROBLEM: no config of the space can start: the weights alone, ~18.0 GiB, exceed the "
            "device's 15.8 GiB: offload (--cpu-offload-gb) or use a smaller or quantized model") in text
    assert "raise gmu" not in text
    # with up to 8 GiB offloaded a 4k context starts and a 32k one does not
    text = fits("qwen2.5-32b-awq", [0, 8])
    assert "cpu-offload 8 GiB" in text and "PROBLEM" not in text
    line = {ln.split(":")[0].strip(): ln for ln in text.splitlines()[1:]}
    assert line["max-model-len 4096"].endswith(("starts", "starts (uncertain)"))
    assert "does not start" in line["max-model-len 32768"]
    longest = int(text.rsplit("~", 1)[1].split()[0].replace(",", ""))
    assert 4096 <= longest < 32768
    # on the CPU build offloading moves nothing: only a larger share helps
    # (a 19 GiB host: the AWQ's ~18.0 GiB of weights fit it, not the 0.9 share of it)
    cpu = Platform("cpu", "", 19 * 2**30, None, (), "0.32.0")
    cfg = parse_study({"model": {"path": "preset:qwen2.5-32b-awq"},
                       "space": {"gpu_memory_utilization": {"choices": [0.9]},
                                 "max_model_len": {"choices": [4096]},
                                 "max_num_seqs": {"choices": [1]},
                                 "cpu_offload_gb": {"choices": [8]}}}, "s.toml", {})
    text = "\n".join(doctor_fit_lines(cfg, cpu, str(preset_folder("qwen2.5-32b-awq"))))
    assert "the CPU build holds every weight in that memory" in text and "raise gmu" not in text
    # the weights fit but the runtime's other use leaves no KV memory: both figures are named
    cpu = Platform("cpu", "", 16 * 2**30, None, (), "0.32.0")
    cfg = parse_study({"model": {"path": "preset:llama-3.1-8b"},
                       "space": {"gpu_memory_utilization": {"choices": [0.95]},
                                 "max_model_len": {"choices": [4096]},
                                 "max_num_seqs": {"choices": [1]}}}, "s.toml", {})
    text = "\n".join(doctor_fit_lines(cfg, cpu, str(preset_folder("llama-3.1-8b"))))
    assert "the weights on the device, ~15.0 GiB, and ~" in text and "raise gmu or the budget" in text
    # a budget: gmu is a share of it, and the lines say so
    budget = Platform("cuda", "NVIDIA H200", 140 * 2**30, 4800.0, ("true",), "0.24.0")
    cfg = parse_study({"model": {"path": "preset:llama-3.2-3b"}, "server": {"memory_budget_gib": 15.77},
                       "space": {"gpu_memory_utilization": {"choices": [0.95]},
                                 "max_model_len": {"choices": [131072]},
                                 "max_num_seqs": {"choices": [4]}}}, "s.toml", {})
    text = "\n".join(doctor_fit_lines(cfg, budget, str(preset_folder("llama-3.2-3b"))))
    assert "of 15.77 GiB" in text and "max-model-len 131072" in text and "does not start" in text


def test_doctor_says_before_any_launch_when_no_config_can_meet_the_requirement():
    # the 8B shape on a 24 GB card: 15 GiB of bf16 weights leave ~6-7 GiB of KV cache, about
    # 3.4 requests of 16k at once, so "4 at once" is out of reach whatever the tuner launches
    from tuner.cli import doctor_fit_lines
    from tuner.config import parse_study
    from tuner.models.presets import preset_folder
    from tuner.search.study import Platform

    h100 = Platform("cuda", "NVIDIA H100 80GB HBM3", int(79.6 * 2**30), 3352.0, ("true",), "0.24.0")

    def lines(sequences: int, **more_space) -> list[str]:
        cfg = parse_study({"model": {"path": "preset:llama-3.1-8b"}, "server": {"memory_budget_gib": 24},
                           "space": {"gpu_memory_utilization": {"low": 0.6, "high": 0.95, "step": 0.01},
                                     "max_model_len": {"choices": [8192, 16384, 32768]},
                                     "max_num_seqs": {"choices": [4, 64]}, **more_space},
                           "requirement": {"context_tokens": 16384, "sequences_at_context": sequences}},
                          "s.toml", {})
        return doctor_fit_lines(cfg, h100, str(preset_folder("llama-3.1-8b")))

    # a requirement above every context the space keeps (the model's limit cut it): a PROBLEM,
    # not "met" for the longest context there is
    import dataclasses
    cfg = parse_study({"model": {"path": "preset:llama-3.1-8b"},
                       "space": {"gpu_memory_utilization": {"low": 0.6, "high": 0.95, "step": 0.01},
                                 "max_model_len": {"choices": [8192, 16384]},
                                 "max_num_seqs": {"choices": [4]}},
                       "requirement": {"context_tokens": 8192, "sequences_at_context": 1}}, "s.toml", {})
    cfg = dataclasses.replace(cfg, requirement=dataclasses.replace(cfg.requirement, context_tokens=65536))
    above = [ln for ln in doctor_fit_lines(cfg, h100, str(preset_folder("llama-3.1-8b")))
             if ln.startswith("requirement")]
    assert len(above) == 1 and "PROBLEM: no max-model-len of the space reaches" in above[0], above
    req = [ln for ln in lines(4) if ln.startswith("requirement")]
    assert len(req) == 1 and "PROBLEM" in req[0], req
    assert "4 requests of 16,384 tokens at once need ~65,536 KV tokens" in req[0]
    held = float(req[0].split("(")[1].split()[0])
    assert 3.0 < held < 4.0     # measured on an H100: 46,000 tokens at gmu 0.92 (2.8 at once)
    req = [ln for ln in lines(2) if ln.startswith("requirement")]
    assert len(req) == 1 and req[0].endswith(": met") and "PROBLEM" not in req[0]
    # an fp8 KV cache in the space halves a token's bytes: then 4 at once fit, and doctor says so
    text = lines(4, kv_cache_dtype={"choices": ["auto", "fp8"]})
    assert "kv-cache-dtype fp8" in text[0]
    req = [ln for ln in text if ln.startswith("requirement")]
    assert len(req) == 1 and req[0].endswith(": met"), req
    assert 6.0 < float(req[0].split("(")[1].split()[0]) < 8.0


def test_doctor_checks_a_new_sqlite_storage_without_creating_it(tmp_path):
    from tuner.errors import TunerError
    from tuner.search.storage import check_storage

    db = tmp_path / "studies" / "new.db"
    assert check_storage(f"sqlite:///{db}") == "ok (the first run creates it)"
    assert not db.exists() and not db.parent.exists()     # nothing created, not even the folder
    with pytest.raises(TunerError, match="cannot be created: /sys is not writable"):
        check_storage("sqlite:////sys/tuner/x.db")
    # an existing database is opened, as `run` will
    import optuna
    optuna.create_study(storage=f"sqlite:///{tmp_path / 'old.db'}", study_name="s")
    assert check_storage(f"sqlite:///{tmp_path / 'old.db'}") == "ok"


def test_doctor_lists_only_the_contexts_the_study_searches(tmp_path):
    # the gpu study's space reaches 131072; the 32B preset's limit is 32768, so the run searches up
    # to 32768 only (one warning), and doctor's per-context lines must show that space, not the file's
    done = tuner("doctor", "--study", "gpu", "--model", "preset:qwen2.5-32b-awq",
                 "--memory-budget-gib", "16", "--storage", f"sqlite:///{tmp_path}/d.db",
                 "--results", str(tmp_path / "results"), cwd=REPO)
    lengths = [int(ln.split("max-model-len ")[1].split(":")[0]) for ln in done.stdout.splitlines()
               if "max-model-len " in ln and "KV cache" in ln]
    assert lengths and max(lengths) == 32768, done.stdout
    assert done.stderr.count("exceed the model's limit 32768") == 1, done.stderr


def test_doctor_says_when_the_space_s_contexts_cannot_hold_the_workload_s_requests():
    # every request of 60,000 + 32 tokens is over each context of the space: a PROBLEM (exit 1);
    # 2,000 + 32 is over the shortest only: one line, those configs skipped without a launch
    from tuner.cli import doctor_workload_lines
    from tuner.config import parse_study

    def lines(prompt: int, **space) -> list[str]:
        cfg = parse_study({"model": {"path": "preset:tiny"},
                           "space": {"gpu_memory_utilization": {"low": 0.04, "high": 0.2, "step": 0.01},
                                     "max_model_len": {"choices": [1024, 2048, 4096, 32768]},
                                     "max_num_seqs": {"choices": [1, 32]}, **space},
                           "workload": {"prompt_tokens": prompt, "output_tokens": 32}}, "s.toml", {})
        return doctor_workload_lines(cfg)

    none = lines(60000)
    assert len(none) == 1 and "PROBLEM" in none[0] and "32,768" in none[0], none
    assert "60000 + 32 tokens per request" in none[0]
    some = lines(2000)
    assert len(some) == 1 and "PROBLEM" not in some[0], some
    assert "max_model_len 1,024 is below" in some[0] and "skipped without a launch" in some[0]
    some = lines(3000)
    assert "max_model_len 2,048 and below" in some[0], some
    assert lines(500) == []
    # a uniform mix whose longest requests exceed the shortest context by a few: within the
    # tolerance (max_failed_share), so launched, and doctor says how many it loses
    from tuner.load import plan
    mixed = parse_study({"model": {"path": "preset:tiny"},
                         "space": {"gpu_memory_utilization": {"low": 0.04, "high": 0.2, "step": 0.01},
                                   "max_model_len": {"choices": [1024, 4096]},
                                   "max_num_seqs": {"choices": [1, 32]}},
                         "workload": {"prompt_tokens": 64, "output_tokens": 32, "length_mix": "uniform",
                                      "prompt_tokens_mix": [100, 1010], "output_tokens_mix": [16, 32],
                                      "max_failed_share": 0.2}}, "s.toml", {})
    lost = plan.share_too_long(mixed.workload, 1024)
    said = doctor_workload_lines(mixed)
    assert 0 < lost <= 0.2, lost      # the mix is seeded: the same lengths every time
    assert len(said) == 1 and "max_model_len 1,024 refuses up to 2% of a level's requests" in said[0], said
    assert "rejected_for_length" in said[0]


def test_run_refuses_a_model_whose_weights_outgrow_the_whole_device(tmp_path):
    # 131 GiB of 70B weights on this host (or under a 16 GiB budget): no share of it can hold them
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    for extra in ([], ["--memory-budget-gib", "16"]):
        p = subprocess.run([sys.executable, "-m", "tuner", "run", "--study", "gpu", "--model",
                            "preset:llama-3.1-70b", "--trials", "1", "--engine", "/bin/false",
                            "--storage", f"sqlite:///{tmp_path}/s.db", "--results", str(tmp_path / "r"),
                            *extra], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert p.returncode == 2, p.stderr
        last = p.stderr.strip().splitlines()[-1]
        assert last.startswith("tuner: error: no config of the space can start: the weights alone, "
                               "~131.4 GiB, exceed")
        assert not (tmp_path / "r").exists() and not (tmp_path / "s.db").exists()


def test_request_counts_are_floored_so_a_fraction_never_reads_as_a_whole_request():
    from tuner.cli import _count

    assert _count(0.99) == "0.99" and _count(0.5) == "0.50"
    assert _count(1.0) == "1.0" and _count(9.99) == "9.9" and _count(250.7) == "250"
    assert _count(0.29) == "0.29" and _count(0.57) == "0.57" and _count(4.35) == "4.3"


def test_doctor_does_not_claim_the_model_limit_checked_when_config_json_is_broken(tmp_path):
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "config.json").write_text('{"hidden_size": 256,\n}')
    p = subprocess.run([sys.executable, "-m", "tuner", "doctor", "--model", str(folder),
                        "--storage", f"sqlite:///{tmp_path}/s.db", "--results", str(tmp_path / "r")],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stderr
    assert "fits       PROBLEM" in p.stdout and "not valid JSON" in p.stdout
    assert "the model's limit unchecked (its config.json cannot be read)" in p.stdout


def test_export_of_a_study_with_nothing_feasible_says_why(tmp_path):
    # every launch crashed: "run more trials" alone would send the user to fail the same way
    import faultkit as fk

    model = private_model(tmp_path)
    doc = fake_engine_study(model, name="failing", engine=(sys.executable, str(fk.FAKE_VLLM)),
                            env={"FAKE_MODE": "fail", "FAKE_LOG": str(fk.LOGS / "crashed_unknown.log")})
    study = write_study(tmp_path, doc)
    assert tuner("run", "--study", str(study), "--trials", "2", "--quiet", cwd=tmp_path).returncode == 0
    p = tuner("export", "--study", str(study), cwd=tmp_path)
    assert p.returncode == 2
    last = p.stderr.strip().splitlines()[-1]
    assert "no feasible measured config yet (no trial has met every constraint (crashed 2)" in last
    assert "the last said:" in last
