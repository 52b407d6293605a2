"""Study logic against a fake device built from the real data types (fast, no vLLM)."""

from __future__ import annotations

import math

import os
import shlex

import optuna
import pandas as pd
import pytest
from optuna.trial import TrialState

from fakes import FAKE_PLATFORM, FakeDevice, RecordingTrial, fake_config
from tuner import noise as noise_module
from tuner.results import export, report
from tuner.search.storage import load_existing
from tuner.search.study import Platform, Tuner


def run(cfg, device, n):
    return Tuner(cfg, measure=device, platform=FAKE_PLATFORM, progress=False).run(n)


def test_run_writes_results_and_records_failures_as_constraint_violations(tmp_path):
    cfg = fake_config(tmp_path)
    device = FakeDevice()
    study = run(cfg, device, 10)

    assert len(device.launches) == 10
    folder = cfg.results_path
    for name in ("trials.csv", "pareto.csv", "pareto.png", "parameters.png", "best-command.sh"):
        assert (folder / name).stat().st_size > 0, name
    df = pd.read_csv(folder / "trials.csv")
    for col in ("trial", "state", "failure", "gpu_memory_utilization", "max_model_len",
                "max_num_seqs", "single_stream_tok_s", "throughput_tok_s", "ttft_ms", "pareto"):
        assert col in df.columns
    failed = [t for t in study.trials if t.user_attrs.get("failure") == "kv_cache_too_small"]
    for t in failed:  # a memory failure is a finished trial that violates the memory constraint
        assert t.state == TrialState.COMPLETE
        assert t.constraints["memory"] > 0
        assert t.user_attrs["estimated_max_model_len"] < t.params["max_model_len"]
    measured = [t for t in study.trials if not t.user_attrs.get("failure")]
    assert measured and all(t.constraints["memory"] == 0 for t in measured)
    pareto = pd.read_csv(folder / "pareto.csv")
    assert len(pareto) >= 1 and pareto["failure"].isna().all()


def test_a_failed_config_is_told_the_worst_measured_figures_not_placeholders(tmp_path):
    # the GP sampler standardises every told value: 0 tok/s and a 120 s TTFT for each failure
    # would squash the measured configs' differences into noise
    cfg = fake_config(tmp_path)
    study = run(cfg, FakeDevice(), 10)
    measured = [t for t in study.trials if t.state == TrialState.COMPLETE
                and not t.user_attrs.get("failure")]
    failed = [t for t in study.trials if t.state == TrialState.COMPLETE
              and t.user_attrs.get("failure") and t.number > min(m.number for m in measured)]
    assert measured and failed
    for t in failed:
        before = [m.values for m in measured if m.number < t.number]
        assert t.values[0] == min(v[0] for v in before) > 0
        assert t.values[1] == min(v[1] for v in before) > 0
        assert t.values[2] == max(v[2] for v in before) < cfg.workload.request_timeout_s * 1000


def test_baselines_come_first_snapped_into_the_space(tmp_path):
    cfg = fake_config(tmp_path)
    study = run(cfg, FakeDevice(), 2)
    first, second = study.trials[0], study.trials[1]
    assert first.user_attrs["baseline"] == "vllm-defaults"
    # the tiny model allows 32768, halfway (in log) between 16384 and 65536: the lower is kept
    assert first.params == {"gpu_memory_utilization": 0.9, "max_model_len": 16384,
                            "max_num_seqs": 64}
    assert second.user_attrs["baseline"] == "hand-tuned"
    assert second.params == {"gpu_memory_utilization": 0.9, "max_model_len": 4096,
                             "max_num_seqs": 4}


def test_resume_reaches_the_requested_count_without_losing_trials(tmp_path):
    cfg = fake_config(tmp_path)
    run(cfg, FakeDevice(), 4)
    before = {t.number: t.values for t in load_existing(cfg).trials}
    device = FakeDevice()
    study = run(cfg, device, 7)
    assert len(device.launches) == 3
    assert {t.number: t.values for t in study.trials if t.number in before} == before
    launched = [t for t in study.trials if t.state == TrialState.COMPLETE
                and t.user_attrs.get("failure") != "duplicate"]
    assert len(launched) == 7


def test_a_resumed_seeded_study_proposes_new_configs_not_the_first_runs_again(tmp_path):
    # with the first run's seed, the resumed random sampler drew the first run's configs again
    # (6 duplicates in 13 proposals here): no launch each, but 20 in a row stop the run as if the
    # space were exhausted. (TPE past its 5 random startup draws conditions on the history.)
    sampler = "random"
    cfg = fake_config(tmp_path, sampler=sampler, seed=3)
    first = run(cfg, FakeDevice(), 7)
    n_first = len(first.trials)
    study = run(cfg, FakeDevice(), 14)
    resumed = [t for t in study.trials if t.number >= n_first]
    assert resumed and not [t.number for t in resumed if t.user_attrs.get("failure") == "duplicate"]
    # and the resumed draws are still fixed by the seed: the same study resumed the same way
    # proposes the same configs
    other = fake_config(tmp_path / "again", sampler=sampler, seed=3)
    run(other, FakeDevice(), 7)
    again = run(other, FakeDevice(), 14)
    assert [t.params for t in again.trials] == [t.params for t in study.trials]


def test_a_resumed_study_refuses_another_load_and_tolerates_a_longer_timeout(tmp_path):
    from dataclasses import replace

    from tuner.errors import TunerError

    cfg = fake_config(tmp_path)
    run(cfg, FakeDevice(), 2)
    # the offered load changed: no new trial may face it beside the old ones
    for changed in ({"closed_loop_start": "staggered"}, {"prompt_tokens": cfg.workload.prompt_tokens * 2},
                    {"levels": (2, 8)}):
        device = FakeDevice()
        with pytest.raises(TunerError) as err:
            run(replace(cfg, workload=replace(cfg.workload, **changed)), device, 4)
        key = next(iter(changed))
        assert f"{key}: " in str(err.value) and "--name" in str(err.value)
        assert device.launches == []
    # how long the client waits is not the load: the study goes on
    device = FakeDevice()
    run(replace(cfg, workload=replace(cfg.workload, request_timeout_s=999.0)), device, 4)
    assert len(device.launches) == 2
    # a study that launched nothing yet takes the new workload
    fresh = fake_config(tmp_path / "fresh")
    (tmp_path / "fresh").mkdir()
    Tuner(fresh, measure=FakeDevice(), platform=FAKE_PLATFORM, progress=False).open()
    run(replace(fresh, workload=replace(fresh.workload, closed_loop_start="staggered")), FakeDevice(), 1)
    assert load_existing(fresh).user_attrs["config"]["workload"]["closed_loop_start"] == "staggered"


def test_a_resumed_study_refuses_another_model_other_fixed_flags_or_other_choices(tmp_path):
    from dataclasses import replace

    from tuner.errors import TunerError

    cfg = fake_config(tmp_path)
    run(cfg, FakeDevice(), 2)
    dims = {d.name: d for d in cfg.dimensions}
    seqs = dims["max_num_seqs"]
    assert seqs.choices
    other_choices = tuple(d if d.name != "max_num_seqs" else replace(seqs, choices=(*seqs.choices, 999))
                          for d in cfg.dimensions)
    assert cfg.model == "preset:tiny"
    another = "preset:llama-3.1-8b"
    for changed, words in (({"extra_args": ("--dtype", "float32")}, "extra_args: "),
                           ({"model": str(another)}, "model: "),
                           ({"dimensions": other_choices}, "max_num_seqs: ")):
        device = FakeDevice()
        with pytest.raises(TunerError) as err:   # before: an Optuna ValueError, a half-asked trial
            run(replace(cfg, **changed), device, 4)
        assert words in str(err.value) and "--name" in str(err.value), str(err.value)
        assert device.launches == []
    # a range may move (Optuna takes a float or int range that changed): the study goes on
    gmu = dims["gpu_memory_utilization"]
    assert not gmu.choices
    wider = tuple(d if d.name != gmu.name else replace(gmu, low=gmu.low / 2) for d in cfg.dimensions)
    device = FakeDevice()
    run(replace(cfg, dimensions=wider), device, 3)
    assert len(device.launches) == 1


def test_read_commands_judge_the_requirement_the_study_file_has_now(tmp_path):
    # a stricter [requirement] after the run: show / export / report never offer a config below it
    from tuner.records import Requirement

    cfg = fake_config(tmp_path)
    study = run(cfg, FakeDevice(), 8)
    before = report.trials_frame(study)
    measured = before[before["feasible"]]
    short = int(measured["max_model_len"].min())
    assert short < int(measured["max_model_len"].max())
    after = report.trials_frame(study, requirement=Requirement(context_tokens=short + 1))
    below = after[after["max_model_len"] <= short]
    assert len(below) and not below["feasible"].any() and not below["pareto"].any()
    assert set(below[below["state"] == "COMPLETE"]["failure"]) >= {"requirement_not_met"}
    kept = after[(after["max_model_len"] > short) & after["trial"].isin(measured["trial"])]
    assert kept["feasible"].all() and after["pareto"].any()
    front, _ = export.offered_front(after)
    assert (front["max_model_len"] > short).all()


def test_interrupted_trial_is_failed_and_its_config_measured_on_resume(tmp_path):
    cfg = fake_config(tmp_path)
    device = FakeDevice(interrupt_at=3)
    with pytest.raises(KeyboardInterrupt):
        run(cfg, device, 5)
    study = load_existing(cfg)
    interrupted = [t for t in study.trials if t.state == TrialState.FAIL]
    assert len(interrupted) == 1 and interrupted[0].user_attrs["failure"] == "interrupted"
    lost_params = interrupted[0].params

    device2 = FakeDevice()
    study = run(cfg, device2, 5)
    assert device2.launches[0] == device.launches[2]  # the interrupted config comes first
    completed = [t.params for t in study.trials if t.state == TrialState.COMPLETE
                 and t.user_attrs.get("failure") != "duplicate"]
    assert lost_params in completed and len(completed) == 5


def test_trial_left_running_by_a_killed_tuner_is_recovered(tmp_path):
    cfg = fake_config(tmp_path)
    run(cfg, FakeDevice(), 2)
    study = load_existing(cfg)
    # a config no baseline has: a random one could be the snapped hand-tuned baseline, whose retry
    # is then a duplicate, and the run launches one more config after it
    study.enqueue_trial({"gpu_memory_utilization": 0.5, "max_model_len": 16384, "max_num_seqs": 16})
    orphan = study.ask({"gpu_memory_utilization": optuna.distributions.FloatDistribution(0.1, 0.9, step=0.1),
                        "max_model_len": optuna.distributions.CategoricalDistribution([1024, 4096, 16384, 65536]),
                        "max_num_seqs": optuna.distributions.CategoricalDistribution([1, 4, 16, 64])})
    import socket
    orphan.set_user_attr("tuner_host", socket.gethostname())
    orphan.set_user_attr("tuner_pid", 2**22 + 12345)  # no such process
    params = dict(orphan.params)

    device = FakeDevice()
    study = run(cfg, device, 3)
    assert study.trials[orphan.number].state == TrialState.FAIL
    assert [t.params for t in study.trials if t.state == TrialState.COMPLETE][-1] == params


def test_never_launches_the_same_config_twice_and_stops_when_the_space_is_exhausted(tmp_path):
    cfg = fake_config(tmp_path, sampler="grid")
    cfg = cfg.__class__(**{**cfg.__dict__, "dimensions": tuple(
        d if d.name != "gpu_memory_utilization" else d.__class__(d.name, d.kind, choices=(0.5, 0.9))
        for d in cfg.dimensions)})
    cfg = cfg.__class__(**{**cfg.__dict__, "dimensions": tuple(
        d if d.name != "max_num_seqs" else d.__class__(d.name, d.kind, choices=(4,))
        for d in cfg.dimensions)})
    device = FakeDevice()
    run(cfg, device, 20)
    assert len(device.launches) == len(set(device.launches)) == 8  # 2 gmu x 4 lengths x 1


def test_a_failed_region_is_not_launched_again(tmp_path):
    # memory model off: the rule alone (more memory and a shorter context failed) keeps launches
    # out of the region a memory failure marked; what the sampler still proposes there is recorded
    # as predicted_infeasible without a launch
    cfg = fake_config(tmp_path, seed=3)
    device = FakeDevice()
    study = run(cfg, device, 30)
    failed = []
    skipped = 0
    for t in sorted(study.trials, key=lambda t: t.number):
        kind = t.user_attrs.get("failure", "")
        p = t.params
        if kind == "predicted_infeasible":
            skipped += 1
            assert any(f["gpu_memory_utilization"] >= p["gpu_memory_utilization"]
                       and f["max_model_len"] <= p["max_model_len"] for f in failed)
            assert t.constraints["memory"] > 0
            continue
        if t.state != TrialState.COMPLETE or kind == "duplicate":
            continue
        assert not any(f["gpu_memory_utilization"] >= p["gpu_memory_utilization"]
                       and f["max_model_len"] <= p["max_model_len"] for f in failed), t.number
        if kind == "kv_cache_too_small":
            failed.append(p)
    assert failed and len(device.launches) == 30


def test_ties_come_from_the_measured_launch_to_launch_noise():
    df = pd.DataFrame({
        "trial": [0, 1, 2], "state": ["COMPLETE"] * 3, "feasible": [True] * 3, "runs": [2, 1, 1],
        "single_stream_tok_s": [100.0, 99.0, 50.0], "throughput_tok_s": [1000.0, 1010.0, 900.0],
        "ttft_ms": [50.0, 50.5, 80.0]})
    # no noise measured: only the 2 % tolerance ties, and 0 and 1 are within it everywhere;
    # trial 2 is beaten everywhere
    assert list(report.pareto_mask(df, 0.02)) == [True, True, False]
    df.loc[1, "throughput_tok_s"] = 1060.0
    df.loc[1, "ttft_ms"] = 49.0
    df.loc[1, "single_stream_tok_s"] = 100.0
    assert list(report.pareto_mask(df, 0.02)) == [False, True, False]   # 1 beats 0 beyond 2 %
    # with 3 % launch-to-launch noise, 6 % on throughput is inside 2 standard errors: a tie again
    noise = {"throughput_tok_s": {"cv": 0.03, "dof": 4, "configs": 2}}
    assert list(report.pareto_mask(df, 0.02, noise)) == [True, True, False]
    # and a relaunch that failed takes a config off the front
    df["relaunch_failed"] = ["", "oom", ""]
    assert list(report.pareto_mask(df, 0.02, noise)) == [True, False, False]


def test_noise_is_the_pooled_coefficient_of_variation_of_repeated_configs():
    noise = noise_module.noise_estimate({"throughput_tok_s": [[90.0, 110.0], [190.0, 210.0]],
                                   "ttft_ms": []})
    cv = noise["throughput_tok_s"]
    # sample sd of (90, 110) is 14.14 on a mean of 100; of (190, 210) 14.14 on 200
    assert cv["dof"] == 2 and cv["configs"] == 2
    assert cv["cv"] == pytest.approx(((0.1414 ** 2 + 0.0707 ** 2) / 2) ** 0.5, rel=1e-3)
    assert "ttft_ms" not in noise


def test_replicates_measure_the_noise_and_the_front_uses_means(tmp_path):
    cfg = fake_config(tmp_path, replicates=2)
    device = FakeDevice(noise=0.05, seed=3)
    study = run(cfg, device, 6)
    baselines = [t for t in study.trials if t.user_attrs.get("baseline")]
    assert len(device.launches) == 6 + 2 * len(baselines)
    df = report.trials_frame(study)
    noise = df.attrs["noise"]
    assert set(noise) == {"single_stream_tok_s", "throughput_tok_s", "ttft_ms"}
    assert noise["throughput_tok_s"]["dof"] == 2 * len(baselines)
    assert 0.005 < noise["throughput_tok_s"]["cv"] < 0.2        # the fake's 5 % is what is measured
    for t in baselines:
        runs = study.user_attrs[f"runs:{t.number}"]
        assert [r["kind"] for r in runs] == ["replicate", "replicate"]
        row = df[df["trial"] == t.number].iloc[0]
        values = [t.values[1]] + [r["throughput_tok_s"] for r in runs]
        assert row["runs"] == 3 and row["throughput_tok_s"] == pytest.approx(sum(values) / 3)
        assert row["throughput_tok_s_first"] == t.values[1]
    assert (cfg.results_path / "noise.json").exists()
    # resumed, the replicates already made are not repeated
    device2 = FakeDevice()
    run(cfg, device2, 6)
    assert device2.launches == []


def test_confirm_relaunches_the_front_and_a_failed_relaunch_leaves_it(tmp_path):
    cfg = fake_config(tmp_path, confirm=2)
    device = FakeDevice(fail_relaunch_of={4})
    study = run(cfg, device, 6)
    df = report.trials_frame(study)
    confirmed = [int(k.split(":")[1]) for k in study.user_attrs if k.startswith("runs:")]
    assert confirmed
    for number in confirmed:
        runs = study.user_attrs[f"runs:{number}"]
        row = df[df["trial"] == number].iloc[0]
        if row["max_num_seqs"] == 4:
            assert runs[0]["failure"] == "oom" and row["relaunch_failed"] == "oom"
            assert not row["pareto"]                               # its relaunch failed: off the front
        else:
            assert [r["kind"] for r in runs] == ["confirm", "confirm"] and row["runs"] == 3
    front = df[df["pareto"]]
    assert len(front) and (front["relaunch_failed"] == "").all()
    assert "throughput_tok_s_first" in pd.read_csv(cfg.results_path / "pareto.csv").columns
    # resumed, the confirmations already made are not repeated
    device2 = FakeDevice()
    run(cfg, device2, 6)
    assert device2.launches == []


def test_balanced_export_ignores_objectives_whose_front_spread_is_noise():
    front = pd.DataFrame({"trial": [0, 1], "runs": [3, 3],
                          "single_stream_tok_s": [101.0, 100.0],     # 1 %: noise
                          "throughput_tok_s": [500.0, 4000.0],       # 8x: real
                          "ttft_ms": [40.0, 41.0]})                  # 2.5 %: noise
    noise = {k: {"cv": 0.03, "dof": 4, "configs": 2} for k in report.OBJECTIVES}
    assert export.balanced_objectives(front, noise) == ["throughput_tok_s"]
    assert int(export.choose(front, "balanced", noise)["trial"]) == 1
    # without a noise figure the 1 % single-stream edge would count as much as 8x throughput
    assert export.balanced_objectives(front, None, 0.0) == list(report.OBJECTIVES)


def test_balanced_weighs_relative_losses_so_two_members_do_not_tie_by_construction():
    # the h200-16gb front: half the throughput to save 8 % of TTFT. Min-max scaling gave each of two
    # members exactly 1 and the lower trial number won; the log-ratio loss picks trial 4
    front = pd.DataFrame({"trial": [1, 4], "runs": [1, 1],
                          "single_stream_tok_s": [371.0, 370.4],
                          "throughput_tok_s": [2667.2, 5206.5], "ttft_ms": [49.2, 53.3]})
    noise = {k: {"cv": 0.01, "dof": 4, "configs": 2} for k in report.OBJECTIVES}
    assert int(export.preferred(front, "balanced", noise)["trial"]) == 4
    # the other way round: 5 % more throughput for twice the TTFT loses
    front["throughput_tok_s"], front["ttft_ms"] = [5000.0, 5250.0], [50.0, 100.0]
    assert int(export.preferred(front, "balanced", noise)["trial"]) == 1
    # an exact tie on the summed losses goes to the higher throughput, not the lower trial number
    front["throughput_tok_s"], front["ttft_ms"] = [2000.0, 4000.0], [50.0, 100.0]
    assert int(export.preferred(front, "balanced", noise)["trial"]) == 4


def test_ties_widen_by_students_t_when_the_noise_rests_on_few_replicates():
    assert noise_module.noise_z(2) == pytest.approx(4.30) and noise_module.noise_z(5) == pytest.approx(2.57)
    assert noise_module.noise_z(11) == noise_module.noise_z(10) and noise_module.noise_z(500) == pytest.approx(1.96)
    few = {"throughput_tok_s": {"cv": 0.05, "dof": 2, "configs": 1}}
    many = {"throughput_tok_s": {"cv": 0.05, "dof": 40, "configs": 20}}
    # 1,000 against 1,200 tok/s, one launch each: 20 % apart, 0.05 * 1562 = 78 tok/s standard error
    wide = noise_module.tie_margin("throughput_tok_s", 1000.0, 1200.0, 1, 1, few, 0.02)
    narrow = noise_module.tie_margin("throughput_tok_s", 1000.0, 1200.0, 1, 1, many, 0.02)
    assert wide > 200 > narrow                   # a tie on 2 degrees of freedom, a difference on 40
    # the test is on the ratio: |ln(1200 / 1000)| against 2.04 standard errors of a log difference
    L = 2.04 * 0.05 * 2 ** 0.5
    assert narrow == pytest.approx((1000.0 * 1200.0) ** 0.5 * 2 * math.sinh(L / 2))
    # close to the linear form for close values ...
    assert narrow == pytest.approx(2.04 * 0.05 * (1000.0 ** 2 + 1200.0 ** 2) ** 0.5, rel=0.02)
    # ... but a wide noise no longer ties values 20x apart: 107 ms against 2,141 ms, CV 25 %, 2 dof
    noisy = {"ttft_ms": {"cv": 0.25, "dof": 2, "configs": 1}}
    assert 2141.0 - 107.0 > noise_module.tie_margin("ttft_ms", 107.0, 2141.0, 1, 1, noisy, 0.02)
    assert 130.0 - 107.0 < noise_module.tie_margin("ttft_ms", 107.0, 130.0, 1, 1, noisy, 0.02)


def test_describe_noise_warns_when_the_noise_cannot_rank_configs_launched_once():
    quiet = {k: {"cv": 0.03, "dof": 4, "configs": 2} for k in report.OBJECTIVES}
    assert "WARNING" not in report.describe_noise(quiet)
    loud = dict(quiet, throughput_tok_s={"cv": 0.31, "dof": 2, "configs": 1})
    line = report.describe_noise(loud)
    assert "WARNING: the noise is too wide" in line and "throughput_tok_s ties up to" in line
    assert "single_stream_tok_s ties" not in line


def _tied_front(defaults: dict) -> pd.DataFrame:
    front = pd.DataFrame({
        "trial": [3, 0, 5, 7],
        "gpu_memory_utilization": [0.12, 0.20, 0.20, 0.08],
        "max_model_len": [4096, 32768, 4096, 1024],
        "max_num_seqs": [32, 32, 32, 16],
        "runs": [1, 2, 1, 1],
        "single_stream_tok_s": [101.0, 99.0, 100.0, 102.0],
        "throughput_tok_s": [196.0, 190.0, 188.0, 120.0],   # trial 7 is beaten beyond the noise
        "ttft_ms": [2680.0, 2890.0, 2800.0, 2500.0]})
    front.attrs["defaults"] = defaults
    return front


def test_export_takes_the_config_closest_to_the_defaults_among_those_that_tie():
    noise = {k: {"cv": 0.05, "dof": 4, "configs": 2} for k in report.OBJECTIVES}
    defaults = {"gpu_memory_utilization": 0.20, "max_model_len": 32768, "max_num_seqs": 32}
    front = _tied_front(defaults)
    # the best throughput is trial 3, but trials 0 and 5 tie with it on every objective; trial 0
    # is the defaults baseline itself, so the command changes nothing that did not measure better
    assert set(export.ties_with(front, front.iloc[0], noise)["trial"]) == {3, 0, 5}
    assert int(export.choose(front, "throughput", noise)["trial"]) == 0
    assert int(export.choose(front, "balanced", noise)["trial"]) == 0
    # without the defaults among them, the one that differs in fewer flags (trial 5: only
    # max_model_len) wins over trial 3 (two flags)
    rest = front[front["trial"] != 0]
    assert int(export.choose(rest, "throughput", noise)["trial"]) == 5
    # a config better beyond the noise is never traded for a simpler one
    sure = {k: {"cv": 0.001, "dof": 40, "configs": 20} for k in report.OBJECTIVES}
    assert int(export.choose(front, "throughput", sure, 0.0)["trial"]) == 3
    # a study with no defaults baseline keeps the preference's own pick
    bare = _tied_front({})
    assert int(export.choose(bare, "throughput", noise)["trial"]) == 3
    # the export says why it did not take the preference's own pick, and only then
    why = export.choice_note(front, export.choose(front, "throughput", noise), "throughput", noise)
    assert why.startswith("the throughput pick, trial 3, ties within the noise on every objective "
                          "with trials 0, 5; ")
    # "(0)" read as a trial number: the defaults themselves are said in words
    assert why.endswith("trial 0, exported instead, is the defaults baseline itself (no flag changed)")
    assert export.choice_note(bare, export.choose(bare, "throughput", noise), "throughput", noise) == ""
    assert export.choice_note(rest, export.choose(rest, "throughput", noise), "throughput", noise
                              ).endswith("trial 5, exported instead, changes the fewest flags "
                                         "from the defaults baseline (1)")
    # as many flags changed as the pick (both change gpu_memory_utilization alone): said so
    near = pd.DataFrame({"trial": [16, 17], "gpu_memory_utilization": [0.95, 0.93],
                         "max_model_len": [32768, 32768], "max_num_seqs": [32, 32], "runs": [2, 1],
                         "single_stream_tok_s": [5.94, 5.94], "throughput_tok_s": [75.3, 75.2],
                         "ttft_ms": [1555.0, 1559.0]})
    near.attrs["defaults"] = {"gpu_memory_utilization": 0.92, "max_model_len": 32768, "max_num_seqs": 32}
    row = export.choose(near, "throughput", noise)
    assert int(row["trial"]) == 17
    assert export.choice_note(near, row, "throughput", noise).endswith(
        "trial 17, exported instead, changes as many flags from the defaults baseline (1), "
        "to values nearer it")


def test_the_frame_names_the_defaults_baselines_values(tmp_path):
    cfg = fake_config(tmp_path)
    study = run(cfg, FakeDevice(), 3)
    df = report.trials_frame(study)
    first = next(t for t in study.trials if t.user_attrs.get("baseline") == "vllm-defaults")
    assert df.attrs["defaults"] == first.params and df.attrs["defaults"]
    assert df[df["pareto"]].attrs["defaults"] == first.params   # a slice keeps it


def test_configs_equal_on_the_grid_are_one_config(tmp_path):
    from tuner.search.trial import config_key

    cfg = fake_config(tmp_path)
    a = config_key({"gpu_memory_utilization": 0.30000000000000004, "max_model_len": 1024,
                    "max_num_seqs": 4}, cfg.dimensions)
    b = config_key({"gpu_memory_utilization": 0.3, "max_model_len": 1024, "max_num_seqs": 4},
                   cfg.dimensions)
    assert a == b


@pytest.mark.parametrize("model", ["/models/my model", "/models/it's \"quoted\"", "/m/$(rm -rf x)"])
def test_export_command_is_quoted_for_any_path(tmp_path, model):
    cfg = fake_config(tmp_path)
    study = run(cfg, FakeDevice(), 4)
    df = report.trials_frame(study)
    row = export.choose(df[df["pareto"]], "throughput").copy()
    row["command"] = shlex.join(["vllm", "serve", model, *export.launch_params(row).vllm_flags(),
                                 "--served-model-name", "a b", "--host", "127.0.0.1",
                                 "--port", "8123"])
    argv = shlex.split(export.command(row, study))
    assert argv[:3] == ["vllm", "serve", model]
    assert argv[-4:] == ["--served-model-name", "a b", "--host", "127.0.0.1"]
    assert argv[argv.index("--max-num-seqs") + 1] == str(int(row["max_num_seqs"]))


def test_export_preferences_pick_the_best_on_their_objective(tmp_path):
    cfg = fake_config(tmp_path)
    study = run(cfg, FakeDevice(), 12)
    df = report.trials_frame(study)
    front = df[df["pareto"]]
    assert export.choose(front, "throughput")["throughput_tok_s"] == front["throughput_tok_s"].max()
    assert export.choose(front, "ttft")["ttft_ms"] == front["ttft_ms"].min()
    assert export.choose(front, "single-stream")["single_stream_tok_s"] == \
        front["single_stream_tok_s"].max()




def test_a_server_left_by_a_killed_replicate_launch_is_stopped_by_the_next_run(tmp_path):
    import subprocess
    import sys

    cfg = fake_config(tmp_path)
    run(cfg, FakeDevice(), 1)
    # a server of a replicate launch whose tuner was SIGKILLed: its own process group, our port mark
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "--port", "8765"],
                              start_new_session=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    study = load_existing(cfg)
    study.set_user_attr("relaunch_server", {"pgid": server.pid, "port": 8765, "host": os.uname().nodename,
                                            "tuner_pid": dead.pid, "trial": 0, "kind": "replicate"})
    try:
        Tuner(cfg, measure=FakeDevice(), platform=FAKE_PLATFORM, progress=False).open()
        assert server.wait(timeout=40) is not None
    finally:
        if server.poll() is None:
            server.kill()
    assert load_existing(cfg).user_attrs["relaunch_server"] == {}


# ---------------------------------------------------------------- cpu_offload: slow against the roofline

H200 = Platform("cuda", "NVIDIA H200", 141 * 2**30, 4800.0, ("true",), "0.0-fake", pcie_gbps=63.0)


@pytest.fixture(scope="module")
def llama8b(tmp_path_factory):
    from tuner.search.feasibility import model_shape
    from tuner.models.presets import PRESETS, write_model_folder

    return model_shape(str(write_model_folder(PRESETS["llama-3.1-8b"], tmp_path_factory.mktemp("8b"))))


def _measured(single_stream: float, **params) -> "TrialOutcome":
    from tuner.records import Capacity, LoadMetrics, TrialOutcome
    from tuner.search.space import ServerParams

    capacity = params.pop("capacity", Capacity(kv_cache_tokens=100_000))
    return TrialOutcome(ServerParams(0.9, 4096, 16, **params), capacity=capacity,
                        metrics=LoadMetrics(single_stream_tok_s=single_stream, throughput_tok_s=900.0,
                                            ttft_ms=80.0))


def _record(cfg, platform, shape, outcome):
    from tuner.search.trial import offload_figures, record_outcome

    t = RecordingTrial()
    values = record_outcome(t, cfg, outcome, offload_figures(cfg, platform, shape, outcome),
                            (0.0, 0.0, 1e5))
    return t, values


def test_a_single_stream_far_below_its_roofline_is_cpu_offload_a_soft_constraint(tmp_path, llama8b):
    from tuner.search.feasibility import kv_dtype_bytes, roofline_tok_s

    cfg = fake_config(tmp_path)
    assert cfg.min_roofline_share == 0.05
    w = cfg.workload
    bound = roofline_tok_s(4800.0, llama8b, w.prompt_tokens + w.output_tokens // 2,
                           kv_dtype_bytes(None, llama8b.dtype_bytes))
    assert bound == pytest.approx(298, rel=0.02)   # 16 GB of bf16 weights at 4.8 TB/s
    t, values = _record(cfg, H200, llama8b, _measured(3.0))
    assert t.attrs["failure"] == "cpu_offload" and t.attrs["offload_suspected"] is True
    assert t.attrs["roofline_tok_s"] == pytest.approx(bound, abs=0.1)
    share = 3.0 / bound
    assert t.constraints["slo"] == pytest.approx(0.05 / share - 1, abs=1e-3)
    assert t.constraints["slo"] > 3   # 1 % of the roofline where 5 % is wanted
    assert t.attrs["roofline_shortfall"] == t.constraints["slo"]
    assert all(v == 0 for k, v in t.constraints.items() if k != "slo")
    assert "below [slo] min_roofline_share 0.05" in t.attrs["failure_message"]
    # soft: the trial keeps its measured figures, so the sampler sees how slow it was
    assert values == (3.0, 900.0, 80.0)
    # --enforce-eager's 13 % of the roofline is slow kernels, not offload
    t, _ = _record(cfg, H200, llama8b, _measured(39.0))
    assert t.attrs["failure"] == "" and t.constraints["slo"] == 0.0
    assert t.attrs["offload_suspected"] is False and t.attrs["roofline_pct"] == pytest.approx(13, abs=0.5)


def test_the_roofline_check_is_off_without_a_bandwidth_or_a_share(tmp_path, llama8b):
    from dataclasses import replace

    cfg = fake_config(tmp_path)
    # the CPU build: NVML knows no bandwidth, so there is no roofline to fall below
    t, _ = _record(cfg, FAKE_PLATFORM, llama8b, _measured(3.0))
    assert "roofline_tok_s" not in t.attrs and t.attrs["failure"] == "" and t.constraints["slo"] == 0
    # [slo] min_roofline_share = 0 turns it off on a GPU too (the roofline is still reported)
    t, _ = _record(replace(cfg, min_roofline_share=0.0), H200, llama8b, _measured(3.0))
    assert t.attrs["roofline_pct"] == pytest.approx(1.0, abs=0.1) and t.constraints["slo"] == 0
    assert t.attrs["failure"] == ""


def test_a_deliberate_offload_is_judged_against_its_pcie_roofline(tmp_path, llama8b):
    from tuner.records import Capacity

    cfg = fake_config(tmp_path)
    # 4 GiB over 63 GB/s: at most 14.7 tok/s, and 12 of them is 82 % of that
    t, _ = _record(cfg, H200, llama8b, _measured(12.0, cpu_offload_gb=4.0))
    assert t.attrs["roofline_tok_s"] == pytest.approx(63e9 / 4 / 2**30, abs=0.1)
    assert t.attrs["roofline_offload_gib"] == 4.0
    assert t.attrs["failure"] == "" and t.constraints["slo"] == 0
    # the same 12 tok/s with every weight resident is 4 % of the HBM roofline: cpu_offload
    t, _ = _record(cfg, H200, llama8b, _measured(12.0))
    assert t.attrs["failure"] == "cpu_offload" and t.constraints["slo"] > 0
    # the second signal: what the server logged it offloaded wins over the flag (fixed flags in
    # extra_args, or none known), and is named in the message when the speed still falls short
    logged = Capacity(kv_cache_tokens=100_000, cpu_offload_gib=4.0)
    t, _ = _record(cfg, H200, llama8b, _measured(12.0, capacity=logged))
    assert t.attrs["cpu_offload_gib"] == 4.0 and t.attrs["roofline_offload_gib"] == 4.0
    assert t.attrs["failure"] == ""
    t, _ = _record(cfg, H200, llama8b, _measured(0.5, capacity=logged))
    assert t.attrs["failure"] == "cpu_offload"
    assert "logged 4 GiB of weights offloaded" in t.attrs["failure_message"]


def test_an_slo_met_at_a_lower_level_is_goodput_not_a_violation(tmp_path, llama8b):
    # [slo] ttft_ms 150: the top level's TTFT p90 is 172 ms, but c4 met every SLO and its
    # throughput is the goodput; only when no level meets the SLOs is the config infeasible,
    # and then it says so (before: an unnamed constraint, the config silently off the front)
    from dataclasses import replace

    from tuner.load.metrics import NO_LEVEL_MEETS

    cfg = fake_config(tmp_path)
    cfg = replace(cfg, workload=replace(cfg.workload, slo_ttft_ms=150.0))
    outcome = _measured(3.0)
    met = replace(outcome, metrics=replace(outcome.metrics, ttft_ms_p90=172.0, throughput_level="c4"))
    t, _ = _record(cfg, FAKE_PLATFORM, llama8b, met)
    assert t.constraints["slo"] == 0 and t.attrs["failure"] == ""
    missed = replace(outcome, metrics=replace(outcome.metrics, ttft_ms_p90=172.0,
                                              throughput_level=NO_LEVEL_MEETS))
    t, _ = _record(cfg, FAKE_PLATFORM, llama8b, missed)
    assert t.constraints["slo"] == pytest.approx(172.0 / 150.0 - 1)
    assert t.attrs["failure"] == "slo_not_met"
    assert "TTFT p90 172 ms > 150 ms" in t.attrs["failure_message"]


def test_a_latency_slo_and_the_roofline_share_keep_their_own_figures(tmp_path, llama8b):
    from dataclasses import replace

    from tuner.records import LoadMetrics

    cfg = fake_config(tmp_path)
    cfg = replace(cfg, workload=replace(cfg.workload, slo_ttft_ms=50.0))
    outcome = _measured(3.0)
    outcome = replace(outcome, metrics=replace(outcome.metrics, ttft_ms_p90=75.0))
    t, _ = _record(cfg, H200, llama8b, outcome)
    assert t.attrs["slo_latency_violation"] == pytest.approx(0.5)
    assert t.constraints["slo"] == t.attrs["roofline_shortfall"] > 0.5
    assert isinstance(outcome.metrics, LoadMetrics)


def test_when_every_config_is_too_slow_export_offers_the_best_with_a_warning(tmp_path):
    # the tiny model's roofline on an H200 is millions of tok/s: the fake's 100 tok/s is far below
    cfg = fake_config(tmp_path)
    study = Tuner(cfg, measure=FakeDevice(), platform=H200, progress=False).run(6)
    measured = [t for t in study.trials if t.user_attrs.get("single_stream_tok_s")]
    assert measured and all(t.user_attrs["failure"] == "cpu_offload" for t in measured)
    assert all(t.constraints["slo"] > 0 for t in measured)
    df = report.trials_frame(study)
    assert not df["pareto"].any()
    front, warning = export.offered_front(df)
    assert len(front) and set(front["failure"]) == {"cpu_offload"}
    assert "min_roofline_share" in warning and warning.startswith("warning:")
    script = (cfg.results_path / "best-command.sh").read_text()
    assert "# warning: no measured config reached [slo] min_roofline_share" in script
    # with one feasible config the slow ones are not offered
    from dataclasses import replace

    cfg2 = replace(fake_config(tmp_path / "b"), min_roofline_share=0.0)
    study2 = Tuner(cfg2, measure=FakeDevice(), platform=H200, progress=False).run(4)
    df2 = report.trials_frame(study2)
    front2, warning2 = export.offered_front(df2)
    assert warning2 == "" and front2["pareto"].all() and len(front2)


def _finished(number, seconds, failure=None):
    from datetime import datetime, timedelta

    from optuna.trial import create_trial

    start = datetime(2026, 12, 5, 12, 0, 0)
    t = create_trial(values=[1.0, 1.0, 1.0], user_attrs={"failure": failure} if failure else {})
    t.number, t.datetime_start = number, start
    t.datetime_complete = start + timedelta(seconds=seconds)
    return t


def test_launch_seconds_is_the_median_of_measured_launches_and_skips_unlaunched_trials():
    from tuner.search.study import launch_seconds

    assert launch_seconds([]) is None
    # measured trials decide; a fast memory failure or an instant skip does not shorten the guess
    trials = [_finished(0, 100), _finished(1, 300), _finished(2, 200),
              _finished(3, 20, "kv_cache_too_small"), _finished(4, 0.1, "predicted_infeasible")]
    assert launch_seconds(trials) == 200
    assert launch_seconds(trials[:2]) == 200   # even count: the mean of the middle two
    # only failed launches so far: they are the guess; skips alone give none
    assert launch_seconds([_finished(3, 20, "kv_cache_too_small"), _finished(5, 40, "oom")]) == 30
    assert launch_seconds([_finished(4, 0.1, "predicted_infeasible")]) is None
    # a study resumed on another machine: that machine's launches decide once it has any
    slow = _finished(6, 318)
    slow.user_attrs = {"machine": "slowhost"}
    assert launch_seconds([*trials, slow]) == 250       # 100, 200, 300, 318
    assert launch_seconds([*trials, slow], "slowhost") == 318
    assert launch_seconds([*trials, slow], "fresh") == 250   # none there yet: the whole study's


class SlowDevice(FakeDevice):
    """Each launch takes `seconds` of wall time, like a real one."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds

    def __call__(self, *args, **kwargs):
        import time

        time.sleep(self.seconds)
        return super().__call__(*args, **kwargs)


def test_out_of_time_starts_a_launch_only_while_a_median_launch_still_fits(tmp_path, monkeypatch):
    # the decision itself, on a clock of our own: no wall time, so no flake on a busy machine
    import types

    from tuner.search import study as study_mod

    now = [1000.0]
    monkeypatch.setattr(study_mod, "time", types.SimpleNamespace(
        monotonic=lambda: now[0], sleep=lambda s: None, time=lambda: now[0]))
    tuner = Tuner(fake_config(tmp_path, replicates=0), measure=FakeDevice(), platform=FAKE_PLATFORM,
                  progress=False)
    trials: list = []
    stub = types.SimpleNamespace(get_trials=lambda deepcopy=False, states=(): trials)
    assert not tuner.out_of_time(stub)            # no --time-limit: never
    tuner.stop_by = now[0] + 600
    assert not tuner.out_of_time(stub)            # no launch measured yet: go while time is left
    trials += [_finished(0, 200), _finished(1, 300), _finished(2, 250)]   # median 250 s
    now[0] += 349
    assert not tuner.out_of_time(stub)            # 251 s left > 250
    now[0] += 2
    assert tuner.out_of_time(stub)                # 249 s left: a launch would end after the limit
    tuner.stop_by = None


def test_time_limit_starts_no_launch_that_would_end_after_it_and_a_rerun_goes_on(tmp_path, capsys):
    cfg = fake_config(tmp_path, replicates=0)
    device = SlowDevice(0.4)
    study = Tuner(cfg, measure=device, platform=FAKE_PLATFORM, progress=False).run(30, 1.5)
    first = len(device.launches)
    # the first launch sets the median (at least 0.4 s); a launch starts only while that much is
    # left of the 1.5 s, so at most 4 (the decision's own test is the one above, on a fake clock)
    assert 1 <= first <= 4, first
    assert "stopping:" in capsys.readouterr().err
    from tuner.search.study import SKIPPED_KINDS

    launched = [t for t in study.trials if t.state == TrialState.COMPLETE
                and t.user_attrs.get("failure") not in SKIPPED_KINDS]
    assert len(launched) == first   # every launch is in the storage, none left half-done
    # the same command without a limit resumes the study where it stopped
    again = FakeDevice()
    study = run(cfg, again, first + 3)
    assert len(again.launches) == 3


class PeakyDevice(FakeDevice):
    """The server's peak of device memory grows with max-num-seqs: 4 GiB plus 1 GiB a sequence."""

    def __call__(self, spec, *args, **kwargs):
        out = super().__call__(spec, *args, **kwargs)
        from dataclasses import replace

        return replace(out, peak_gpu_server_bytes=int((4 + spec.params.max_num_seqs) * 2**30))


def test_a_peak_above_the_memory_budget_keeps_a_measured_config_off_the_front(tmp_path):
    # under a budget a card is emulated by a share of a bigger one; a peak of device memory above
    # the budget would run the real card out of memory, whatever the share's plan said
    from fakes import FAKE_STUDY
    from tuner.config import parse_study
    from tuner.search.trial import over_budget

    assert over_budget({"peak_gpu_server_gib": 16.8}, 15.77)[1].startswith(
        "the server's measured peak, 16.8 GiB of device memory, exceeds the 15.77 GiB")
    assert over_budget({"peak_gpu_server_gib": 13.7}, 15.77) is None
    assert over_budget({"peak_gpu_server_gib": 16.8}, None) is None   # no budget: the card's own
    assert over_budget({}, 15.77) is None                              # no peak read: not held against it
    # under a ballast the card had only the budget free: the peak is the card's own business
    assert over_budget({"peak_gpu_server_gib": 16.8, "memory_budget_mode": "ballast"}, 15.77) is None
    assert over_budget({"peak_gpu_server_gib": 16.8, "memory_budget_mode": "share"}, 15.77) is not None

    doc = {**FAKE_STUDY, "server": {"memory_budget_gib": 9.0}}
    cfg = parse_study(doc, "<fake>", {"storage": f"sqlite:///{tmp_path}/fake.db",
                                      "results_dir": str(tmp_path / "results")})
    study = run(cfg, PeakyDevice(), 12)
    df = report.trials_frame(study)
    measured = df[df["single_stream_tok_s"].notna()]
    over = measured[measured["max_num_seqs"] > 5]
    within = measured[measured["max_num_seqs"] <= 5]
    assert len(over) and len(within), df[["max_num_seqs", "failure"]]
    assert (over["failure"] == "over_budget").all() and not over["feasible"].any()
    assert not over["pareto"].any()
    assert (within["failure"] == "").all() and within["pareto"].any()
    # the sampler is told too: a memory constraint, the measured figures kept as its values
    t = study.trials[int(over["trial"].iloc[0])]
    assert t.constraints["memory"] > 0 and t.values[0] > 0
    assert "exceeds the 9 GiB memory budget" in t.user_attrs["failure_message"]


def test_a_study_whose_every_launch_failed_says_why_it_has_no_front(tmp_path, capsys):
    from tuner import cli

    cfg = fake_config(tmp_path)
    study = run(cfg, FakeDevice(tokens_per_gmu=10), 3)   # no KV cache holds any max-model-len
    df = report.trials_frame(study)
    assert not df["pareto"].any() and (df["failure"] != "").all()
    cli.print_summary(study, cfg)
    said = capsys.readouterr().err
    assert "Pareto set: none yet; no trial has met every constraint (kv_cache_too_small" in said
    # and which contexts failed, each with its count
    assert "no max_model_len has served yet: " in said and "failed for memory" in said
    assert "Empty DataFrame" not in said
    assert report.describe_empty_front(df.iloc[0:0]) == ("Pareto set: none yet (no trial has "
                                                         "been measured)")


def test_describe_launch_gives_the_launches_a_warm_spare_served_apart():
    # a run's first launch (no spare: it imported the engine itself) against the later ones
    df = pd.DataFrame({"launch_s": [120.0, 50.0, 60.0, float("nan"), 100.0],
                       "launch_preimport_s": [float("nan"), 12.0, 13.0, float("nan"), float("nan")],
                       "launch_compile_s": [30.0, 28.0, 4.0, float("nan"), 29.0]})
    line = report.describe_launch(df)
    assert line.startswith("launch: median 80.0 s over the first launch of 4 trials (median phases: "
                           "compile 28.5 s)")
    assert line.endswith("; 55.0 s over the 2 launches after the first of their run")
    # every launch the first of its run (one trial per `tuner run`), or none recorded: nothing to split
    assert "after the first" not in report.describe_launch(df.assign(launch_preimport_s=float("nan")))
    assert "after the first" not in report.describe_launch(df.drop(columns="launch_preimport_s"))


def test_front_changed_counts_news_beyond_the_noise_only():
    df = pd.DataFrame({
        "trial": [0, 1, 2, 3], "state": ["COMPLETE"] * 4, "feasible": [True] * 4, "runs": [1] * 4,
        "single_stream_tok_s": [100.0, 50.0, 99.0, 40.0],
        "throughput_tok_s": [1000.0, 2000.0, 1005.0, 3000.0], "ttft_ms": [50.0, 80.0, 50.5, 120.0]})
    df["pareto"] = [True, True, True, False]
    # trial 2 joined the front within 2 % of trial 0 on every objective: the same front
    assert not report.front_changed(df, {0, 1}, 0.02)
    # a member beyond the tolerance on one objective is news
    df.loc[3, "pareto"] = True
    assert report.front_changed(df, {0, 1, 2}, 0.02)
    # a member that left the front is news
    df["pareto"] = [True, False, True, True]
    assert report.front_changed(df, {0, 1, 2, 3}, 0.02)
    # measured launch-to-launch noise widens the ties: with a 30 % CV trial 3 (40 / 3000 / 120)
    # is within the noise of trial 1 (50 / 2000 / 80) on every objective, with 5 % it is not
    df["pareto"] = [True, True, False, True]
    for cv, news in ((0.3, False), (0.05, True)):
        df.attrs["noise"] = {k: {"cv": cv, "dof": 8}
                             for k in ("single_stream_tok_s", "throughput_tok_s", "ttft_ms")}
        assert report.front_changed(df, {0, 1}, 0.02) == news, cv


def test_patience_stops_once_the_front_stops_changing_and_a_rerun_keeps_the_count(tmp_path, capsys):
    # the fake's figures depend on max-num-seqs alone: the front is one config of each of 1, 4
    # and 16 sequences (64 is beaten by 16), and every later launch only ties one of them
    cfg = fake_config(tmp_path, patience=3, screen=False)
    device = FakeDevice()
    study = run(cfg, device, 40)
    launched = len(device.launches)
    assert launched < 40
    err = capsys.readouterr().err
    assert "stopping: the last 3 launches did not change the Pareto front" in err
    # each launch says how near the stop is
    assert "front: changed (stops after 3 unchanged)" in err
    assert err.count("front: unchanged for 3 (stops after 3 unchanged)") == 1
    watch = study.user_attrs["front_watch"]
    assert watch["changed_at"] == launched - 3
    # `show` and the run's summary say how long the front has held
    assert f"unchanged beyond the noise for the last 3 of {launched} launches" in \
        report.describe_front_watch(study)
    assert "--patience 3 stops after 3 unchanged" in report.describe_front_watch(study, 3)
    df = report.trials_frame(study)
    assert sorted(watch["front"]) == sorted(int(n) for n in df[df["pareto"]]["trial"])
    # configs of one size tie (all of them are on the front), and 64 sequences are beaten by 16
    sizes = [int(study.trials[n].params["max_num_seqs"]) for n in watch["front"]]
    assert set(sizes) <= {1, 4, 16} and len(sizes) > len(set(sizes))
    # the launches after the last change only met sizes measured before it (ties, or 64)
    before = {p.max_num_seqs for p in device.launches[:watch["changed_at"]]}
    assert {p.max_num_seqs for p in device.launches[watch["changed_at"]:]} <= before | {64}
    # the same command again launches nothing: the count was kept in the study
    again = FakeDevice()
    run(cfg, again, 40)
    assert again.launches == []
    # patience off: it searches on
    more = FakeDevice()
    run(fake_config(tmp_path, patience=0, screen=False), more, launched + 2)
    assert len(more.launches) == 2


def test_each_launch_records_its_machine_and_a_study_spread_over_machines_says_so(tmp_path):
    # the 32B study read 3.81 tok/s (trial 24) and 2.49 (trial 29) for one offload config on two
    # H100 hosts, where its relaunch noise was 0.1 %: the noise does not cover a change of machine
    from tuner.run import devices

    cfg = fake_config(tmp_path, seed=5)
    study = run(cfg, FakeDevice(), 4)
    launched = [t for t in study.trials if t.user_attrs.get("launch_s") is not None]
    assert launched and {t.user_attrs["machine"] for t in launched} == {devices.machine_id()}
    df = report.trials_frame(study)
    assert report.describe_machines(df) == ""
    df.loc[df["trial"].isin([2, 3]), "machine"] = "another"
    line = report.describe_machines(df)
    assert line.startswith("machines: launches ran on 2: ")
    assert f"{devices.machine_id()} (trial" in line and "another (trials 2-3)" in line, line
    assert report._ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8" and report._ranges([4]) == "4"
    # a config screened there without a launch is no launch on that machine
    df.loc[df["trial"].isin([2, 3]), "launch_s"] = pd.NA
    assert report.describe_machines(df) == ""
