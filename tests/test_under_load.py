"""A server that dies or refuses requests for length under load, with the fake OpenAI server as a real process."""

from __future__ import annotations

import sys

import faultkit as fk
from tuner.run.process import LaunchSpec
from tuner.run.measure import measure_config
from tuner.records import Workload
from tuner.search.space import ServerParams
from tuner.search.trial import stop_if_every_request_failed

WORKLOAD = Workload(prompt_tokens=16, output_tokens=8, warmup_requests=0, single_stream_requests=4,
                    levels=(4,), throughput_requests=16, request_timeout_s=30)


def spec(tmp_path, **env):
    return LaunchSpec(model=str(fk.private_model(tmp_path / "model")), params=ServerParams(0.5, 1024, 4),
                      engine_cmd=(sys.executable, str(fk.FAKE_OPENAI)),
                      env=tuple(sorted({"FAKE_MODE": "ok", **env}.items())), launch_timeout_s=60,
                      log_path=str(tmp_path / "server.log"))


def test_a_server_that_ooms_under_load_is_classified_from_its_log(tmp_path):
    outcome = measure_config(spec(tmp_path, FAKE_DIE_AFTER="6"), WORKLOAD, progress=False)
    assert outcome.server_exit_code == 1
    assert outcome.died_under_load.kind == "oom"
    assert outcome.failure_kind == "oom_under_load"
    assert "CUDA out of memory" in outcome.died_under_load.log_tail
    assert outcome.metrics.levels[0].failed == 0          # single stream was measured before it died


def test_requests_refused_for_length_are_their_own_kind_and_do_not_stop_the_study(tmp_path):
    w = Workload(prompt_tokens=16, output_tokens=8, warmup_requests=0, single_stream_requests=1,
                 levels=(4,), throughput_requests=16, request_timeout_s=30, length_mix="uniform",
                 prompt_tokens_mix=(40.0, 60.0))
    outcome = measure_config(spec(tmp_path, FAKE_MAX_MODEL_LEN="40"), w, progress=False)
    m = outcome.metrics
    assert m.rejected_for_length == 16 and m.requests_failed == 16
    assert "rejected_for_length" in m.error_kinds
    assert m.requests_failed >= 0.9 * m.requests_sent   # would stop the study as a workload error
    stop_if_every_request_failed(None, outcome)          # but refusals for length do not count


def test_a_kv_cache_short_of_the_requirement_is_not_load_tested(tmp_path):
    # the [requirement] asks 4 x 1,024 tokens; the server states 3,000: no request is sent
    from dataclasses import replace

    short = replace(spec(tmp_path, FAKE_KV_TOKENS="3000"), min_kv_tokens=4096)
    outcome = measure_config(short, WORKLOAD, progress=False)
    assert outcome.capacity.kv_cache_tokens == 3000
    assert outcome.metrics is None and outcome.load_s == 0
    enough = replace(spec(tmp_path / "enough", FAKE_KV_TOKENS="5000"), min_kv_tokens=4096)
    assert measure_config(enough, WORKLOAD, progress=False).metrics is not None


def test_a_cache_that_ran_out_under_load_fails_the_config_not_the_study():
    # llama.cpp with a unified KV cache too small for its slots fails requests mid-stream with
    # "Context size has been exceeded.": nearly every request of the level failed, which read as
    # a workload fault and stopped the whole study; any other error that alike still does
    from types import SimpleNamespace

    import pytest

    from tuner.errors import TunerError

    def outcome(top_error):
        m = SimpleNamespace(requests_sent=68, requests_failed=66, rejected_for_length=0,
                            top_error=top_error)
        return SimpleNamespace(metrics=m, server_exit_code=None, died_under_load=None)

    trial = SimpleNamespace(number=3)
    stop_if_every_request_failed(trial, outcome("server_error: Context size has been exceeded."))
    with pytest.raises(TunerError, match="66 of 68 requests failed"):
        stop_if_every_request_failed(trial, outcome("http_error: HTTP 404: model not found"))
