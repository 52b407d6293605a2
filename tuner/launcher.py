"""vLLM server lifecycle: start in its own process group, watch the log, classify failures, stop."""

from __future__ import annotations

from dataclasses import dataclass, field

from tuner.space import ServerParams

# SKELETON (owner: launcher helper). Interfaces below are the contract used by study.py.


@dataclass(frozen=True)
class LaunchSpec:
    """Everything needed to start one vLLM server."""

    model: str                         # model folder or HF id
    params: ServerParams               # tuned flags
    extra_args: tuple[str, ...] = ()   # fixed flags from the study, already split (argv items)
    engine_cmd: tuple[str, ...] = ()   # () = default: `vllm serve` when that works, else python -m api_server
    host: str = "127.0.0.1"
    port: int = 0                      # 0 = a free port from the OS
    env: tuple[tuple[str, str], ...] = ()   # extra environment for the server
    launch_timeout_s: float = 600.0
    log_path: str = ""                 # where the full server log is written ("" = a temp file)


@dataclass(frozen=True)
class LaunchFailure:
    """A launch that did not become ready, classified from vLLM's own messages."""

    kind: str      # oom | kv_cache_too_small | no_cache_blocks | insufficient_free_memory | cpu_offload
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


MEMORY_FAILURES = frozenset({"oom", "kv_cache_too_small", "no_cache_blocks",
                             "insufficient_free_memory", "cpu_offload"})


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


def classify(log_text: str) -> LaunchFailure | None:
    """The failure a server log shows, or None if it shows none."""
    raise NotImplementedError


def parse_capacity(log_text: str) -> Capacity:
    raise NotImplementedError


class ServerProcess:
    """One vLLM server. Use as a context manager: leaving it always stops the whole process group.

        with ServerProcess(spec) as server:
            server.start()                    # sets server.pid, server.pgid, server.base_url
            outcome = server.wait_ready()     # Capacity | LaunchFailure
    """

    def __init__(self, spec: LaunchSpec):
        self.spec = spec
        self.pid: int | None = None
        self.pgid: int | None = None
        self.port: int | None = None
        self.base_url: str = ""
        self.argv: list[str] = []

    def start(self) -> None:
        raise NotImplementedError

    def wait_ready(self) -> Capacity | LaunchFailure:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
