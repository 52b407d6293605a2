"""NVML facts: GPUs, memory, bandwidth estimate, memory sampling, processes holding a GPU. No GPU is a clean answer."""

from __future__ import annotations

from dataclasses import dataclass

# SKELETON (owner: launcher helper).


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


def gpus() -> list[GpuInfo]:
    """All GPUs NVML sees; [] when there is no NVML or no GPU."""
    raise NotImplementedError


def gpu_processes(index: int = 0) -> list[GpuProcess]:
    raise NotImplementedError
