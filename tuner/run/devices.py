"""NVML facts of the GPUs CUDA_VISIBLE_DEVICES shows: memory, bandwidth, dtype support, memory sampling, who holds a GPU. No GPU is a clean answer."""

from __future__ import annotations

import json
import os
import re
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

from tuner.errors import TunerError

GIB = 1024 ** 3


@dataclass(frozen=True)
class GpuInfo:
    index: int                            # NVML index of the physical GPU (PCI bus order)
    name: str
    memory_total_bytes: int
    memory_free_bytes: int
    memory_bandwidth_gbps: float | None   # 2 x max memory clock x bus width / 8, or the known-card table
    uuid: str = ""
    compute_capability: tuple[int, int] | None = None
    mig_index: int | None = None          # a MIG instance of GPU `index` (CUDA_VISIBLE_DEVICES=MIG-...)
    cuda_index: int | None = None         # its CUDA ordinal in the server's environment (0 = vLLM's)
    pcie_bandwidth_gbps: float | None = None   # host link, one direction: generation x lanes

    @property
    def label(self) -> str:
        return f"GPU {self.index}" + (f" MIG {self.mig_index}" if self.mig_index is not None else "")

    @property
    def has_bfloat16(self) -> bool | None:
        """Compute capability 8.0 (Ampere) and later run bfloat16; None when NVML did not say."""
        return None if self.compute_capability is None else self.compute_capability >= (8, 0)


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_bytes: int
    cmdline: str


class GpuBusy(TunerError):
    """Other processes hold GPU memory a trial needs."""

    def __init__(self, index: int, needed_bytes: int, free_bytes: int, holders: list[GpuProcess],
                 label: str = ""):
        self.index, self.needed_bytes, self.free_bytes, self.holders = index, needed_bytes, free_bytes, holders
        who = ", ".join(f"pid {p.pid} ({p.used_bytes / GIB:.1f} GiB{': ' + p.cmdline[:60] if p.cmdline else ''})"
                        for p in holders) or "processes NVML cannot name (another container?)"
        super().__init__(f"{label or f'GPU {index}'} is busy: the trial needs {needed_bytes / GIB:.1f} GiB free but only "
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


# PCIe GB/s per lane and direction after line encoding, by generation (PCI-SIG figures).
PCIE_LANE_GBPS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}


def pcie_bandwidth_gbps(generation: int | None, lanes: int | None) -> float | None:
    """Peak host-to-device PCIe bandwidth of a link (what weights offloaded to host memory cross)."""
    if not generation or not lanes or generation not in PCIE_LANE_GBPS or lanes <= 0:
        return None
    return round(PCIE_LANE_GBPS[generation] * lanes, 1)


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


def _capability(nvml, handle) -> tuple[int, int] | None:
    try:
        major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
        return int(major), int(minor)
    except Exception:
        return None


def _uuid(nvml, handle) -> str:
    try:
        return _text(nvml.nvmlDeviceGetUUID(handle))
    except Exception:
        return ""


def _info(nvml, index: int, handle, mig_index: int | None = None, parent=None) -> GpuInfo | None:
    """The facts of one NVML handle; a MIG instance takes name, clocks and capability from its GPU."""
    try:
        name = _text(nvml.nvmlDeviceGetName(parent if parent is not None else handle))
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
    except Exception:
        return None
    board = parent if parent is not None else handle
    try:
        clock = nvml.nvmlDeviceGetMaxClockInfo(board, nvml.NVML_CLOCK_MEM)
    except Exception:
        clock = None
    try:
        bus = nvml.nvmlDeviceGetMemoryBusWidth(board)
    except Exception:
        bus = None
    try:   # the most the GPU and the slot it sits in both do
        link = (nvml.nvmlDeviceGetMaxPcieLinkGeneration(board), nvml.nvmlDeviceGetMaxPcieLinkWidth(board))
    except Exception:
        link = (None, None)
    return GpuInfo(index=index, name=name, memory_total_bytes=int(memory.total),
                   memory_free_bytes=int(memory.free),
                   memory_bandwidth_gbps=memory_bandwidth_gbps(name, clock, bus),
                   uuid=_uuid(nvml, handle), compute_capability=_capability(nvml, board),
                   mig_index=mig_index, pcie_bandwidth_gbps=pcie_bandwidth_gbps(*link))


def all_gpus() -> list[GpuInfo]:
    """Every GPU NVML sees, in NVML (PCI bus) order, whatever CUDA_VISIBLE_DEVICES says."""
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
        except Exception:
            continue
        info = _info(nvml, index, handle)
        if info is not None:
            found.append(info)
    return found


def _mig_devices(nvml, gpu: GpuInfo) -> list[GpuInfo]:
    """The MIG instances of one GPU ([] when MIG is off or NVML cannot tell)."""
    try:
        parent = nvml.nvmlDeviceGetHandleByIndex(gpu.index)
        current, _pending = nvml.nvmlDeviceGetMigMode(parent)
        if not current:
            return []
        count = nvml.nvmlDeviceGetMaxMigDeviceCount(parent)
    except Exception:
        return []
    found = []
    for mig in range(int(count)):
        try:
            handle = nvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, mig)
        except Exception:
            continue   # an empty slot
        info = _info(nvml, gpu.index, handle, mig_index=mig, parent=parent)
        if info is not None:
            found.append(info)
    return found


@dataclass(frozen=True)
class Visibility:
    """The GPUs a server started with this environment can use, in CUDA order ([0] is vLLM's)."""

    setting: str | None                 # CUDA_VISIBLE_DEVICES as the server sees it; None = unset
    source: str                         # "study env", "environment" or "unset"
    devices: tuple[GpuInfo, ...]
    hidden: tuple[GpuInfo, ...] = ()    # GPUs NVML sees that CUDA_VISIBLE_DEVICES leaves out
    note: str = ""                      # entries CUDA ignores, or an order NVML cannot reproduce


def server_environment(env=None) -> dict[str, str]:
    """os.environ under the study's `[server] env` (pairs or a mapping), as the launcher builds it."""
    return {**os.environ, **dict(env or ())}


def visibility(env=None) -> Visibility:
    """Map CUDA_VISIBLE_DEVICES (the study's `[server] env` over this process's environment) to NVML.

    Order: integers are read as NVML indices, i.e. PCI bus order. That is CUDA's order only with
    CUDA_DEVICE_ORDER=PCI_BUS_ID; CUDA's default, FASTEST_FIRST, ranks by an undocumented speed
    heuristic NVML cannot reproduce. On a host of identical GPUs (the usual case) FASTEST_FIRST
    breaks every tie by PCI bus id, so the two agree; vLLM makes the same assumption
    (`device_id_to_physical_device_id` in vllm/platforms/interface.py feeds the integers to NVML).
    On a mixed host without PCI_BUS_ID the note says so. Entries follow CUDA's rules: an integer,
    `GPU-<uuid>` or `MIG-<uuid>` (a unique prefix is enough), whitespace ignored, and the first
    entry naming no device hides it and every entry after it; an empty string hides every GPU.
    """
    server_env = server_environment(env)
    setting = server_env.get("CUDA_VISIBLE_DEVICES")
    study = dict(env or ())
    source = ("study env" if "CUDA_VISIBLE_DEVICES" in study
              else "environment" if setting is not None else "unset")
    every = all_gpus()
    if setting is None:
        return Visibility(None, source, tuple(replace(g, cuda_index=i) for i, g in enumerate(every)),
                          note=_order_note(every, server_env, integers=True))
    nvml = _nvml()
    chosen: list[GpuInfo] = []
    notes: list[str] = []
    integers = False
    entries = [e.strip() for e in setting.split(",")] if setting.strip() else []
    for position, entry in enumerate(entries):
        found = _match(nvml, entry, every)
        if isinstance(found, str):
            rest = entries[position + 1:]
            notes.append(f"CUDA_VISIBLE_DEVICES entry {entry!r} {found}: CUDA ignores it"
                         + (f" and {', '.join(rest)} after it" if rest else ""))
            break
        if any((g.index, g.mig_index) == (found.index, found.mig_index) for g in chosen):
            notes.append(f"CUDA_VISIBLE_DEVICES names {found.label} twice")
            break
        integers = integers or entry.lstrip("-").isdigit()
        chosen.append(replace(found, cuda_index=len(chosen)))
    order = _order_note(chosen, server_env, integers)
    seen = {g.index for g in chosen}
    hidden = tuple(g for g in every if g.index not in seen)
    return Visibility(setting, source, tuple(chosen), hidden, "; ".join(notes + ([order] if order else [])))


def _match(nvml, entry: str, every: list[GpuInfo]) -> GpuInfo | str:
    """The device one CUDA_VISIBLE_DEVICES entry names, or why it names none."""
    if entry.lstrip("-").isdigit():
        n = int(entry)
        found = [g for g in every if g.index == n]
        return found[0] if found else f"is not an NVML index (NVML sees {len(every)} GPUs)"
    if entry.startswith("GPU-"):
        pool, prefix = every, entry
    elif entry.startswith("MIG-GPU-") or "/" in entry:
        return "is the old MIG-GPU-<uuid>/<gi>/<ci> form, which tuner does not read (use MIG-<uuid>)"
    elif entry.startswith("MIG-"):
        pool = [m for g in every for m in _mig_devices(nvml, g)]
        prefix = entry
    else:
        return "is neither an index nor a GPU-/MIG- UUID"
    found = [g for g in pool if g.uuid and g.uuid.startswith(prefix)]
    if len(found) > 1:
        return f"matches {len(found)} devices"
    return found[0] if found else "matches no device NVML sees"


def _order_note(devices: list[GpuInfo], server_env: dict, integers: bool) -> str:
    if not integers or server_env.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID":
        return ""
    if len({g.name for g in devices}) <= 1:
        return ""
    return ("the GPUs differ and CUDA_DEVICE_ORDER is not PCI_BUS_ID: CUDA numbers them fastest "
            "first, tuner and vLLM in PCI bus order; set CUDA_DEVICE_ORDER=PCI_BUS_ID in [server] env")


def gpus(env=None) -> list[GpuInfo]:
    """The GPUs a server started with the study's `env` sees, in CUDA order: [0] is the one vLLM
    uses. [] when there is no NVML, no GPU, or CUDA_VISIBLE_DEVICES hides them all."""
    return list(visibility(env).devices)


def _handle(nvml, device):
    """NVML handle of a GpuInfo (MIG instances included) or of a plain NVML index."""
    if isinstance(device, GpuInfo):
        handle = nvml.nvmlDeviceGetHandleByIndex(device.index)
        if device.mig_index is not None:
            handle = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, device.mig_index)
        return handle
    return nvml.nvmlDeviceGetHandleByIndex(device)


def _used_by_pid(nvml, handle) -> dict[int, int]:
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
    return by_pid


def gpu_processes(device: "int | GpuInfo" = 0) -> list[GpuProcess]:
    """Processes holding memory on `device` (an NVML index or a GpuInfo; compute and graphics);
    [] without NVML."""
    nvml = _nvml()
    if nvml is None:
        return []
    try:
        handle = _handle(nvml, device)
    except Exception:
        return []
    return [GpuProcess(pid=pid, used_bytes=used, cmdline=_cmdline(pid))
            for pid, used in sorted(_used_by_pid(nvml, handle).items())]


def memory_used_bytes(device: "int | GpuInfo" = 0) -> int | None:
    nvml = _nvml()
    if nvml is None:
        return None
    try:
        return int(nvml.nvmlDeviceGetMemoryInfo(_handle(nvml, device)).used)
    except Exception:
        return None


def _pgid(pid: int) -> int | None:
    """Process group of `pid` from /proc (None for a process of another PID namespace)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()
    try:
        return int(fields[2])
    except (IndexError, ValueError):
        return None


# ---------------------------------------------------------------------------------------------
# Busy GPUs.

def required_bytes(gpu: GpuInfo, gpu_memory_utilization: float) -> int:
    """Free memory vLLM demands at startup: gpu-memory-utilization x total memory."""
    return int(gpu.memory_total_bytes * gpu_memory_utilization)


def check_gpu_free(needed_bytes: int, index: int | None = None,
                   own_pids: frozenset[int] | set[int] = frozenset(), wait_s: float = 0.0,
                   poll_s: float = 2.0, env=None) -> None:
    """Return when the server's GPU has `needed_bytes` free; else wait up to `wait_s` for it, then
    raise `GpuBusy` naming the processes (other than `own_pids`) holding memory.

    The GPU is NVML index `index`, or by default the first one CUDA_VISIBLE_DEVICES (of `env`, the
    study's `[server] env`, over this process's environment) shows. No GPU: returns at once."""
    deadline = time.monotonic() + wait_s
    while True:
        if index is None:
            found = gpus(env)[:1]
        else:
            found = [g for g in all_gpus() if g.index == index]
        if not found:
            return
        gpu = found[0]
        if gpu.memory_free_bytes >= needed_bytes:
            return
        if time.monotonic() >= deadline:
            holders = [p for p in gpu_processes(gpu) if p.pid not in own_pids]
            raise GpuBusy(gpu.index, needed_bytes, gpu.memory_free_bytes, holders, label=gpu.label)
        time.sleep(poll_s)


# ---------------------------------------------------------------------------------------------
# Peak memory during a trial.

class PeakMemorySampler:
    """Samples used memory of the server's GPUs in a thread, split into what the server's process
    group holds and what other processes ("strangers") hold.

        with PeakMemorySampler(env=spec.env) as sampler:
            server.start(); sampler.server_pgid = server.pgid
            ...run the trial...
        sampler.peak_bytes            # NVML index -> peak used memory; {} when there is no GPU
        sampler.server_peak_bytes     # NVML index -> peak held by the server's processes
        sampler.stranger_peak_bytes   # NVML index -> peak held by everyone else
        sampler.strangers             # pid -> the most each stranger held

    The devices are `devices` (GpuInfo or NVML indices), by default those CUDA_VISIBLE_DEVICES of
    `env` shows. A process NVML names but /proc cannot place (another PID namespace: a container
    without the host's PIDs) counts as a stranger, since it is not provably the server's.
    """

    def __init__(self, devices: list | None = None, interval_s: float = 0.2, env=None,
                 server_pgid: int | None = None):
        self.devices = devices
        self.interval_s = interval_s
        self.env = env
        self.server_pgid = server_pgid
        self.peak_bytes: dict[int, int] = {}
        self.server_peak_bytes: dict[int, int] = {}
        self.stranger_peak_bytes: dict[int, int] = {}
        self.strangers: dict[int, GpuProcess] = {}
        self.samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def indices(self) -> list[int] | None:
        if self.devices is None:
            return None
        return [d.index if isinstance(d, GpuInfo) else int(d) for d in self.devices]

    @property
    def peak_gib(self) -> float | None:
        """The highest single-GPU peak in GiB, or None with no samples."""
        return max(self.peak_bytes.values()) / GIB if self.peak_bytes else None

    def sample(self) -> None:
        nvml = _nvml()
        devices = self.devices if self.devices is not None else gpus(self.env)
        for device in devices:
            # a MIG instance is keyed by its GPU's index: one server uses one instance
            index = device.index if isinstance(device, GpuInfo) else int(device)
            used = memory_used_bytes(device)
            if used is None:
                continue
            self.peak_bytes[index] = max(self.peak_bytes.get(index, 0), used)
            if nvml is None:
                continue
            try:
                by_pid = _used_by_pid(nvml, _handle(nvml, device))
            except Exception:
                continue
            pgid = self.server_pgid
            own = stranger = 0
            for pid, held in by_pid.items():
                if pgid is not None and _pgid(pid) == pgid:
                    own += held
                    continue
                stranger += held
                if held >= getattr(self.strangers.get(pid), "used_bytes", -1):
                    self.strangers[pid] = GpuProcess(pid, held, _cmdline(pid))
            self.server_peak_bytes[index] = max(self.server_peak_bytes.get(index, 0), own)
            self.stranger_peak_bytes[index] = max(self.stranger_peak_bytes.get(index, 0), stranger)
        self.samples += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def start(self) -> "PeakMemorySampler":
        if _nvml() is None:
            return self   # nothing to sample; no thread
        if self.devices is None:
            self.devices = gpus(self.env)
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


# ---------------------------------------------------------------------------------------------
# dtype by device.

@dataclass(frozen=True)
class DtypeChoice:
    """The --dtype a model should run with on a device: `dtype` None leaves vLLM's `auto`."""

    dtype: str | None
    reason: str

    @property
    def flags(self) -> list[str]:
        return ["--dtype", self.dtype] if self.dtype else []


# vLLM 0.32 refuses float16 for these model types (_FLOAT16_NOT_SUPPORTED_MODELS, numerical
# instability): on a card without bfloat16 they run in float32 or not at all.
FLOAT16_UNSUPPORTED_MODEL_TYPES = ("gemma2", "gemma3", "gemma3_text", "glm4")


def model_dtype(config: dict) -> str | None:
    """The weights' dtype a config.json declares (`torch_dtype`, or `dtype` in newer transformers;
    the text model's for multimodal configs), or None when it says nothing."""
    for part in (config, config.get("text_config") or {}):
        for key in ("torch_dtype", "dtype"):
            value = part.get(key)
            if isinstance(value, str) and value:
                return value.removeprefix("torch.")
    return None


def supported_dtype(device: GpuInfo | None, model_config: dict,
                    extra_args: tuple[str, ...] | list[str] = ()) -> DtypeChoice:
    """The dtype the model must run with on `device` (None = the CPU build, or no GPU).

    A bfloat16 model (or one whose config names no dtype: vLLM reads that as float32 and picks
    bfloat16 on cards that have it) needs --dtype float16 on a card of compute capability < 8.0
    (V100 is 7.0, T4 7.5), which has no bfloat16 units. The user's own --dtype always wins.
    """
    given = flag_value(extra_args, "--dtype")
    if given is not None:
        return DtypeChoice(None, f"--dtype {given} from [server] extra_args")
    declared = model_dtype(model_config)
    if device is None:
        served = ("; vLLM 0.32's --dtype auto serves a 32-bit config as bfloat16"
                  if declared in (None, "float32") else "")
        return DtypeChoice(None, f"{declared or 'no dtype'} in config.json; no GPU: vLLM's CPU "
                                 f"build picks{served}")
    cc = device.compute_capability
    where = f"{device.name} (compute {cc[0]}.{cc[1]})" if cc else device.name
    if device.has_bfloat16 is None:
        return DtypeChoice(None, f"{declared or 'no dtype'} in config.json; NVML gave no "
                                 f"compute capability for {device.name}")
    if device.has_bfloat16 or declared not in (None, "bfloat16"):
        return DtypeChoice(None, f"{declared or 'no dtype (float32)'} in config.json runs on {where}")
    if model_config.get("model_type") in FLOAT16_UNSUPPORTED_MODEL_TYPES:
        return DtypeChoice("float32", f"{where} has no bfloat16 and vLLM refuses float16 for "
                                      f"{model_config.get('model_type')}")
    return DtypeChoice("float16", f"{where} has no bfloat16")


# The least compute capability of weight-only quantization kernels, as vLLM's QuantizationConfig
# .get_min_capability gives it (awq 75, gptq 60 in vllm/model_executor/layers/quantization/ of
# 0.24 and 0.32); a card below it refuses every launch ("Minimum capability: 75. Current
# capability: 70."). Methods not listed are not checked.
MIN_CAPABILITY = {"awq": (7, 5), "gptq": (6, 0)}


def quantization_problem(device: GpuInfo | None, model_config: dict,
                         extra_args: tuple[str, ...] | list[str] = ()) -> str | None:
    """Why vLLM cannot serve the model's quantization on `device` (one line), or None: a V100
    (compute 7.0) has no AWQ kernels. The CPU build and cards NVML gave no capability for: None."""
    if device is None or device.compute_capability is None:
        return None
    q = model_config.get("quantization_config") or {}
    method = flag_value(extra_args, "--quantization") or (q.get("quant_method") if isinstance(q, dict) else None)
    need = MIN_CAPABILITY.get(str(method or "").lower())
    cc = device.compute_capability
    if need is None or cc >= need:
        return None
    return (f"{method} needs compute capability {need[0]}.{need[1]} in vLLM; {device.name} has "
            f"{cc[0]}.{cc[1]}, so every launch would fail: use a checkpoint of another "
            f"quantization (GPTQ runs from 6.0) or a card of compute {need[0]}.{need[1]} or more")


def dtype_flags(model_dir, device: GpuInfo | None, extra_args: tuple[str, ...] | list[str] = ()) -> list[str]:
    """The fixed flags (["--dtype", "float16"] or []) for the model in `model_dir` on `device`.

    A folder without a readable config.json (an HF id not downloaded yet) gets none: vLLM's own
    `auto` then falls back with a warning."""
    try:
        config = json.loads((Path(model_dir).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return []
    return supported_dtype(device, config, extra_args).flags


def flag_value(argv, flag: str) -> str | None:
    """The value of `flag` in an argv list (`--flag v` or `--flag=v`), the last one winning."""
    value = None
    argv = list(argv)
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def machine_id() -> str:
    """Which machine a launch ran on, as trials record it: the kernel's boot id (shared by the
    containers of one host; a new one after a reboot), else the host name. A study resumed on
    another machine measures there; figures from two machines compare only as far as the machines do."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip().split("-")[0]
    except OSError:
        import socket

        return socket.gethostname()
