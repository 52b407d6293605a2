"""The frozen records that cross rooms: launch spec and outcome, workload, request and phase results, metrics, trial outcome, platform.

Standard library only: reading a study file or a stored trial must not import a client, a
server or a plotting library.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The study's three objectives, in the order Optuna stores their values, and which way is better.
OBJECTIVES = ("single_stream_tok_s", "throughput_tok_s", "ttft_ms")
MAXIMIZE = {"single_stream_tok_s": True, "throughput_tok_s": True, "ttft_ms": False}

# ---------------------------------------------------------------- launching a server

@dataclass(frozen=True)
class LaunchSpec:
    """Everything needed to start one server."""

    model: str                         # model folder or HF id
    params: ServerParams               # tuned flags
    engine: str = "vllm"               # which engine (tuner.engines) launches it
    extra_args: tuple[str, ...] = ()   # fixed flags from the study, already split (argv items)
    engine_cmd: tuple[str, ...] = ()   # () = default: `vllm serve` when that works, else python -m api_server
    host: str = "127.0.0.1"
    port: int = 0                      # 0 = a free port from the OS
    # extra environment for the server; kept out of repr because it may hold VLLM_API_KEY
    env: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    launch_timeout_s: float = 600.0
    log_path: str = ""                 # where the full server log is written ("" = a temp file)
    stop_timeout_s: float = 30.0       # SIGTERM grace before SIGKILL of the whole group
    # > 0: a ballast process holds all of the device's free memory but this much while the server
    # runs (a memory budget emulated for real: tuner.run.ballast)
    ballast_leave_bytes: int = 0
    # > 0: a server whose KV cache holds fewer tokens is not load-tested (the [requirement]'s
    # sequences at its context cannot fit, whatever the load shows)
    min_kv_tokens: int = 0


@dataclass(frozen=True)
class LaunchFailure:
    """A launch that did not become ready, classified from vLLM's own messages."""

    kind: str      # oom | kv_cache_too_small | no_cache_blocks | insufficient_free_memory
                   # | startup_timeout | port_in_use | crashed
    message: str   # the line that decided the kind
    needed_gib: float | None = None
    available_gib: float | None = None
    estimated_max_model_len: int | None = None
    exit_code: int | None = None
    log_tail: str = ""
    verdict_s: float = 0.0  # seconds from start to verdict

    @property
    def is_memory(self) -> bool:
        return self.kind in MEMORY_FAILURES


# (cpu_offload is no launch failure: a server that offloads weights serves, and its measured speed
# against the roofline decides; see study.record_outcome)
MEMORY_FAILURES = frozenset({"oom", "kv_cache_too_small", "no_cache_blocks",
                             "insufficient_free_memory"})


@dataclass(frozen=True)
class Capacity:
    """Capacity facts vLLM logs (and /metrics exposes) once a server is ready."""

    weights_gib: float | None = None
    kv_cache_gib: float | None = None
    kv_cache_tokens: int | None = None
    max_concurrency: float | None = None   # at max-model-len
    num_gpu_blocks: int | None = None
    block_size: int | None = None
    ready_s: float = 0.0
    cache_config: tuple[tuple[str, str], ...] = ()   # labels of vllm:cache_config_info
    cpu_offload_gib: float | None = None   # weights the server logged as kept in host memory
    cuda_graph_gib: float | None = None    # "Graph capturing finished ..., took X GiB"
    cuda_graph_estimate_gib: float | None = None   # the graph estimate vLLM took out of the KV budget


# ---------------------------------------------------------------- the load test

@dataclass(frozen=True)
class Workload:
    """What the load test sends, the same for every config; read from the study file's [workload] table.

    The load levels: concurrency 1 (single-stream speed), then closed-loop concurrency `levels`
    (default: a ladder of powers of 4 up to `max_concurrency`), then open-loop Poisson
    `request_rates`. Every config meets exactly these levels, whatever its own flags.
    """

    prompt_tokens: int = 128
    output_tokens: int = 128
    warmup_requests: int = 2
    single_stream_requests: int = 8      # requests at concurrency 1
    levels: tuple[int, ...] = ()         # closed-loop concurrency levels above 1; () = ladder to max_concurrency
    request_rates: tuple[float, ...] = ()  # open-loop Poisson levels, requests/s
    ttft_level: int | None = None        # the level whose TTFT p50 is the objective; None = the top level
    waves: int = 4                       # a closed-loop level sends at least waves x concurrency requests ...
    throughput_requests: int = 32        # ... and at least this many (a rate level sends this many)
    # ... and keeps sending until it has run level_seconds (a steady state long enough to average
    # over engine steps, on a fast GPU too), at most max_waves x concurrency requests; a rate level
    # sends at least rate x level_seconds requests. 0 = no time floor.
    level_seconds: float = 0.0
    max_waves: int = 32
    max_concurrency: int = 64            # top of the default ladder
    concurrency: int | None = None       # old spelling of levels = [concurrency]
    request_rate: float | None = None    # old spelling of request_rates = [request_rate]
    request_timeout_s: float = 300.0
    endpoint: str = "completions"        # "completions" | "chat"
    max_failed_share: float = 0.05       # above this a level marks the trial load_test_failed
    # SLOs (ms, on p90): goodput counts requests meeting them; throughput is taken at the highest
    # level that meets them when any is set. None = no SLO on that metric
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    slo_e2e_ms: float | None = None
    seed: int = 0                        # prompts and Poisson arrivals
    # How often /metrics is sampled during a level for gauge peaks (KV usage, queue); None = only
    # before and after. Off by default: vLLM renders /metrics in the API server process that streams
    # every response, and on an H200 (8B shape, c=256) a sample every 2 s cost throughput and TPOT.
    metrics_poll_s: float | None = None
    # The lengths of the load levels' requests (warm-up and single stream keep prompt_tokens and
    # output_tokens: single-stream speed is defined at fixed lengths). "fixed" | "uniform" (the mix
    # holds low, high) | "normal" (mean, sd[, low, high]: clipped) | "trace" (drawn from the JSONL
    # file length_trace of {"prompt_tokens", "output_tokens"} lines). Drawn with `seed`, in plan
    # order, so every config meets the same sequence of lengths.
    length_mix: str = "fixed"
    prompt_tokens_mix: tuple[float, ...] = ()
    output_tokens_mix: tuple[float, ...] = ()
    length_trace: str = ""                 # resolved path of the trace (length_mix = "trace")
    # How a closed-loop level's slots start. "together": all at once, as `vllm bench serve
    # --max-concurrency` does; with fixed lengths the level then runs in waves that reach the server
    # as bursts, and TTFT p50 is a burst's prefill queue. "staggered": slot k starts k/c of a request's
    # time in (the previous level's median latency), so requests arrive spread over time.
    closed_loop_start: str = "together"


@dataclass(frozen=True)
class Requirement:
    """What the user must serve, from the study's [requirement] table: a config below it is infeasible.

    context_tokens: the context (prompt + output) one request must be able to hold, so
    max_model_len >= context_tokens. sequences_at_context: how many such requests the KV cache must
    hold at once (the launched server's KV cache tokens // context_tokens). None: no requirement.
    """

    context_tokens: int | None = None
    sequences_at_context: int | None = None


@dataclass(frozen=True)
class Level:
    """One load level of the workload: a phase of the load test."""

    name: str                            # "single_stream" | "c16" | "r2.5"
    concurrency: int                     # closed loop: requests in flight; open loop: the client's cap
    requests: int                        # at least this many (a closed level with a time floor may send more)
    request_rate: float | None = None    # open loop (Poisson arrivals), None for closed loop
    seconds: float = 0.0                 # closed loop: keep sending until the level has run this long ...
    max_requests: int = 0                # ... but no more than this many requests (0: `requests`)


@dataclass(frozen=True)
class RequestResult:
    """One request's outcome. Never an exception: failures are ok=False with a classified error.

    Failed requests keep what was measured before the failure (partial ttft/itl/latency).
    latency_s ends at the last content chunk, so latency_s - ttft_s == sum(itl_s).
    """

    ok: bool
    status: int | None = None         # HTTP status, None if no response
    error_kind: str = ""              # "" | http_error | rejected_for_length | connection | disconnected | timeout | bad_stream
    #                                   | server_error | truncated | no_usage | no_content | other
    error: str = ""                   # exception class and message, short
    prompt_tokens: int = 0            # from usage
    output_tokens: int = 0            # from usage
    start_s: float = 0.0              # request start, relative to the phase start
    ttft_s: float | None = None       # request start to first content
    itl_s: tuple[float, ...] = ()     # gaps between content chunks
    latency_s: float = 0.0            # request start to the last content chunk
    queued_s: float = 0.0             # open loop: scheduled arrival to send (counted in ttft/latency)


@dataclass(frozen=True)
class PhaseResult:
    name: str                         # "warmup" | "single_stream" | "throughput"
    concurrency: int
    wall_s: float
    requests: tuple[RequestResult, ...]
    server_metrics_before: tuple[tuple[str, float], ...] = ()   # selected /metrics samples
    server_metrics_after: tuple[tuple[str, float], ...] = ()
    server_metrics_peak: tuple[tuple[str, float], ...] = ()     # highest value of each gauge while it ran
    request_rate: float | None = None                            # open-loop rate, None for closed loop



# ---------------------------------------------------------------- what a load test measured

@dataclass(frozen=True)
class LevelMetrics:
    """One load level of one launch: the point of the config's throughput-latency curve."""

    name: str                              # "single_stream" | "c16" | "r2.5"
    concurrency: int
    request_rate: float | None = None
    requests: int = 0
    failed: int = 0
    output_tokens: int = 0                 # successful requests, from usage
    wall_s: float = 0.0                    # first request sent to last stream ended
    window_start_s: float | None = None    # the steady-state window (relative to the level's start)
    window_end_s: float | None = None
    steady: bool = False                   # False: too short for a steady state, or run in lockstep
                                           # waves (metrics.steady_window): whole-phase rate used
    throughput_tok_s: float | None = None  # output tok/s in the steady-state window
    throughput_tok_s_wall: float | None = None  # output tokens / wall_s (ramp-up and drain included)
    requests_per_s: float | None = None
    goodput_req_s: float | None = None
    meets_slos: bool | None = None         # p90 TTFT/TPOT/E2E within the workload's SLOs (None: none set)
    decode_tok_s: float | None = None      # median per-request (output - 1) / (latency - ttft)
    ttft_ms: float | None = None           # p50 of the requests sent in the steady window (all when none),
    ttft_ms_p90: float | None = None       # from request start (open loop: scheduled arrival)
    ttft_ms_p99: float | None = None
    ttft_ms_mean: float | None = None
    ttft_ms_all: float | None = None       # p50 over every request, the first wave's burst included
    ttft_requests: int = 0                 # requests the TTFT percentiles are over
    tpot_ms: float | None = None
    tpot_ms_p90: float | None = None
    itl_ms: float | None = None
    itl_ms_p90: float | None = None
    e2e_ms: float | None = None
    e2e_ms_p90: float | None = None
    preemptions: float | None = None
    kv_cache_usage_max: float | None = None
    num_requests_waiting_max: float | None = None
    server_ttft_ms_mean: float | None = None
    failure: str = ""                      # "" or why the level failed (share of failed requests)


@dataclass(frozen=True)
class LoadMetrics:
    """Everything a trial's load test measured, flat, ready for Optuna user attrs and CSV columns.

    Every config meets the same levels (the workload's, never its own flags). Definitions (client
    clock, warm-up excluded, tokens from `usage`):

    - `single_stream_tok_s`: at concurrency 1, median over requests of the decode rate
      (output_tokens - 1) / (latency - ttft). Spread: IQR of those per-request rates.
    - `throughput_tok_s`: steady-state output tok/s at the throughput level: the top closed-loop
      level, or with SLOs set the highest level whose p90s meet them (goodput); 0 when none does.
      Steady state: the window from the first completed request (ramp-up over) to the last request
      sent (drain starts), output tokens of content chunks arriving in it over its length.
    - `ttft_ms`: p50 TTFT at the workload's TTFT level (`ttft_level`, else the top level), from
      request start, so time queued in the server counts; open loop from the scheduled arrival.
      Steady state: over the requests sent inside the level's steady window (closed loop: the
      first wave, sent all at once at the level's start, is left out), over all when it has none.
      `ttft_ms_all` is the p50 over every request of that level (what `vllm bench serve` reports).
    - The TPOT/ITL/E2E percentiles, preemptions, KV usage and server cross-checks are those of the
      throughput level; `levels` holds every level's figures (the config's curve).
    - `error_rate`: failed / sent over every measured level.
    """

    single_stream_tok_s: float | None = None
    single_stream_tok_s_spread: float | None = None
    throughput_tok_s: float | None = None
    throughput_tok_s_wall: float | None = None
    ttft_ms: float | None = None          # p50 at the TTFT level
    ttft_ms_spread: float | None = None
    ttft_ms_p90: float | None = None
    ttft_ms_p99: float | None = None
    ttft_ms_mean: float | None = None
    ttft_ms_all: float | None = None      # p50 over every request of the TTFT level, first wave included
    single_stream_ttft_ms: float | None = None
    # "client" | "server_itl" or "server_decode" (the streams came in one read, the server's own
    # timing stood in) | "untimed" (they came in one read and the server exports no timing)
    single_stream_source: str = ""
    tpot_ms: float | None = None          # p50
    tpot_ms_p90: float | None = None
    tpot_ms_p99: float | None = None
    tpot_ms_mean: float | None = None
    itl_ms: float | None = None           # p50
    itl_ms_p90: float | None = None
    itl_ms_p99: float | None = None
    itl_ms_mean: float | None = None
    e2e_ms: float | None = None           # p50
    e2e_ms_mean: float | None = None
    e2e_ms_p90: float | None = None
    e2e_ms_p99: float | None = None
    requests_per_s: float | None = None
    goodput_req_s: float | None = None
    error_rate: float = 0.0
    concurrency: int | None = None        # the throughput level's concurrency
    throughput_level: str = ""
    ttft_level: str = ""
    steady: bool | None = None            # the throughput level had a steady-state window
    window_start_s: float | None = None
    window_end_s: float | None = None
    preemptions: float | None = None      # vllm:num_preemptions_total delta over every level
    kv_cache_usage_max: float | None = None
    load_test_failed: str = ""            # "" or the reason a level failed
    requests_sent: int = 0                # every measured level
    requests_failed: int = 0
    output_tokens_total: int = 0          # throughput level, from usage
    throughput_wall_s: float | None = None
    num_requests_waiting_max: float | None = None
    server_ttft_ms_mean: float | None = None
    server_itl_ms_mean: float | None = None
    error_kinds: str = ""                 # e.g. "timeout:3,http_error:1" over all phases
    top_error: str = ""                   # the most common error of failed requests, one line
    rejected_for_length: int = 0          # requests the server refused as longer than its context
    levels: tuple[LevelMetrics, ...] = ()


# ---------------------------------------------------------------- one trial, and where it ran

@dataclass(frozen=True)
class TrialOutcome:
    """What launching and load-testing one config produced. Exactly one of failure/metrics decides."""

    params: ServerParams                 # as launched (after any memory-budget scaling)
    argv: tuple[str, ...] = ()
    log_path: str = ""
    failure: LaunchFailure | None = None
    capacity: Capacity | None = None
    metrics: LoadMetrics | None = None
    launch_s: float = 0.0
    # seconds of each launch phase the engine's log names, in launch order: (("weights", 1.5), ...)
    launch_phases: tuple[tuple[str, float], ...] = ()
    # a warm start (run/spare.py): seconds the engine's imports took ahead of launch_s; None = cold
    launch_preimport_s: float | None = None
    load_s: float = 0.0
    peak_gpu_memory_bytes: int | None = None     # used on the server's GPU (everyone's)
    peak_gpu_server_bytes: int | None = None     # of it, held by the server's process group
    peak_gpu_stranger_bytes: int | None = None   # of it, held by other processes
    server_exit_code: int | None = None          # set when the server died during the load test
    died_under_load: LaunchFailure | None = None  # then: its log, classified like a launch failure

    @property
    def failure_kind(self) -> str:
        if self.failure is not None:
            return self.failure.kind
        if self.died_under_load is not None:
            return self.died_under_load.kind + "_under_load"
        if self.metrics is not None and self.metrics.load_test_failed:
            return "load_test_failed"
        return ""



@dataclass(frozen=True)
class Platform:
    """Where trials run: the device, its memory and bandwidth, the engine and the vLLM version."""

    kind: str                      # "cuda" | "cpu"
    device_name: str
    memory_total_bytes: int
    bandwidth_gbps: float | None
    engine: tuple[str, ...]
    vllm_version: str
    pcie_gbps: float | None = None   # host-to-device link, for weights offloaded to host memory


def is_feasible(t) -> bool:
    """An Optuna trial that measured a config meeting every constraint: COMPLETE, no failure recorded,
    every constraint <= 0 (Optuna's own feasibility rule)."""
    return (t.state.name == "COMPLETE" and not t.user_attrs.get("failure")
            and all(v <= 0 for v in t.constraints.values()))
