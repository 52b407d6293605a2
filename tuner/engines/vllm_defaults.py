"""What the installed vLLM would use for the tuned flags when they are absent, read from vLLM itself.

vLLM picks `max_num_seqs` and `max_num_batched_tokens` by device (an H200 gets 1024 sequences, a
CPU build 128) and `gpu_memory_utilization` from its CacheConfig; hard-coding them goes stale with
every release. So the engine's own Python builds vLLM's engine config from the study's fixed flags,
without a launch, and prints what it resolved. The answer is cached per vLLM version, model and
flags (importing vLLM takes 10-30 s).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

# Run by the engine's own Python with vLLM's CLI flags as argv; FIELDS (inserted by `probe_script`)
# maps each flag of the table to where vLLM's resolved engine config holds its value.
PROBE = r"""
import json, operator, sys
try:
    from vllm.entrypoints.openai.cli_args import make_arg_parser
except ImportError:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
try:
    from vllm.utils.argparse_utils import FlexibleArgumentParser
except ImportError:
    from vllm.utils import FlexibleArgumentParser
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.usage.usage_lib import UsageContext
import vllm
args = make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:])
cfg = AsyncEngineArgs.from_cli_args(args).create_engine_config(
    usage_context=UsageContext.OPENAI_API_SERVER)
FIELDS = json.loads(__FIELDS__)
found = {}
for name, (path, kind) in FIELDS.items():
    value = operator.attrgetter(path)(cfg)
    found[name] = bool(value) if kind == "bool" else value
print("TUNER-DEFAULTS " + json.dumps({**found, "vllm_version": vllm.__version__}))
"""


def batch_defaults(platform_kind: str, memory_bytes: float, device_name: str = "") -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) vLLM's API server picks when both are absent
    (`get_batch_defaults` in engine/arg_utils.py): by the device's total memory and name, not by
    the model. The CPU build picks 2048 / 128."""
    if platform_kind == "cpu":
        return 2048, 128
    if memory_bytes >= 160 * 2**30:
        return 16384, 1024
    if memory_bytes >= 70 * 2**30 and "a100" not in device_name.lower():
        return 8192, 1024
    return 2048, 256


def budget_batch_defaults(budget_gib: float, platform) -> dict:
    """The batch defaults vLLM would pick on a card of the memory budget's size, where they differ
    from what it picks on this one: a 16 GiB budget emulated on an H100 would otherwise run with
    the H100's 8,192 batched tokens a step and 1,024 sequences, where a 16 GB card gets 2,048 and
    256 (more activation memory, less KV cache, another prefill chunk). The budget card's name is
    not known, so an A100 target under an 80 GiB budget is taken for the large tier."""
    here = batch_defaults(platform.kind, platform.memory_total_bytes, platform.device_name)
    card = batch_defaults(platform.kind, budget_gib * 2**30)
    if card == here:
        return {}
    return {"max_num_batched_tokens": card[0], "max_num_seqs": card[1]}


def probe_fields() -> dict[str, tuple[str, str]]:
    """Flag name -> (attribute path in vLLM's engine config, kind), from the flag table."""
    from tuner import engines

    return {f.name: (f.read_default, f.kind) for f in engines.flags("vllm") if f.read_default}


def probe_script() -> str:
    return PROBE.replace("__FIELDS__", repr(json.dumps(probe_fields())))


def engine_python(engine: tuple[str, ...]) -> str | None:
    """The interpreter that runs the engine: `python -m vllm...`, or the shebang of a `vllm` script."""
    if len(engine) >= 3 and engine[1] == "-m" and engine[2].startswith("vllm"):
        return engine[0]
    if len(engine) >= 2 and engine[-1] == "serve" and Path(engine[0]).name == "vllm":
        script = shutil.which(engine[0]) or engine[0]
        try:
            first = Path(script).read_text(errors="replace").splitlines()[0]
        except (OSError, IndexError):
            return None
        if first.startswith("#!"):
            interp = first[2:].strip().split()
            if interp and Path(interp[0]).name == "env" and len(interp) > 1:
                return shutil.which(interp[1])
            return interp[0] if interp else None
    return None


def cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tuner" / "vllm-defaults.json"


def read_defaults(engine: tuple[str, ...], model: str, extra_args: tuple[str, ...],
                  env: dict[str, str] | None = None, timeout_s: float = 180.0) -> dict | None:
    """vLLM's resolved defaults for this model and fixed flags, or None when they cannot be read
    (the engine is not vLLM, or the probe failed: the caller says so and falls back)."""
    python = engine_python(engine)
    if python is None:
        return None
    key = hashlib.sha256(json.dumps([python, os.path.realpath(model) if os.path.exists(model)
                                     else model, list(extra_args),
                                     os.environ.get("CUDA_VISIBLE_DEVICES", "")]).encode()).hexdigest()
    cache = cache_path()
    try:
        cached = json.loads(cache.read_text())
    except (OSError, ValueError):
        cached = {}
    # an entry from before a flag was added to the table lacks it: ask vLLM again
    if key in cached and all(name in cached[key] for name in probe_fields()):
        return cached[key]
    argv = [python, "-c", probe_script(), "--model", model, *extra_args]
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s,
                           env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    line = next((x for x in p.stdout.splitlines() if x.startswith("TUNER-DEFAULTS ")), None)
    if line is None:
        return None
    found = json.loads(line.split(" ", 1)[1])
    cached[key] = found
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(cached, indent=1))
        tmp.replace(cache)
    except OSError:
        pass
    return found


if __name__ == "__main__":  # python -m tuner.engines.vllm_defaults MODEL [FLAGS...]
    print(json.dumps(read_defaults((sys.executable, "-m", "vllm.entrypoints.openai.api_server"),
                                   sys.argv[1], tuple(sys.argv[2:])), indent=2))
