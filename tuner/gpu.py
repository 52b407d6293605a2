"""NVML facts: GPUs, memory, bandwidth estimate, memory sampling, processes holding a GPU. No GPU is a clean answer."""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tuner.errors import TunerError

GIB = 1024 ** 3


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    memory_total_bytes: int
    memory_free_bytes: int
    memory_bandwidth_gbps: float | None   # 2 x max memory clock x bus width / 8, or the known-card table


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_bytes: int
    cmdline: str


class GpuBusy(TunerError):
    """Other processes hold GPU memory a trial needs."""

    def __init__(self, index: int, needed_bytes: int, free_bytes: int, holders: list[GpuProcess]):
        self.index, self.needed_bytes, self.free_bytes, self.holders = index, needed_bytes, free_bytes, holders
        who = ", ".join(f"pid {p.pid} ({p.used_bytes / GIB:.1f} GiB{': ' + p.cmdline[:60] if p.cmdline else ''})"
                        for p in holders) or "processes NVML cannot name (another container?)"
        super().__init__(f"GPU {index} is busy: the trial needs {needed_bytes / GIB:.1f} GiB free but only "
                         f"{free_bytes / GIB:.1f} GiB is; held by {who}. Stop them or lower "
                         f"--gpu-memory-utilization")


# Peak memory bandwidth of known cards, GB/s (vendor datasheets). Most specific names first:
# NVML spells names like "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB", "Tesla T4".
KNOWN_BANDWIDTH_GBPS: tuple[tuple[str, float], ...] = (
    (r"GH200", 4000.0),
    (r"H200", 4800.0),
    (r"H100.*PCIe", 2000.0),
    (r"H100.*NVL", 3900.0),
    (r"H100", 3350.0),             # SXM5, "NVIDIA H100 80GB HBM3"
    (r"H800.*PCIe", 2000.0),
    (r"H800", 3350.0),
    (r"H20\b", 4000.0),
    (r"B200", 8000.0),
    (r"A100.*80\s*GB.*PCIe|A100.*PCIe.*80\s*GB", 1935.0),
    (r"A100.*80\s*GB", 2039.0),
    (r"A100", 1555.0),             # 40GB, SXM4 and PCIe
    (r"A800.*80\s*GB", 2039.0),
    (r"A40\b", 696.0),
    (r"A30\b", 933.0),
    (r"A10G?\b", 600.0),
    (r"L40S?\b", 864.0),
    (r"L4\b", 300.0),
    (r"V100", 900.0),
    (r"T4\b", 320.0),
    (r"RTX 4090", 1008.0),
    (r"RTX 3090", 936.0),
    (r"RTX 6000 Ada", 960.0),
    (r"RTX A6000", 768.0),
)

# where the formula and the table disagree by more than this, NVML's clocks are not trusted
_TABLE_WINS_ABOVE = 0.25


def known_bandwidth_gbps(name: str) -> float | None:
    for pattern, gbps in KNOWN_BANDWIDTH_GBPS:
        if re.search(pattern, name, re.I):
            return gbps
    return None


def memory_bandwidth_gbps(name: str, clock_mhz: float | None, bus_bits: int | None) -> float | None:
    """Peak memory bandwidth: 2 x max memory clock x bus width / 8 (double data rate; NVML reports
    the effective clock for GDDR so the same formula holds), cross-checked with the known-card table,
    which wins when the two disagree by more than 25% or when NVML gives no clocks."""
    computed = None
    if clock_mhz and bus_bits and clock_mhz > 0 and bus_bits > 0:
        computed = 2.0 * clock_mhz * 1e6 * bus_bits / 8 / 1e9
    known = known_bandwidth_gbps(name)
    if known is None:
        return round(computed, 1) if computed is not None else None
    if computed is None or abs(computed - known) / known > _TABLE_WINS_ABOVE:
        return known
    return round(computed, 1)


# ---------------------------------------------------------------------------------------------
# NVML access. Initialised once; any NVML error reads as "no GPU".

_nvml_state: dict[str, object] = {}
_nvml_lock = threading.Lock()


def _nvml():
    """The initialised pynvml module, or None when there is no NVML or no driver."""
    with _nvml_lock:
        if "module" in _nvml_state:
            return _nvml_state["module"]
        module = None
        try:
            import pynvml
            pynvml.nvmlInit()
            module = pynvml
        except Exception:  # ImportError, NVMLError_LibraryNotFound, DriverNotLoaded, ...
            module = None
        _nvml_state["module"] = module
        return module


def reset_nvml() -> None:
    """Forget NVML's state (tests; a driver that appeared meanwhile)."""
    with _nvml_lock:
        _nvml_state.clear()


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""   # a process of another container or user


def gpus() -> list[GpuInfo]:
    """All GPUs NVML sees; [] when there is no NVML or no GPU."""
    nvml = _nvml()
    if nvml is None:
        return []
    try:
        count = nvml.nvmlDeviceGetCount()
    except Exception:
        return []
    found = []
    for index in range(count):
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            name = _text(nvml.nvmlDeviceGetName(handle))
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        except Exception:
            continue
        try:
            clock = nvml.nvmlDeviceGetMaxClockInfo(handle, nvml.NVML_CLOCK_MEM)
        except Exception:
            clock = None
        try:
            bus = nvml.nvmlDeviceGetMemoryBusWidth(handle)
        except Exception:
            bus = None
        found.append(GpuInfo(index=index, name=name, memory_total_bytes=int(memory.total),
                             memory_free_bytes=int(memory.free),
                             memory_bandwidth_gbps=memory_bandwidth_gbps(name, clock, bus)))
    return found


def gpu_processes(index: int = 0) -> list[GpuProcess]:
    """Processes holding memory on GPU `index` (compute and graphics); [] without NVML."""
    nvml = _nvml()
    if nvml is None:
        return []
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
    except Exception:
        return []
    by_pid: dict[int, int] = {}
    for getter in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
        try:
            processes = getattr(nvml, getter)(handle)
        except Exception:
            continue
        for process in processes:
            used = getattr(process, "usedGpuMemory", None)
            # NVML says "not available" with None or a huge sentinel value
            used = int(used) if isinstance(used, int) and 0 <= used < 1 << 60 else 0
            by_pid[int(process.pid)] = max(by_pid.get(int(process.pid), 0), used)
    return [GpuProcess(pid=pid, used_bytes=used, cmdline=_cmdline(pid)) for pid, used in sorted(by_pid.items())]


def memory_used_bytes(index: int = 0) -> int | None:
    nvml = _nvml()
    if nvml is None:
        return None
    try:
        return int(nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(index)).used)
    except Exception:
        return None


# ---------------------------------------------------------------------------------------------
# Busy GPUs.

def required_bytes(gpu: GpuInfo, gpu_memory_utilization: float) -> int:
    """Free memory vLLM demands at startup: gpu-memory-utilization x total memory."""
    return int(gpu.memory_total_bytes * gpu_memory_utilization)


def check_gpu_free(needed_bytes: int, index: int = 0, own_pids: frozenset[int] | set[int] = frozenset(),
                   wait_s: float = 0.0, poll_s: float = 2.0) -> None:
    """Return when GPU `index` has `needed_bytes` free; else wait up to `wait_s` for it, then raise
    `GpuBusy` naming the processes (other than `own_pids`) holding memory. No GPU: returns at once."""
    deadline = time.monotonic() + wait_s
    while True:
        found = [g for g in gpus() if g.index == index]
        if not found:
            return
        gpu = found[0]
        if gpu.memory_free_bytes >= needed_bytes:
            return
        if time.monotonic() >= deadline:
            holders = [p for p in gpu_processes(index) if p.pid not in own_pids]
            raise GpuBusy(index, needed_bytes, gpu.memory_free_bytes, holders)
        time.sleep(poll_s)


# ---------------------------------------------------------------------------------------------
# Peak memory during a trial.

class PeakMemorySampler:
    """Samples used memory of the given GPUs in a thread; `peak_bytes` maps index -> peak used.

        with PeakMemorySampler() as sampler:
            ...run the trial...
        sampler.peak_bytes   # {} when there is no GPU
    """

    def __init__(self, indices: list[int] | None = None, interval_s: float = 0.2):
        self.indices = indices
        self.interval_s = interval_s
        self.peak_bytes: dict[int, int] = {}
        self.samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def peak_gib(self) -> float | None:
        """The highest single-GPU peak in GiB, or None with no samples."""
        return max(self.peak_bytes.values()) / GIB if self.peak_bytes else None

    def sample(self) -> None:
        indices = self.indices if self.indices is not None else [g.index for g in gpus()]
        for index in indices:
            used = memory_used_bytes(index)
            if used is not None:
                self.peak_bytes[index] = max(self.peak_bytes.get(index, 0), used)
        self.samples += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def start(self) -> "PeakMemorySampler":
        if _nvml() is None:
            return self   # nothing to sample; no thread
        if self.indices is None:
            self.indices = [g.index for g in gpus()]
        self._thread = threading.Thread(target=self._run, name="gpu-peak-memory", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> dict[int, int]:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self.sample()   # the last moment counts too
        return dict(self.peak_bytes)

    def __enter__(self) -> "PeakMemorySampler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
