"""gpu.py: bandwidth estimate, NVML facts through a faked pynvml, and the clean no-GPU answer."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pynvml
import pytest

from tuner.run import devices
from tuner.errors import TunerError
from tuner.run.devices import GIB, GpuBusy, GpuInfo, GpuProcess, PeakMemorySampler

from fakes import FakeGpu, FakeNvml


@pytest.fixture(autouse=True)
def fresh_nvml():
    devices.reset_nvml()
    yield
    devices.reset_nvml()


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
    got = devices.memory_bandwidth_gbps(name, clock, bus)
    assert got is None if expected is None else got == pytest.approx(expected, abs=0.1)


@pytest.mark.parametrize("name,gbps", [
    ("Tesla V100-SXM2-16GB", 900), ("NVIDIA A100-PCIE-40GB", 1555), ("NVIDIA A100 80GB PCIe", 1935),
    ("NVIDIA H100 80GB HBM3", 3350), ("NVIDIA H100 PCIe", 2000), ("NVIDIA H200", 4800),
    ("NVIDIA L4", 300), ("NVIDIA A10", 600), ("NVIDIA A10G", 600), ("Tesla T4", 320),
    ("NVIDIA GeForce RTX 4090", 1008), ("NVIDIA L40S", 864), ("NVIDIA A40", 696),
])
def test_known_card_table(name, gbps):
    assert devices.known_bandwidth_gbps(name) == gbps


# --------------------------------------------------------------------------- no GPU

def test_no_gpu_is_a_clean_answer():
    # this machine has no NVIDIA driver: NVML fails to initialise
    assert devices.gpus() == []
    assert devices.gpu_processes() == []
    assert devices.memory_used_bytes() is None
    devices.check_gpu_free(100 * GIB)   # nothing to wait for
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
    assert devices.gpus() == []


# --------------------------------------------------------------------------- fake NVML

def test_gpus_from_nvml(monkeypatch):
    FakeNvml(monkeypatch, FakeGpu(uuid="GPU-aaaa"))
    (info,) = devices.gpus()
    assert info == GpuInfo(index=0, name="NVIDIA H100 80GB HBM3", memory_total_bytes=80 * GIB,
                           memory_free_bytes=79 * GIB, memory_bandwidth_gbps=3352.3,
                           uuid="GPU-aaaa", compute_capability=(9, 0), cuda_index=0,
                           pcie_bandwidth_gbps=63.0)
    assert info.has_bfloat16 and info.label == "GPU 0"


def test_pcie_bandwidth_is_lanes_times_the_generation_rate(monkeypatch):
    assert devices.pcie_bandwidth_gbps(4, 16) == 31.5 and devices.pcie_bandwidth_gbps(3, 8) == 7.9
    assert devices.pcie_bandwidth_gbps(None, 16) is None and devices.pcie_bandwidth_gbps(9, 16) is None
    FakeNvml(monkeypatch, FakeGpu(pcie=None))   # NVML cannot tell: unknown, not an error
    assert devices.gpus()[0].pcie_bandwidth_gbps is None


def test_nvml_names_as_bytes(monkeypatch):
    FakeNvml(monkeypatch, FakeGpu(name=b"Tesla T4"))
    assert devices.gpus()[0].name == "Tesla T4"


def test_gpu_processes_with_cmdline(monkeypatch):
    me = os.getpid()
    FakeNvml(monkeypatch, FakeGpu(processes=[(me, 3 * GIB), (999999999, None)]))
    mine, stranger = devices.gpu_processes(0)
    assert mine.pid == me and mine.used_bytes == 3 * GIB and "python" in mine.cmdline
    assert stranger == GpuProcess(pid=999999999, used_bytes=0, cmdline="")
    assert devices.gpu_processes(5) == []


def test_busy_gpu_refuses_with_a_clear_message(monkeypatch):
    FakeNvml(monkeypatch, FakeGpu(used=70 * GIB, processes=[(os.getpid(), 70 * GIB)]))
    needed = devices.required_bytes(devices.gpus()[0], 0.9)
    with pytest.raises(TunerError) as err:
        devices.check_gpu_free(needed)
    assert isinstance(err.value, GpuBusy)
    message = str(err.value)
    assert "\n" not in message
    assert "GPU 0 is busy" in message and "72.0 GiB" in message and "10.0 GiB" in message
    assert f"pid {os.getpid()}" in message
    # the tuner's own processes are not blamed
    with pytest.raises(GpuBusy) as err:
        devices.check_gpu_free(needed, own_pids={os.getpid()})
    assert err.value.holders == []


def test_busy_gpu_waits_for_memory(monkeypatch):
    fake = FakeNvml(monkeypatch, FakeGpu(used=70 * GIB))

    def release():
        time.sleep(0.3)
        fake.devices[0].used = 1 * GIB

    import threading
    threading.Thread(target=release).start()
    started = time.monotonic()
    devices.check_gpu_free(60 * GIB, wait_s=10, poll_s=0.05)
    assert time.monotonic() - started < 5


def test_peak_memory_sampler(monkeypatch):
    fake = FakeNvml(monkeypatch, FakeGpu(used=2 * GIB))
    with PeakMemorySampler(interval_s=0.01) as sampler:
        time.sleep(0.1)
        fake.devices[0].used = 50 * GIB
        time.sleep(0.1)
        fake.devices[0].used = 10 * GIB
        time.sleep(0.1)
    assert sampler.peak_bytes == {0: 50 * GIB}
    assert sampler.peak_gib == 50.0
    assert sampler.samples > 3


# --------------------------------------------------------------------------- CUDA_VISIBLE_DEVICES

def four_gpus(monkeypatch, **first) -> FakeNvml:
    """NVML index i is an H100 with uuid GPU-<i>..., i GiB used; the first one as `first` says."""
    devices = [FakeGpu(uuid=f"GPU-{i}{i}{i}{i}-beef", used=(i + 1) * GIB) for i in range(4)]
    for key, value in first.items():
        setattr(devices[0], key, value)
    return FakeNvml(monkeypatch, *devices)


@pytest.mark.parametrize("setting,expected", [
    (None, [0, 1, 2, 3]),                 # unset: all, NVML order
    ("2", [2]),
    ("3,1", [3, 1]),                      # CUDA order is the list's order: [0] is vLLM's GPU
    (" 1 , 0 ", [1, 0]),                  # CUDA ignores whitespace
    ("1,7,2", [1]),                       # the first invalid entry hides itself and the rest
    ("-1", []),
    ("", []),                             # empty: no GPU
    ("GPU-2222-beef", [2]),
    ("GPU-3333,0", [3, 0]),               # a unique prefix is enough
    ("GPU-9999", []),
    ("GPU-", []),                         # a prefix of every uuid is ambiguous
    ("nvidia0", []),
])
def test_visible_devices_follow_cuda(monkeypatch, setting, expected):
    four_gpus(monkeypatch)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    if setting is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", setting)
    seen = devices.gpus()
    assert [g.index for g in seen] == expected
    assert [g.cuda_index for g in seen] == list(range(len(expected)))
    v = devices.visibility()
    assert sorted(g.index for g in v.devices + v.hidden) == ([0, 1, 2, 3] if setting is not None
                                                             else [0, 1, 2, 3])
    if setting in ("1,7,2", "GPU-9999", "GPU-", "nvidia0"):
        assert "CUDA ignores it" in v.note


def test_the_study_env_wins_over_the_tuners(monkeypatch):
    four_gpus(monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert [g.index for g in devices.gpus()] == [0]
    study_env = (("CUDA_VISIBLE_DEVICES", "2,3"),)
    assert [g.index for g in devices.gpus(study_env)] == [2, 3]
    assert devices.visibility(study_env).source == "study env"
    assert devices.visibility().source == "environment"


def test_mig_instance(monkeypatch):
    migs = [FakeGpu(name="NVIDIA A100-SXM4-40GB", uuid="MIG-aaaa-0001", total=10 * GIB, used=0),
            FakeGpu(name="NVIDIA A100-SXM4-40GB", uuid="MIG-aaaa-0002", total=20 * GIB, used=0)]
    FakeNvml(monkeypatch, FakeGpu(name="NVIDIA A100-SXM4-40GB", uuid="GPU-a100", capability=(8, 0),
                                  migs=migs), FakeGpu(uuid="GPU-h100"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-aaaa-0002")
    (mig,) = devices.gpus()
    assert (mig.index, mig.mig_index, mig.memory_total_bytes) == (0, 1, 20 * GIB)
    assert mig.label == "GPU 0 MIG 1" and mig.compute_capability == (8, 0)
    assert devices.memory_used_bytes(mig) == 0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-GPU-a100/1/0")
    assert devices.gpus() == [] and "old MIG-GPU" in devices.visibility().note


def test_order_note_on_a_mixed_host(monkeypatch):
    four_gpus(monkeypatch, name="Tesla V100-SXM2-16GB")
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert "CUDA_DEVICE_ORDER" in devices.visibility().note
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    assert devices.visibility().note == ""
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "FASTEST_FIRST")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,2")       # identical cards: the orders agree
    assert devices.visibility().note == ""


def test_free_check_looks_at_the_visible_gpu(monkeypatch):
    fake = four_gpus(monkeypatch)
    fake.devices[0].used = 79 * GIB            # GPU 0 is full, GPU 2 is not
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(GpuBusy, match="GPU 0 is busy"):
        devices.check_gpu_free(40 * GIB)
    devices.check_gpu_free(40 * GIB, env=(("CUDA_VISIBLE_DEVICES", "2"),))
    fake.devices[2].used = 79 * GIB
    with pytest.raises(GpuBusy, match="GPU 2 is busy"):
        devices.check_gpu_free(40 * GIB, env=(("CUDA_VISIBLE_DEVICES", "2,0"),))
    devices.check_gpu_free(40 * GIB, env=(("CUDA_VISIBLE_DEVICES", ""),))   # no GPU: nothing to check


def test_sampler_reads_only_visible_gpus_and_names_strangers(monkeypatch):
    import subprocess
    import sys

    fake = four_gpus(monkeypatch)
    # a stand-in for the server's process group, and another for a stranger's
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                              start_new_session=True)
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                                start_new_session=True)
    try:
        fake.devices[3].used = 70 * GIB          # invisible: must not count
        fake.devices[1].processes = [(server.pid, 6 * GIB), (stranger.pid, 2 * GIB),
                                     (999999999, 1 * GIB)]
        fake.devices[1].used = 10 * GIB
        with PeakMemorySampler(interval_s=0.01, env=(("CUDA_VISIBLE_DEVICES", "1"),),
                               server_pgid=server.pid) as sampler:
            time.sleep(0.1)
            fake.devices[1].processes[0] = (server.pid, 12 * GIB)
            fake.devices[1].used = 16 * GIB
            time.sleep(0.1)
            fake.devices[1].processes[0] = (server.pid, 4 * GIB)
            time.sleep(0.05)
    finally:
        for p in (server, stranger):
            p.kill()
            p.wait()
    assert sampler.peak_bytes == {1: 16 * GIB}
    assert sampler.server_peak_bytes == {1: 12 * GIB}
    # the stranger and the process /proc cannot place (another PID namespace)
    assert sampler.stranger_peak_bytes == {1: 3 * GIB}
    assert set(sampler.strangers) == {stranger.pid, 999999999}
    assert "sleep" in sampler.strangers[stranger.pid].cmdline


# --------------------------------------------------------------------------- dtype by device

V100 = GpuInfo(0, "Tesla V100-SXM2-16GB", 16 * GIB, 15 * GIB, 900.0, compute_capability=(7, 0))
H200 = GpuInfo(0, "NVIDIA H200", 141 * GIB, 140 * GIB, 4800.0, compute_capability=(9, 0))


@pytest.mark.parametrize("device,config,extra,dtype,words", [
    (V100, {"torch_dtype": "bfloat16"}, (), "float16", "Tesla V100-SXM2-16GB (compute 7.0) has no bfloat16"),
    (V100, {}, (), "float16", "has no bfloat16"),                       # no dtype: float32 -> bf16
    (V100, {"dtype": "bfloat16"}, (), "float16", "has no bfloat16"),    # newer transformers' key
    (V100, {"text_config": {"torch_dtype": "bfloat16"}}, (), "float16", "has no bfloat16"),
    (V100, {"torch_dtype": "float16"}, (), None, "float16 in config.json runs on Tesla V100"),
    (V100, {"torch_dtype": "bfloat16"}, ("--dtype", "half"), None, "--dtype half"),
    (V100, {"torch_dtype": "bfloat16"}, ("--dtype=float32",), None, "--dtype float32"),
    (V100, {"torch_dtype": "bfloat16", "model_type": "gemma2"}, (), "float32", "refuses float16"),
    (H200, {"torch_dtype": "bfloat16"}, (), None, "runs on NVIDIA H200 (compute 9.0)"),
    (GpuInfo(0, "odd", GIB, GIB, None), {"torch_dtype": "bfloat16"}, (), None, "no compute capability"),
    (None, {"torch_dtype": "bfloat16"}, (), None, "CPU build"),
])
def test_supported_dtype(device, config, extra, dtype, words):
    choice = devices.supported_dtype(device, config, extra)
    assert choice.dtype == dtype and words in choice.reason
    assert choice.flags == (["--dtype", dtype] if dtype else [])


def test_dtype_flags_of_the_presets(tmp_path):
    from tuner.models import presets

    for name in ("tiny", "llama-3.1-8b"):
        folder = presets.preset_folder(name)
        assert devices.dtype_flags(folder, V100) == ["--dtype", "float16"]
        assert devices.dtype_flags(folder, H200) == []
        assert devices.dtype_flags(folder, V100, ["--dtype", "bfloat16"]) == []
    assert devices.dtype_flags(tmp_path / "no-such-model", V100) == []


def test_awq_on_a_v100_is_a_problem_before_any_launch():
    # vLLM's AWQ kernels need compute 7.5: the seed's 32B AWQ preset on a real V100 (7.0) failed
    # every launch with "Minimum capability: 75. Current capability: 70." and doctor said nothing
    from tuner.models import presets
    from tuner.config import read_model_configs

    awq = read_model_configs(str(presets.preset_folder("qwen2.5-32b-awq")))[0]
    said = devices.quantization_problem(V100, awq)
    assert said.startswith("awq needs compute capability 7.5 in vLLM; Tesla V100-SXM2-16GB has 7.0")
    assert devices.quantization_problem(H200, awq) is None
    assert devices.quantization_problem(None, awq) is None                     # the CPU build
    assert devices.quantization_problem(GpuInfo(0, "odd", GIB, GIB, None), awq) is None
    plain = read_model_configs(str(presets.preset_folder("llama-3.1-8b")))[0]
    assert devices.quantization_problem(V100, plain) is None
    # the user's --quantization wins over the checkpoint's: GPTQ runs from 6.0
    assert devices.quantization_problem(V100, awq, ["--quantization", "gptq"]) is None
    pascal = GpuInfo(0, "Tesla P100", 16 * GIB, 15 * GIB, 700.0, compute_capability=(5, 2))
    assert "gptq needs compute capability 6.0" in devices.quantization_problem(
        pascal, plain, ["--quantization=gptq"])


def test_compute_capability_from_nvml(monkeypatch):
    FakeNvml(monkeypatch, FakeGpu(name="Tesla V100-SXM2-16GB", capability=(7, 0)))
    (v100,) = devices.gpus()
    assert v100.compute_capability == (7, 0) and v100.has_bfloat16 is False


# --------------------------------------------------------------------------- doctor

def test_doctor_shows_the_visible_gpus_their_strangers_and_the_dtype(monkeypatch):
    from tuner.cli import doctor_gpu_lines
    from tuner.config import parse_study
    from tuner.models.presets import TINY_MODEL
    from tuner.search.study import Platform

    FakeNvml(monkeypatch,
             FakeGpu(name="Tesla V100-SXM2-16GB", capability=(7, 0), total=16 * GIB, uuid="GPU-v100"),
             FakeGpu(uuid="GPU-h100", processes=[(os.getpid(), 5 * GIB)]),
             FakeGpu(uuid="GPU-h100b"))
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    platform = Platform("cuda", "x", 80 * GIB, 3350.0, ("true",), "0")

    def doctor(visible: str, model: str = str(TINY_MODEL)) -> str:
        cfg = parse_study({"model": {"path": "preset:tiny"},
                           "server": {"env": {"CUDA_VISIBLE_DEVICES": visible}},
                           "space": {"gpu_memory_utilization": {"low": 0.1, "high": 0.9},
                                     "max_model_len": {"choices": [1024]},
                                     "max_num_seqs": {"choices": [1]}}}, "s.toml", {})
        return "\n".join(doctor_gpu_lines(cfg, platform, model, ()))

    text = doctor("1,0")
    assert "CUDA_VISIBLE_DEVICES='1,0' (study env): visible GPU 1, GPU 0; hidden GPU 2" in text
    assert "GPU 1      cuda:0 (vLLM's device) NVIDIA H100" in text
    assert "strangers hold 5.0 GiB" in text and f"pid {os.getpid()} (5.0 GiB)" in text
    assert "CUDA_DEVICE_ORDER" in text          # a V100 beside H100s: CUDA's order may differ
    assert "dtype      auto: bfloat16 in config.json runs on NVIDIA H100" in text
    text = doctor("GPU-v100")
    assert "GPU 0      cuda:0 (vLLM's device) Tesla V100" in text and "compute 7.0" in text
    assert "dtype      float16: Tesla V100-SXM2-16GB (compute 7.0) has no bfloat16" in text
    assert "PROBLEM" not in text
    from tuner.models.presets import preset_folder

    text = doctor("GPU-v100", str(preset_folder("qwen2.5-32b-awq")))
    assert "quantize   PROBLEM: awq needs compute capability 7.5 in vLLM" in text
    assert "PROBLEM" not in doctor("GPU-h100", str(preset_folder("qwen2.5-32b-awq")))
    text = doctor("")
    assert "CUDA_VISIBLE_DEVICES hides every GPU" in text and "dtype      auto" in text
