"""One config, measured: launch a server, run the load test, stop it; the outcome as flat data."""

from __future__ import annotations

import contextlib
import time
from dataclasses import replace

from tuner.run.ballast import Ballast
from tuner.run.process import ServerProcess
from tuner.load.client import run_load_test
from tuner.load.metrics import summarize
from tuner.records import LaunchFailure, LaunchSpec, TrialOutcome, Workload  # noqa: F401


# A port taken between the OS handing it out and vLLM binding it is a race, not a fact about the config.
PORT_RETRIES = 2


def measure_config(spec: LaunchSpec, workload: Workload, on_started=None,
                   progress: bool = True) -> TrialOutcome:
    """Launch `spec`, wait for it, load-test it and stop it, whatever happens.

    `on_started(server)` runs right after the process exists (before readiness), so the caller can
    record its process group id: a tuner killed now leaves enough behind to stop the server later.
    """
    for attempt in range(PORT_RETRIES + 1):
        outcome = _measure_once(spec, workload, on_started, progress)
        if outcome.failure is None or outcome.failure.kind != "port_in_use" or spec.port:
            return outcome
    return outcome


def _measure_once(spec, workload, on_started, progress) -> TrialOutcome:
    from tuner.run.devices import PeakMemorySampler

    t0 = time.monotonic()
    # with a ballast, only the budget is free on the device while the server runs, as on the card
    ballast = (Ballast(spec.ballast_leave_bytes, env=spec.env) if spec.ballast_leave_bytes
               else contextlib.nullcontext())
    with ballast, ServerProcess(spec) as server, PeakMemorySampler(env=spec.env) as sampler:
        server.start()
        sampler.server_pgid = server.pgid
        if on_started is not None:
            on_started(server)
        ready = server.wait_ready()
        launch_s = time.monotonic() - t0
        logged = server.read_log()   # up to readiness (or the failure)
        base = TrialOutcome(params=spec.params, argv=tuple(server.argv), log_path=spec.log_path,
                            launch_s=launch_s, launch_preimport_s=server.warm_imported_s,
                            launch_phases=tuple(server.engine.launch_phases(logged).items()))
        if isinstance(ready, LaunchFailure):
            return replace(base, failure=ready, **_peaks(sampler))
        if spec.min_kv_tokens and ready.kv_cache_tokens and ready.kv_cache_tokens < spec.min_kv_tokens:
            # the [requirement] cannot be met whatever the load shows: no load test
            return replace(base, capacity=ready, **_peaks(sampler))
        t1 = time.monotonic()
        phases = run_load_test(server.base_url, spec.model, workload, progress=progress,
                               engine=spec.engine, alive=lambda: server.returncode is None)
        metrics = summarize(phases, workload)
        if metrics.requests_failed > metrics.rejected_for_length:
            # a server that dies closes its sockets before it has finished exiting: the requests
            # fail a moment before its exit code is there to read. Give it that moment.
            settle = time.monotonic() + 2.0
            while server.returncode is None and time.monotonic() < settle:
                time.sleep(0.05)
        died = None
        if server.returncode is not None:   # it exited under load: read its log again, classify
            died = died_under_load(server.read_log(), server.returncode, server.classify,
                                   load_started_at=len(logged))
        return replace(base, capacity=ready, metrics=metrics, load_s=time.monotonic() - t1,
                       server_exit_code=server.returncode, died_under_load=died, **_peaks(sampler))


def died_under_load(log_text: str, exit_code: int, classify,
                    load_started_at: int = 0) -> LaunchFailure:
    """Why a server exited during its load test, from what it logged from `load_started_at` (a
    character offset) on, so startup lines cannot decide it: the launch failure kinds of its
    engine's `classify` (vLLM's: a CUDA OOM is "oom"), else "crashed" with the exit code."""
    from tuner.run.process import log_tail

    found = classify(log_text[load_started_at:])
    if found is None:
        found = LaunchFailure(kind="crashed", message=f"the server exited with code {exit_code} "
                              "during the load test", log_tail=log_tail(log_text))
    return replace(found, exit_code=exit_code)


def _peaks(sampler) -> dict:
    """Peaks of the sampled GPUs (only those CUDA_VISIBLE_DEVICES shows the server)."""
    def peak(by_gpu: dict) -> int | None:
        return max(by_gpu.values()) if by_gpu else None

    return {"peak_gpu_memory_bytes": peak(sampler.peak_bytes),
            "peak_gpu_server_bytes": peak(sampler.server_peak_bytes),
            "peak_gpu_stranger_bytes": peak(sampler.stranger_peak_bytes)}
