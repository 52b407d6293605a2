"""gpu.py: bandwidth estimate, NVML facts through a faked pynvml, and the clean no-GPU answer."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pynvml
import pytest

from tuner import gpu
from tuner.errors import TunerError
from tuner.gpu import GIB, GpuBusy, GpuInfo, GpuProcess, PeakMemorySampler


@pytest.fixture(autouse=True)
def fresh_nvml():
    gpu.reset_nvml()
    yield
    gpu.reset_nvml()


class FakeNvml:
    """One fake H100 SXM whose used memory the test can move."""

    def __init__(self, monkeypatch, name="NVIDIA H100 80GB HBM3", clock_mhz=2619, bus_bits=5120,
                 total=80 * GIB, used=1 * GIB, processes=()):
        self.name, self.total, self.used, self.processes = name, total, used, list(processes)
        for attr, value in {
            "nvmlInit": lambda: None,
            "nvmlDeviceGetCount": lambda: 1,
            "nvmlDeviceGetHandleByIndex": self.handle,
            "nvmlDeviceGetName": lambda h: self.name,
            "nvmlDeviceGetMemoryInfo": lambda h: SimpleNamespace(total=self.total, used=self.used,
                                                                 free=self.total - self.used),
            "nvmlDeviceGetMaxClockInfo": lambda h, kind: clock_mhz,
            "nvmlDeviceGetMemoryBusWidth": lambda h: bus_bits,
            "nvmlDeviceGetComputeRunningProcesses": lambda h: self.processes,
            "nvmlDeviceGetGraphicsRunningProcesses": lambda h: [],
        }.items():
            monkeypatch.setattr(pynvml, attr, value)

    def handle(self, index):
        if index != 0:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return "handle0"


# --------------------------------------------------------------------------- bandwidth

@pytest.mark.parametrize("name,clock,bus,expected", [
    ("NVIDIA H100 80GB HBM3", 2619, 5120, 3352.3),      # formula agrees with the table
    ("NVIDIA A100-SXM4-80GB", 1593, 5120, 2039.0),
    ("NVIDIA A100-SXM4-40GB", 1215, 5120, 1555.2),
    ("Tesla T4", 5001, 256, 320.1),
    ("NVIDIA GeForce RTX 4090", 10501, 384, 1008.1),
    ("NVIDIA H200", 3201, 6144, 4916.7),
    ("NVIDIA H100 PCIe", 10, 5120, 2000.0),             # nonsense clock: the table wins
    ("NVIDIA L4", None, None, 300.0),                   # no clocks: the table
    ("Some Future GPU", 1000, 4096, 1024.0),            # unknown card: the formula
    ("Some Future GPU", None, 4096, None),
])
def test_memory_bandwidth(name, clock, bus, expected):
    got = gpu.memory_bandwidth_gbps(name, clock, bus)
    assert got is None if expected is None else got == pytest.approx(expected, abs=0.1)


@pytest.mark.parametrize("name,gbps", [
    ("Tesla V100-SXM2-16GB", 900), ("NVIDIA A100-PCIE-40GB", 1555), ("NVIDIA A100 80GB PCIe", 1935),
    ("NVIDIA H100 80GB HBM3", 3350), ("NVIDIA H100 PCIe", 2000), ("NVIDIA H200", 4800),
    ("NVIDIA L4", 300), ("NVIDIA A10", 600), ("NVIDIA A10G", 600), ("Tesla T4", 320),
    ("NVIDIA GeForce RTX 4090", 1008), ("NVIDIA L40S", 864), ("NVIDIA A40", 696),
])
def test_known_card_table(name, gbps):
    assert gpu.known_bandwidth_gbps(name) == gbps


# --------------------------------------------------------------------------- no GPU

def test_no_gpu_is_a_clean_answer():
    # this machine has no NVIDIA driver: NVML fails to initialise
    assert gpu.gpus() == []
    assert gpu.gpu_processes() == []
    assert gpu.memory_used_bytes() is None
    gpu.check_gpu_free(100 * GIB)   # nothing to wait for
    with PeakMemorySampler() as sampler:
        pass
    assert sampler.peak_bytes == {} and sampler.peak_gib is None


def test_missing_pynvml_is_no_gpu(monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_pynvml(name, *args, **kwargs):
        if name == "pynvml":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pynvml)
    assert gpu.gpus() == []


# --------------------------------------------------------------------------- fake NVML

def test_gpus_from_nvml(monkeypatch):
    FakeNvml(monkeypatch)
    (info,) = gpu.gpus()
    assert info == GpuInfo(index=0, name="NVIDIA H100 80GB HBM3", memory_total_bytes=80 * GIB,
                           memory_free_bytes=79 * GIB, memory_bandwidth_gbps=3352.3)


def test_nvml_names_as_bytes(monkeypatch):
    fake = FakeNvml(monkeypatch)
    fake.name = b"Tesla T4"
    assert gpu.gpus()[0].name == "Tesla T4"


def test_gpu_processes_with_cmdline(monkeypatch):
    me = os.getpid()
    FakeNvml(monkeypatch, processes=[SimpleNamespace(pid=me, usedGpuMemory=3 * GIB),
                                     SimpleNamespace(pid=999999999, usedGpuMemory=None)])
    mine, stranger = gpu.gpu_processes(0)
    assert mine.pid == me and mine.used_bytes == 3 * GIB and "python" in mine.cmdline
    assert stranger == GpuProcess(pid=999999999, used_bytes=0, cmdline="")
    assert gpu.gpu_processes(5) == []


def test_busy_gpu_refuses_with_a_clear_message(monkeypatch):
    FakeNvml(monkeypatch, used=70 * GIB, processes=[SimpleNamespace(pid=os.getpid(), usedGpuMemory=70 * GIB)])
    needed = gpu.required_bytes(gpu.gpus()[0], 0.9)
    with pytest.raises(TunerError) as err:
        gpu.check_gpu_free(needed)
    assert isinstance(err.value, GpuBusy)
    message = str(err.value)
    assert "\n" not in message
    assert "GPU 0 is busy" in message and "72.0 GiB" in message and "10.0 GiB" in message
    assert f"pid {os.getpid()}" in message
    # the tuner's own processes are not blamed
    with pytest.raises(GpuBusy) as err:
        gpu.check_gpu_free(needed, own_pids={os.getpid()})
    assert err.value.holders == []


def test_busy_gpu_waits_for_memory(monkeypatch):
    fake = FakeNvml(monkeypatch, used=70 * GIB)

    def release():
        time.sleep(0.3)
        fake.used = 1 * GIB

    import threading
    threading.Thread(target=release).start()
    started = time.monotonic()
    gpu.check_gpu_free(60 * GIB, wait_s=10, poll_s=0.05)
    assert time.monotonic() - started < 5


def test_peak_memory_sampler(monkeypatch):
    fake = FakeNvml(monkeypatch, used=2 * GIB)
    with PeakMemorySampler(interval_s=0.01) as sampler:
        time.sleep(0.1)
        fake.used = 50 * GIB
        time.sleep(0.1)
        fake.used = 10 * GIB
        time.sleep(0.1)
    assert sampler.peak_bytes == {0: 50 * GIB}
    assert sampler.peak_gib == 50.0
    assert sampler.samples > 3
