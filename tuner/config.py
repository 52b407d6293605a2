"""StudyConfig from a TOML study file (plus command-line overrides), validated with file and key in every message."""

from __future__ import annotations

import math
import re
import shlex
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from tuner.errors import ConfigError
from tuner.loadgen import Workload

# Flags the search may tune: TOML key -> (kind, vLLM flag). Kinds: float, int, bool, str.
TUNABLE = {
    "gpu_memory_utilization": "float",
    "max_model_len": "int",
    "max_num_seqs": "int",
    "max_num_batched_tokens": "int",
    "enforce_eager": "bool",
    "kv_cache_dtype": "str",
}
REQUIRED_DIMS = ("gpu_memory_utilization", "max_model_len", "max_num_seqs")
SAMPLERS = ("auto", "gp", "tpe", "random", "grid")


@dataclass(frozen=True)
class Dimension:
    """One searched flag: a numeric range (low, high, step, log) or a list of choices."""

    name: str
    kind: str                       # float | int | bool | str
    low: float | None = None
    high: float | None = None
    step: float | None = None
    log: bool = False
    choices: tuple = ()

    def contains(self, value) -> bool:
        if self.choices:
            return value in self.choices
        return value is not None and self.low <= value <= self.high

    def snap(self, value):
        """The admissible value nearest to `value` (for baselines outside the grid)."""
        if self.choices:
            if value in self.choices:
                return value
            if self.kind in ("int", "float"):
                return min(self.choices, key=lambda c: (abs(math.log(c) - math.log(value))
                                                        if c > 0 and value > 0 else abs(c - value)))
            return self.choices[0]
        v = min(max(value, self.low), self.high)
        if self.step:
            v = self.low + round((v - self.low) / self.step) * self.step
            v = min(v, self.high)
        return int(round(v)) if self.kind == "int" else round(v, 6)

    def grid(self, points: int = 4) -> list:
        """Finite values for the grid sampler."""
        if self.choices:
            return list(self.choices)
        if self.log:
            vals = [self.low * (self.high / self.low) ** (i / (points - 1)) for i in range(points)]
        else:
            vals = [self.low + (self.high - self.low) * i / (points - 1) for i in range(points)]
        return sorted({self.snap(v) for v in vals})


@dataclass(frozen=True)
class Baseline:
    name: str
    values: tuple[tuple[str, object], ...]


@dataclass(frozen=True)
class StudyConfig:
    """Everything one study needs; flat, immutable, built only by `load_study`."""

    name: str
    source: str                               # the study file, for messages
    model: str                                # folder, HF id or preset:NAME
    extra_args: tuple[str, ...] = ()          # fixed vLLM flags
    engine: tuple[str, ...] = ()              # engine command; () = detect
    env: tuple[tuple[str, str], ...] = ()
    host: str = "127.0.0.1"
    launch_timeout_s: float = 600.0
    memory_budget_gib: float | None = None    # cap the instance at this much device memory
    dimensions: tuple[Dimension, ...] = ()
    baselines: tuple[Baseline, ...] = ()
    workload: Workload = field(default_factory=Workload)
    storage: str = ""                         # Optuna storage URL; "" = sqlite next to the study file
    results_dir: str = "results"
    sampler: str = "auto"
    seed: int | None = None
    confirm: int = 0                          # relaunch each front member K times at the end
    replicates: int = 1                       # relaunch each baseline this often: the measured noise
    gpu_busy_wait_s: float = 120.0            # wait this long for a busy GPU, then skip the config
    use_memory_model: bool = True
    tie_tolerance: float = 0.02               # relative differences below this are ties on the front

    @property
    def results_path(self) -> Path:
        return Path(self.results_dir) / self.name

    def dimension(self, name: str) -> Dimension | None:
        return next((d for d in self.dimensions if d.name == name), None)


def _fail(source: str, key: str, problem: str, fix: str = "") -> ConfigError:
    return ConfigError(source, key, problem, fix)


def _take(table: dict, allowed: dict, source: str, prefix: str) -> dict:
    """Check keys and types of a TOML table; `allowed` maps key -> type or tuple of types."""
    out = {}
    for key, value in table.items():
        where = f"{prefix}.{key}" if prefix else key
        if key not in allowed:
            raise _fail(source, where, "unknown key",
                        "known keys: " + ", ".join(sorted(allowed)))
        types = allowed[key]
        types = types if isinstance(types, tuple) else (types,)
        ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
        if float in types and isinstance(value, int) and not isinstance(value, bool):
            ok, value = True, float(value)
        if not ok:
            names = " or ".join(t.__name__ for t in types)
            raise _fail(source, where, f"expected {names}, got {type(value).__name__} {value!r}")
        out[key] = value
    return out


def _dimension(name: str, spec: dict, source: str) -> Dimension:
    where = f"space.{name}"
    kind = TUNABLE.get(name)
    if kind is None:
        raise _fail(source, where, "not a tunable flag", "tunable: " + ", ".join(TUNABLE))
    if not isinstance(spec, dict):
        raise _fail(source, where, "expected a table such as {low = 1, high = 8} or {choices = [...]}")
    num = (int, float) if kind == "float" else int
    raw = _take(spec, {"low": num, "high": num, "step": num, "log": bool, "choices": list},
                source, where)
    if "choices" in raw:
        if set(raw) - {"choices"}:
            raise _fail(source, where, "give either choices or low/high, not both")
        choices = tuple(raw["choices"])
        if not choices:
            raise _fail(source, where + ".choices", "empty list", "give at least one value")
        want = {"float": (int, float), "int": int, "bool": bool, "str": str}[kind]
        for c in choices:
            if not isinstance(c, want) or (isinstance(c, bool) and kind != "bool"):
                raise _fail(source, where + ".choices", f"{c!r} is not a {kind}")
        if kind == "float":
            choices = tuple(float(c) for c in choices)
        dim = Dimension(name, kind, choices=choices)
        for c in choices:
            _check_value(name, c, source, where + ".choices")
        return dim
    if kind in ("bool", "str"):
        raise _fail(source, where, f"{name} takes choices = [...]")
    if "low" not in raw or "high" not in raw:
        raise _fail(source, where, "needs low and high (or choices)")
    low, high = raw["low"], raw["high"]
    if low > high:
        raise _fail(source, where, f"empty range: low {low} > high {high}")
    step = raw.get("step")
    if step is not None and step <= 0:
        raise _fail(source, where + ".step", f"must be > 0, got {step}")
    if raw.get("log") and step is not None:
        raise _fail(source, where, "log and step cannot be combined")
    if raw.get("log") and low <= 0:
        raise _fail(source, where + ".low", "must be > 0 with log = true")
    for key in ("low", "high"):
        _check_value(name, raw[key], source, f"{where}.{key}")
    return Dimension(name, kind, float(low) if kind == "float" else low,
                     float(high) if kind == "float" else high, step, raw.get("log", False))


def _check_value(name: str, value, source: str, where: str) -> None:
    if name == "gpu_memory_utilization" and not 0 < value <= 1:
        raise _fail(source, where, f"gpu_memory_utilization must be in (0, 1], got {value}")
    if name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens") and value < 1:
        raise _fail(source, where, f"{name} must be a positive integer, got {value}")


def default_storage(name: str) -> str:
    """SQLite under ./studies/, wherever the study file came from (the package holds the demo)."""
    return f"sqlite:///studies/{name}.db"


def load_study(path: str | Path, overrides: dict | None = None) -> StudyConfig:
    """Read and validate a study file; `overrides` (from the command line) win over the file."""
    source = str(path)
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise _fail(source, "", "study file not found", "pass --study FILE or a name under studies/")
    except OSError as e:
        raise _fail(source, "", f"cannot read: {e.strerror}")
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise _fail(source, "", f"malformed TOML: {e}")
    return parse_study(doc, source, overrides or {})


def parse_study(doc: dict, source: str, overrides: dict) -> StudyConfig:
    top = _take(doc, {"study": dict, "model": dict, "server": dict, "space": dict,
                      "workload": dict, "slo": dict, "baselines": list}, source, "")
    study = _take(top.get("study", {}), {
        "name": str, "storage": str, "results_dir": str, "sampler": str, "seed": int,
        "confirm": int, "replicates": int, "memory_model": bool, "tie_tolerance": float},
        source, "study")
    model = _take(top.get("model", {}), {"path": str}, source, "model")
    server = _take(top.get("server", {}), {
        "extra_args": (list, str), "engine": (list, str), "env": dict, "host": str,
        "launch_timeout_s": float, "memory_budget_gib": float, "gpu_busy_wait_s": float},
        source, "server")
    workload_fields = {f.name: f.type for f in fields(Workload)}
    wl_types = {k: _wl_type(t) for k, t in workload_fields.items() if not k.startswith("slo_")}
    wl_types.update(levels=list, request_rates=list)
    workload = _take(top.get("workload", {}), wl_types, source, "workload")
    for key, kind in (("levels", int), ("request_rates", (int, float))):
        if key in workload:
            values = workload[key]
            if any(not isinstance(v, kind) or isinstance(v, bool) or v <= 0 for v in values):
                raise _fail(source, f"workload.{key}", f"expected positive numbers, got {values!r}")
            if key == "levels" and any(v < 2 for v in values):
                raise _fail(source, "workload.levels", f"levels are concurrencies above 1 (1 is "
                            f"always measured: single_stream_requests), got {values!r}")
            workload[key] = tuple(sorted(set(float(v) if key == "request_rates" else v
                                             for v in values)))
    slo = _take(top.get("slo", {}), {"ttft_ms": float, "tpot_ms": float, "e2e_ms": float},
                source, "slo")

    name = overrides.get("name") or study.get("name") or Path(source).stem
    if not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise _fail(source, "study.name", f"{name!r} must be letters, digits, '-', '_' or '.'")
    model_path = overrides.get("model") or model.get("path")
    if not model_path:
        raise _fail(source, "model.path", "missing", "set [model] path = \"preset:tiny\" or a folder")

    def argv(key: str) -> tuple[str, ...]:
        value = overrides.get(key, server.get(key, []))
        return tuple(shlex.split(value) if isinstance(value, str) else map(str, value))

    if any(a == "--api-key" or a.startswith("--api-key=") for a in argv("extra_args")):
        raise _fail(source, "server.extra_args", "--api-key would be written to every log and "
                    "result", "export VLLM_API_KEY instead; vLLM and the load test read it from there")
    env = server.get("env", {})
    for k, v in env.items():
        if not isinstance(v, str):
            raise _fail(source, f"server.env.{k}", "values must be strings")
    for k in env:
        # names that hold secrets (VLLM_API_KEY, HF_TOKEN, ..._SECRET), not every name with
        # TOKEN in it: TOKENIZERS_PARALLELISM is a setting
        if re.search(r"(^|_)(API_?KEY|KEY|TOKEN|SECRET|PASSWORD|PASSWD)S?$", k.upper()):
            raise _fail(source, f"server.env.{k}", "secrets do not belong in a study file",
                        "export it in the environment instead; it is passed through")

    space = top.get("space", {})
    dims = tuple(_dimension(k, v, source) for k, v in space.items())
    for needed in REQUIRED_DIMS:
        if needed not in space:
            raise _fail(source, f"space.{needed}", "missing",
                        "the search needs gpu_memory_utilization, max_model_len and max_num_seqs")

    baselines = []
    for i, b in enumerate(top.get("baselines", [])):
        if not isinstance(b, dict):
            raise _fail(source, f"baselines[{i}]", "expected a table ([[baselines]])")
        allowed = {"name": str, **{k: {"float": float, "int": int, "bool": bool, "str": str}[t]
                                   for k, t in TUNABLE.items()}}
        b = _take(b, allowed, source, f"baselines[{i}]")
        baselines.append(Baseline(b.pop("name", f"baseline-{i}"), tuple(sorted(b.items()))))

    for key, value in workload.items():
        if key in ("prompt_tokens", "output_tokens", "single_stream_requests",
                   "throughput_requests", "max_concurrency", "waves", "ttft_level") and value < 1:
            raise _fail(source, f"workload.{key}", f"must be >= 1, got {value}")
        if key in ("warmup_requests",) and value < 0:
            raise _fail(source, f"workload.{key}", f"must be >= 0, got {value}")
        if key in ("request_timeout_s", "request_rate") and value is not None and value <= 0:
            raise _fail(source, f"workload.{key}", f"must be > 0, got {value}")
    if workload.get("endpoint", "completions") not in ("completions", "chat"):
        raise _fail(source, "workload.endpoint", "must be \"completions\" or \"chat\"")
    wl = replace(Workload(), **workload, **{f"slo_{k}": v for k, v in slo.items()})
    from tuner.loadgen import closed_levels

    if wl.ttft_level is not None and wl.ttft_level != 1 and wl.ttft_level not in closed_levels(wl):
        raise _fail(source, "workload.ttft_level", f"{wl.ttft_level} is not a load level",
                    "choose 1 or one of " + ", ".join(map(str, closed_levels(wl))))

    sampler = overrides.get("sampler") or study.get("sampler", "auto")
    if sampler not in SAMPLERS:
        raise _fail(source if "sampler" not in overrides else "--sampler", "study.sampler",
                    f"unknown sampler {sampler!r}", "choose " + ", ".join(SAMPLERS))
    # `is None`, not `or`: --launch-timeout 0 is an error to report, not "use the file's value"
    timeout = overrides.get("launch_timeout_s")
    timeout = server.get("launch_timeout_s", 600.0) if timeout is None else timeout
    if timeout <= 0:
        raise _fail(source, "server.launch_timeout_s", f"must be > 0, got {timeout}")
    budget = overrides.get("memory_budget_gib")
    budget = server.get("memory_budget_gib") if budget is None else budget
    if budget is not None and budget <= 0:
        raise _fail(source, "server.memory_budget_gib", f"must be > 0, got {budget}")
    confirm = overrides.get("confirm", study.get("confirm", 0))
    if confirm < 0:
        raise _fail(source, "study.confirm", f"must be >= 0, got {confirm}")
    replicates = overrides.get("replicates", study.get("replicates", 1))
    if replicates < 0:
        raise _fail(source, "study.replicates", f"must be >= 0, got {replicates}")
    busy_wait = server.get("gpu_busy_wait_s", 120.0)
    if busy_wait < 0:
        raise _fail(source, "server.gpu_busy_wait_s", f"must be >= 0, got {busy_wait}")

    return StudyConfig(
        name=name, source=source, model=model_path, extra_args=argv("extra_args"),
        engine=argv("engine"), env=tuple(sorted(env.items())),
        host=overrides.get("host") or server.get("host", "127.0.0.1"),
        launch_timeout_s=float(timeout), memory_budget_gib=budget, dimensions=dims,
        baselines=tuple(baselines), workload=wl,
        storage=overrides.get("storage") or study.get("storage") or default_storage(name),
        results_dir=overrides.get("results_dir") or study.get("results_dir", "results"),
        sampler=sampler, seed=overrides.get("seed", study.get("seed")), confirm=confirm,
        replicates=replicates, gpu_busy_wait_s=busy_wait,
        use_memory_model=study.get("memory_model", True),
        tie_tolerance=study.get("tie_tolerance", 0.02),
    )


def _wl_type(annotation):
    text = str(annotation)
    if "float" in text:
        return float
    if "int" in text:
        return int
    if "str" in text:
        return str
    return object
