"""StudyConfig from a TOML study file (plus command-line overrides), validated with file and key in every message."""

from __future__ import annotations

import math
import os
import re
import shlex
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from tuner import engines
from tuner.engines.vllm import KV_CACHE_DTYPES  # noqa: F401  (its home is the engine's table)
from tuner.errors import ConfigError
from tuner.records import Requirement, Workload

# Which flags may be searched, their kinds and ranges: the engine's flag table (tuner.engines).
_TYPES = {"float": float, "int": int, "bool": bool, "str": str}
SAMPLERS = ("auto", "gp", "tpe", "random", "grid")
# "share": gmu scaled to a share of the budget (vLLM plans within it); "ballast": and a process
# holds the rest of the device, so a peak outside vLLM's plan fails as on the real card
MEMORY_BUDGET_MODES = ("share", "ballast")


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

    def extreme(self, smallest: bool = False):
        """The largest value the dimension offers (the smallest with `smallest`)."""
        values = self.choices or (self.low, self.high)
        return min(values) if smallest else max(values)

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
    engine: tuple[str, ...] = ()              # engine command; () = the engine's default
    engine_name: str = "vllm"                 # which engine (tuner.engines.NAMES)
    env: tuple[tuple[str, str], ...] = ()
    host: str = "127.0.0.1"
    launch_timeout_s: float = 600.0
    memory_budget_gib: float | None = None    # cap the instance at this much device memory
    # how: "share" scales gmu to a share of the budget; "ballast" also holds the rest of the card
    memory_budget_mode: str = "share"
    dimensions: tuple[Dimension, ...] = ()
    baselines: tuple[Baseline, ...] = ()
    workload: Workload = field(default_factory=Workload)
    requirement: Requirement = field(default_factory=Requirement)
    storage: str = ""                         # Optuna storage URL; "" = sqlite:///studies/NAME.db (relative)
    results_dir: str = "results"
    sampler: str = "auto"
    seed: int | None = None
    confirm: int = 0                          # relaunch each front member K times at the end
    replicates: int = 2                       # relaunch each baseline this often: the measured noise
    patience: int = 0                         # stop once this many launches left the front unchanged (0: off)
    gpu_busy_wait_s: float = 120.0            # wait this long for a busy GPU, then skip the config
    use_memory_model: bool = True
    # skip a config whose best possible figures, read off launches already measured, are beaten
    # beyond the noise (search/screen.py); off for a recorded grid, which must launch everything
    screen: bool = True
    tie_tolerance: float = 0.02               # relative differences below this are ties on the front
    # [slo] min_roofline_share: a single stream below this share of its roofline is cpu_offload
    # (a soft constraint); 0 = off. Checked only where the device's bandwidth is known (not on CPU)
    min_roofline_share: float = 0.05

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
            raise _fail(source, where, "unknown key", _did_you_mean(key, allowed)
                        + "known keys: " + ", ".join(sorted(allowed)))
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


def _did_you_mean(key: str, known) -> str:
    """"did you mean X? " for a key one typo away from a known one (max_num_seq), else ""."""
    import difflib

    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.75)
    return f"did you mean {close[0]}? " if close else ""


def _dimension(name: str, spec: dict, source: str) -> Dimension:
    where = f"space.{name}"
    flag = engines.flag(name)
    if flag is None:
        names = [f.name for f in engines.flags()]
        raise _fail(source, where, "not a tunable flag",
                    _did_you_mean(name, names) + "tunable: " + ", ".join(names))
    kind = flag.kind
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
    if step is not None and high > low:
        # Optuna searches low, low + step, ... up to high and silently lowers a high that is not on
        # a step (0.5..0.95 step 0.1 searches up to 0.9): the values written would not be the values
        # searched, and doctor and the baselines would plan with a top that is never launched
        steps = (high - low) / step
        if abs(steps - round(steps)) > 1e-6 * max(1.0, steps):
            last = low + math.floor(steps + 1e-9) * step
            last = int(last) if kind == "int" else round(last, 6)
            raise _fail(source, where, f"high {high} is not low {low} plus a whole number of steps "
                        f"of {step}: the search would stop at {last}",
                        f"set high = {last}, or a step that divides {round(high - low, 6)}")
    return Dimension(name, kind, float(low) if kind == "float" else low,
                     float(high) if kind == "float" else high, step, raw.get("log", False))


def _check_value(name: str, value, source: str, where: str) -> None:
    """One flag value against the engine's table; the message names the value and the range."""
    flag = engines.flag(name)
    problem = flag.problem(value, engines.get().label) if flag is not None else None
    if problem:
        raise _fail(source, where, problem)


def _cli(name: str) -> str:
    """How the engine spells a flag of its table."""
    return engines.flag(name).cli


def fixed_flag_values(extra_args, source: str = "") -> dict:
    """Tunable flags the study fixes in `[server] extra_args`, parsed and checked like the space's."""
    by_cli = {spelled: f for f in engines.flags() if f.takes_value for spelled in f.spellings}
    out: dict = {}
    args = list(extra_args)
    for i, arg in enumerate(args):
        spelled, _, inline = arg.partition("=")
        if spelled not in by_cli:
            continue
        flag = by_cli[spelled]
        value = flag.parse(inline if inline else (args[i + 1] if i + 1 < len(args) else ""))
        _check_value(flag.name, value, source, f"server.extra_args {spelled}")
        out[flag.name] = value
    return out


def fixed_flags(extra_args) -> dict[str, str]:
    """Flags of the engine's table that `extra_args` sets (bool ones included, also as --no-X):
    flag name -> how it is spelled there."""
    out: dict[str, str] = {}
    for f in engines.flags():
        spellings = set(f.spellings) | ({"--no-" + s[2:] for s in f.spellings if s.startswith("--")}
                                        if f.kind == "bool" else set())
        for arg in extra_args:
            if arg.partition("=")[0] in spellings:
                out.setdefault(f.name, arg.partition("=")[0])
    return out


def chunked_prefill_enabled(extra_args) -> bool:
    """vLLM 0.32 turns chunked prefill on for every generating model unless told otherwise."""
    enabled = True
    for arg in extra_args:
        if arg == "--enable-chunked-prefill":
            enabled = True
        elif arg == "--no-enable-chunked-prefill":
            enabled = False
    return enabled


def check_flag_values(values: dict, source: str = "command line",
                      extra_args: tuple[str, ...] = ()) -> None:
    """Values of one config (`measure`): each in range, then vLLM's rules between them. None = unset."""
    for name, value in values.items():
        if value is not None:
            _check_value(name, value, source, _cli(name))
    fixed_values = fixed_flag_values(extra_args, source)
    for name, spelled in fixed_flags(extra_args).items():
        flag = engines.flag(name)
        fixed = (not spelled.startswith("--no-")) if flag.kind == "bool" else fixed_values.get(name)
        if values.get(name) is not None and values[name] != fixed:
            # extra_args come after the config's flags on the command line: theirs would run
            raise _fail(source, _cli(name), f"also fixed in the study's [server] extra_args "
                        f"({spelled}): the launch would run that value, not this one",
                        f"leave {_cli(name)} out, or remove {spelled} from extra_args")
    merged = {**fixed_flag_values(extra_args, source),
              **{k: v for k, v in values.items() if v is not None}}
    _check_batched_tokens({k: (v, v, _cli(k)) for k, v in merged.items()
                           if k in ("max_model_len", "max_num_seqs", "max_num_batched_tokens")},
                          chunked_prefill_enabled(extra_args), source)


def _bounds(dim: "Dimension") -> tuple:
    return (min(dim.choices), max(dim.choices)) if dim.choices else (dim.low, dim.high)


def check_space(cfg: "StudyConfig") -> None:
    """vLLM's rules between the searched flags (and those fixed in extra_args), over the whole space.

    max_num_batched_tokens below max_num_seqs (always) or below max_model_len (with chunked prefill
    off) makes vLLM 0.32 refuse to start. One flag cannot be clipped against another without a
    conditional space, so a space where any combination breaks the rule is refused: change the one
    range the message names."""
    bounds = {k: (v, v, "server.extra_args " + _cli(k))
              for k, v in fixed_flag_values(cfg.extra_args, cfg.source).items()}
    bounds.update({d.name: (*_bounds(d), f"space.{d.name}") for d in cfg.dimensions
                   if d.name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens")})
    _check_batched_tokens(bounds, chunked_prefill_enabled(cfg.extra_args), cfg.source, space=True)


def _check_batched_tokens(bounds: dict, chunked_prefill: bool, source: str, space: bool = False) -> None:
    if "max_num_batched_tokens" not in bounds:
        return
    low, _, where = bounds["max_num_batched_tokens"]
    rules = [("max_num_seqs", "vLLM requires max_num_batched_tokens >= max_num_seqs")]
    if not chunked_prefill:
        rules.append(("max_model_len", "with --no-enable-chunked-prefill vLLM requires "
                                       "max_num_batched_tokens >= max_model_len"))
    for other, rule in rules:
        if other not in bounds or low >= bounds[other][1]:
            continue
        high, other_where = bounds[other][1], bounds[other][2]
        if space:
            raise _fail(source, where, f"its lowest value {low} is below the highest {other} "
                        f"{high} ({other_where}): {rule}",
                        f"raise max_num_batched_tokens to >= {high} or lower {other}")
        raise _fail(source, where, f"max_num_batched_tokens {low} is below {other} {high}: {rule}",
                    f"give --max-num-batched-tokens >= {high}")


# ---------------------------------------------------------------- what the model allows

# config.json keys vLLM 0.32 reads for the model's length, smallest wins
# (vllm/transformers_utils/model_arch_config_convertor.py derive_max_model_len_and_key)
_MAX_LEN_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                 "model_max_length", "max_target_positions", "max_sequence_length",
                 "max_seq_length", "seq_len")
# RoPE types whose max_position_embeddings is already the scaled length (vllm/config/model.py)
_ROPE_PRESCALED = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")


def model_max_len(config: dict, tokenizer_config: dict | None = None) -> tuple[int | None, str]:
    """The largest --max-model-len vLLM 0.32 accepts for a model, and where it comes from.

    Mirrors `_get_and_verify_max_len` for the simple cases: the smallest of the length keys of the
    (text) config, `model_max_length` overriding, capped by the tokenizer's `model_max_length`,
    times the RoPE scaling factor (except types whose length is already scaled, and Gemma 3);
    a `model_max_length` in config.json above that still admits values up to it. Not mirrored:
    sliding windows with --disable-sliding-window, encoder configs, speculative draft models.
    (None, ...) when no key is present: vLLM then accepts any length.
    """
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    derived, key = math.inf, ""
    for k in _MAX_LEN_KEYS:
        v = text.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v < derived:
            derived, key = v, k
    if text.get("model_max_length"):
        derived, key = text["model_max_length"], "model_max_length"
    why = f"{key} {derived:g} in config.json" if key else ""
    tok = (tokenizer_config or {}).get("model_max_length")
    if isinstance(tok, (int, float)) and tok < derived:
        derived, why = tok, f"model_max_length {tok:g} in tokenizer_config.json"
    if derived == math.inf:
        return None, "config.json names no maximum length"
    rope = text.get("rope_parameters") or text.get("rope_scaling") or config.get("rope_scaling")
    layers = []
    if isinstance(rope, dict):
        nested = rope and all(isinstance(v, dict) for v in rope.values())
        layers = [v for v in rope.values() if v] if nested else [rope]
    if layers and "gemma3" not in str(config.get("model_type", "")):
        factor = 1.0
        for rp in layers:
            kind = rp.get("rope_type") or rp.get("type") or "default"
            if kind not in _ROPE_PRESCALED:
                factor = rp.get("factor", factor)
        factor = 1.0 if factor is None else factor
        if factor != 1.0:
            derived, why = derived * factor, f"{why} x RoPE factor {factor:g}"
    override = text.get("model_max_length")
    if isinstance(override, (int, float)) and override > derived:
        derived, why = override, f"model_max_length {override:g} in config.json"
    return int(derived), why


def long_max_model_len_allowed(env=()) -> bool:
    """VLLM_ALLOW_LONG_MAX_MODEL_LEN (the study's env over ours) lets vLLM exceed the model's limit."""
    import os

    value = dict(env).get("VLLM_ALLOW_LONG_MAX_MODEL_LEN",
                          os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "0"))
    return value.strip().lower() in ("1", "true")


def read_model_configs(model_dir) -> tuple[dict, dict | None] | None:
    """config.json (and tokenizer_config.json) of a model folder; None when there is none to read
    (an HF id not downloaded: vLLM will judge it)."""
    import json

    folder = Path(model_dir).expanduser()
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    try:
        tokenizer = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        tokenizer = None
    return (config, tokenizer) if isinstance(config, dict) else None


def check_max_model_len(max_model_len: int, config: dict, tokenizer_config: dict | None = None,
                        source: str = "command line", where: str = "--max-model-len") -> None:
    """Refuse a --max-model-len the model's config.json already rules out."""
    limit, why = model_max_len(config, tokenizer_config)
    if limit is not None and max_model_len > limit:
        raise _fail(source, where, f"max_model_len {max_model_len} exceeds the model's limit: "
                    f"allowed 1..{limit} ({why})",
                    "lower it, or set VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 if you mean it")


def fit_space_to_model(cfg: "StudyConfig", config: dict, tokenizer_config: dict | None = None,
                       warn=None) -> "StudyConfig":
    """The study with its max_model_len space cut at the model's limit.

    A space wholly above the limit is an error. One partly above it is clipped, with one warning:
    every launch above the limit is a certain 20 s crash that teaches the sampler nothing, and the
    rest of the space still answers the question asked. The cut is the same on every run of the
    same study and model, so a resumed study sees the same space."""
    dim = cfg.dimension("max_model_len")
    fixed = fixed_flag_values(cfg.extra_args, cfg.source).get("max_model_len")
    if fixed is not None:
        check_max_model_len(fixed, config, tokenizer_config, cfg.source,
                            "server.extra_args " + _cli("max_model_len"))
    limit, why = model_max_len(config, tokenizer_config)
    if dim is None or limit is None or long_max_model_len_allowed(cfg.env) or _bounds(dim)[1] <= limit:
        return cfg
    where = "space.max_model_len"
    if _bounds(dim)[0] > limit:
        raise _fail(cfg.source, where, f"every value ({_describe(dim)}) exceeds the model's limit: "
                    f"allowed 1..{limit} ({why})", f"search max_model_len <= {limit}")
    if dim.choices:
        kept = tuple(c for c in dim.choices if c <= limit)
        new = replace(dim, choices=kept)
        dropped = ", ".join(str(c) for c in dim.choices if c > limit)
    else:
        high = limit if not dim.step else int(dim.low + (limit - dim.low) // dim.step * dim.step)
        new = replace(dim, high=high)
        dropped = f"values above {limit}"
    if warn is not None:
        warn(f"tuner: warning: {cfg.source}: {where}: {dropped} exceed the model's limit {limit} "
             f"({why}): searching {_describe(new)}")
    return replace(cfg, dimensions=tuple(new if d is dim else d for d in cfg.dimensions))


def _describe(dim: "Dimension") -> str:
    if dim.choices:
        return "choices " + ", ".join(str(c) for c in dim.choices)
    return f"{dim.low}..{dim.high}" + (f" step {dim.step}" if dim.step else "")


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


def _check_finite(value, source: str, key: str = "") -> None:
    """TOML allows nan and inf; no setting of a study means either."""
    if isinstance(value, float) and not math.isfinite(value):
        raise _fail(source, key, f"must be a finite number, got {value}")
    if isinstance(value, dict):
        for k, v in value.items():
            _check_finite(v, source, f"{key}.{k}" if key else k)
    elif isinstance(value, list):
        for v in value:
            _check_finite(v, source, key)


def parse_study(doc: dict, source: str, overrides: dict) -> StudyConfig:
    _check_finite(doc, source)
    _check_finite(overrides, source)
    top = _take(doc, {"study": dict, "model": dict, "server": dict, "space": dict,
                      "workload": dict, "slo": dict, "requirement": dict, "baselines": list},
                source, "")
    study = _take(top.get("study", {}), {
        "name": str, "storage": str, "results_dir": str, "sampler": str, "seed": int,
        "confirm": int, "replicates": int, "patience": int, "memory_model": bool, "screen": bool,
        "tie_tolerance": float}, source, "study")
    model = _take(top.get("model", {}), {"path": str}, source, "model")
    server = _take(top.get("server", {}), {
        "extra_args": (list, str), "engine": (list, str), "command": (list, str), "env": dict, "host": str,
        "launch_timeout_s": float, "memory_budget_gib": float, "memory_budget_mode": str,
        "gpu_busy_wait_s": float}, source, "server")
    workload_fields = {f.name: f.type for f in fields(Workload)}
    wl_types = {k: _wl_type(t) for k, t in workload_fields.items() if not k.startswith("slo_")}
    wl_types.update(levels=list, request_rates=list, prompt_tokens_mix=list, output_tokens_mix=list)
    workload = _take(top.get("workload", {}), wl_types, source, "workload")
    for key, old_spelling in (("levels", "concurrency"), ("request_rates", "request_rate")):
        if key in workload and old_spelling in workload:
            raise _fail(source, f"workload.{old_spelling}", f"given with {key}, which it is the old "
                        f"spelling of: only {key} would count", f"remove {old_spelling}")
    for key, kind in (("levels", int), ("request_rates", (int, float))):
        if key in workload:
            values = workload[key]
            if key == "levels" and not values:
                raise _fail(source, "workload.levels", "empty list", "give concurrencies above 1, "
                            "or leave levels out for the ladder up to max_concurrency")
            if any(not isinstance(v, kind) or isinstance(v, bool) or v <= 0 for v in values):
                raise _fail(source, f"workload.{key}", f"expected positive numbers, got {values!r}")
            if key == "levels" and any(v < 2 for v in values):
                raise _fail(source, "workload.levels", f"levels are concurrencies above 1 (1 is "
                            f"always measured: single_stream_requests), got {values!r}")
            workload[key] = tuple(sorted(set(float(v) if key == "request_rates" else v
                                             for v in values)))
    _length_mix(workload, source)
    if workload.get("closed_loop_start", "together") not in CLOSED_LOOP_STARTS:
        raise _fail(source, "workload.closed_loop_start", f"unknown start {workload['closed_loop_start']!r}",
                    "choose " + ", ".join(CLOSED_LOOP_STARTS))
    requirement = _take(top.get("requirement", {}), {"context_tokens": int, "sequences_at_context": int},
                        source, "requirement")
    for key, value in requirement.items():
        if value < 1:
            raise _fail(source, f"requirement.{key}", f"must be >= 1, got {value}")
    if "sequences_at_context" in requirement and "context_tokens" not in requirement:
        raise _fail(source, "requirement.sequences_at_context", "needs the context it counts",
                    "set [requirement] context_tokens too")
    slo = _take(top.get("slo", {}), {"ttft_ms": float, "tpot_ms": float, "e2e_ms": float,
                                     "min_roofline_share": float}, source, "slo")
    for key, value in slo.items():
        if key != "min_roofline_share" and value <= 0:
            raise _fail(source, f"slo.{key}", f"must be > 0 ms, got {value:g}",
                        "leave it out for no SLO on that metric")
    from tuner.search.feasibility import MIN_ROOFLINE_SHARE

    min_roofline_share = slo.pop("min_roofline_share", MIN_ROOFLINE_SHARE)
    if not 0 <= min_roofline_share < 1:
        raise _fail(source, "slo.min_roofline_share", f"must be in [0, 1), got {min_roofline_share:g}",
                    "0 turns the check off; 0.05 is the default")

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

    # `engine = "llamacpp"` names the engine; a list (`engine = ["vllm", "serve"]`) is its command,
    # as before engines had names; `command` is the command of the named engine
    engine_name = server.get("engine") if isinstance(server.get("engine"), str) else engines.DEFAULT
    if engine_name not in engines.NAMES:
        raise _fail(source, "server.engine", f"unknown engine {engine_name!r}",
                    "choose " + " or ".join(f'"{n}"' for n in engines.NAMES)
                    + " (a command goes in [server] command)")
    engines.use(engine_name)
    if "engine" in overrides:
        command = argv("engine")
    elif "command" in server:
        command = argv("command")
    elif isinstance(server.get("engine"), list):
        command = argv("engine")
    else:
        command = ()

    space = top.get("space", {})
    dims = tuple(_dimension(k, v, source) for k, v in space.items())
    req = Requirement(**requirement)
    dims = cut_space_to_requirement(dims, req, source)
    fixed_len = fixed_flag_values(argv("extra_args"), source).get("max_model_len")
    if req.context_tokens and fixed_len is not None and fixed_len < req.context_tokens:
        raise _fail(source, "server.extra_args " + _cli("max_model_len"), f"{fixed_len} is below "
                    f"[requirement] context_tokens = {req.context_tokens}")
    for flag_name, spelled in fixed_flags(argv("extra_args")).items():
        if flag_name in space:
            # extra_args follow the searched flags on the command line, so the fixed value would
            # win at every launch: each trial recorded with a value it never ran
            raise _fail(source, f"space.{flag_name}", f"also fixed in [server] extra_args ({spelled}): "
                        "every launch would run the fixed value, whatever the search picks",
                        f"remove {spelled} from extra_args, or {flag_name} from [space]")
    required = [f.name for f in engines.flags() if f.required]
    for needed in required:
        if needed not in space:
            raise _fail(source, f"space.{needed}", "missing", "the search needs "
                        + ", ".join(required[:-1]) + " and " * (len(required) > 1) + required[-1])

    baselines = []
    for i, b in enumerate(top.get("baselines", [])):
        if not isinstance(b, dict):
            raise _fail(source, f"baselines[{i}]", "expected a table ([[baselines]])")
        allowed = {"name": str, **{f.name: _TYPES[f.kind] for f in engines.flags()}}
        b = _take(b, allowed, source, f"baselines[{i}]")
        for key, value in b.items():
            if key != "name":
                _check_value(key, value, source, f"baselines[{i}].{key}")
        baselines.append(Baseline(b.pop("name", f"baseline-{i}"), tuple(sorted(b.items()))))

    for key, value in workload.items():
        if key in ("prompt_tokens", "output_tokens", "single_stream_requests",
                   "throughput_requests", "max_concurrency", "waves", "max_waves", "ttft_level") and value < 1:
            raise _fail(source, f"workload.{key}", f"must be >= 1, got {value}")
        if key in ("warmup_requests", "level_seconds") and value < 0:
            raise _fail(source, f"workload.{key}", f"must be >= 0, got {value}")
        if key in ("request_timeout_s", "request_rate") and value is not None and value <= 0:
            raise _fail(source, f"workload.{key}", f"must be > 0, got {value}")
        if key == "max_failed_share" and not 0 <= value < 1:
            raise _fail(source, f"workload.{key}", f"must be a share from 0 to below 1, got {value}")
    if workload.get("endpoint", "completions") not in ("completions", "chat"):
        raise _fail(source, "workload.endpoint", "must be \"completions\" or \"chat\"")
    if workload.get("endpoint") == "chat" and not engines.get(engine_name).tokenizer_api.chat_messages:
        # prompts are sized with the server's /tokenize, which counts no chat prompt on this engine:
        # every launch would end before its load test
        raise _fail(source, "workload.endpoint", f"{engines.get(engine_name).label}'s /tokenize "
                    "counts no chat prompts, so no chat prompt of an exact length can be built",
                    "use endpoint = \"completions\"")
    wl = replace(Workload(), **workload, **{f"slo_{k}": v for k, v in slo.items()})
    from tuner.load.plan import closed_levels

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
        given = "launch_timeout_s" in overrides and overrides["launch_timeout_s"] is not None
        raise _fail(*(("command line", "--launch-timeout") if given
                      else (source, "server.launch_timeout_s")), f"must be > 0, got {timeout}")
    budget = overrides.get("memory_budget_gib")
    budget = server.get("memory_budget_gib") if budget is None else budget
    if budget is not None and budget <= 0:
        given = overrides.get("memory_budget_gib") is not None
        raise _fail(*(("command line", "--memory-budget-gib") if given
                      else (source, "server.memory_budget_gib")), f"must be > 0, got {budget}")
    budget_mode = server.get("memory_budget_mode", "share")
    if budget_mode not in MEMORY_BUDGET_MODES:
        raise _fail(source, "server.memory_budget_mode", f"unknown mode {budget_mode!r}",
                    "choose " + " or ".join(MEMORY_BUDGET_MODES))
    confirm = overrides.get("confirm", study.get("confirm", 0))
    if confirm < 0:
        raise _fail(source, "study.confirm", f"must be >= 0, got {confirm}")
    replicates = overrides.get("replicates", study.get("replicates", 2))
    if replicates < 0:
        raise _fail(source, "study.replicates", f"must be >= 0, got {replicates}")
    patience = overrides.get("patience", study.get("patience", 0))
    if patience < 0:
        raise _fail(source, "study.patience", f"must be >= 0, got {patience}")
    seed = overrides.get("seed", study.get("seed"))
    if seed is not None and not 0 <= seed < 2**32:
        raise _fail(source, "study.seed", f"must be 0 to 2**32 - 1, got {seed}")
    busy_wait = server.get("gpu_busy_wait_s", 120.0)
    if busy_wait < 0:
        raise _fail(source, "server.gpu_busy_wait_s", f"must be >= 0, got {busy_wait}")

    return StudyConfig(
        name=name, source=source, model=model_path, extra_args=argv("extra_args"),
        engine=command, engine_name=engine_name, env=tuple(sorted(env.items())),
        host=overrides.get("host") or server.get("host", "127.0.0.1"),
        launch_timeout_s=float(timeout), memory_budget_gib=budget, memory_budget_mode=budget_mode,
        dimensions=dims,
        baselines=tuple(baselines), workload=wl, requirement=req,
        storage=overrides.get("storage") or study.get("storage") or default_storage(name),
        results_dir=overrides.get("results_dir") or study.get("results_dir", "results"),
        sampler=sampler, seed=seed, confirm=confirm,
        replicates=replicates, patience=patience, gpu_busy_wait_s=busy_wait,
        use_memory_model=study.get("memory_model", True), screen=study.get("screen", True),
        tie_tolerance=study.get("tie_tolerance", 0.02), min_roofline_share=min_roofline_share,
    )


CLOSED_LOOP_STARTS = ("together", "staggered")


def _length_mix(workload: dict, source: str) -> None:
    """Check the [workload] length mix in place; a trace's path is resolved and read now."""
    from tuner.load.lengths import LENGTH_MIXES, TraceError, check_mix, read_trace, resolve_trace

    kind = workload.get("length_mix", "fixed")
    if kind not in LENGTH_MIXES:
        raise _fail(source, "workload.length_mix", f"unknown mix {kind!r}", "choose " + ", ".join(LENGTH_MIXES))
    for key in ("prompt_tokens_mix", "output_tokens_mix"):
        values = workload.get(key, [])
        if any(not isinstance(v, (int, float)) or isinstance(v, bool) for v in values):
            raise _fail(source, f"workload.{key}", f"expected numbers, got {values!r}")
        workload[key] = tuple(float(v) for v in values)
        if kind in ("uniform", "normal") and not values:
            continue   # that length stays fixed (prompt_tokens or output_tokens)
        problem = check_mix(kind, workload[key])
        if problem:
            raise _fail(source, f"workload.{key}", problem)
    if kind in ("uniform", "normal") and not (workload["prompt_tokens_mix"] or workload["output_tokens_mix"]):
        raise _fail(source, "workload.length_mix", f"a {kind} mix needs prompt_tokens_mix or output_tokens_mix")
    if kind == "trace" and not workload.get("length_trace"):
        raise _fail(source, "workload.length_trace", "missing: length_mix = \"trace\" draws the "
                    "lengths from a file", "set length_trace = a JSONL file of {\"prompt_tokens\", "
                    "\"output_tokens\"} lines next to the study file, or \"example\"")
    if kind != "trace" and workload.get("length_trace"):
        raise _fail(source, "workload.length_trace", f"is read only by a trace mix, and length_mix "
                    f"is {kind!r}", "set length_mix = \"trace\", or remove length_trace")
    if kind == "trace":
        try:
            path = resolve_trace(workload["length_trace"], Path(source).parent)
            read_trace(str(path))
        except TraceError as e:
            raise _fail(source, "workload.length_trace", e.problem) from None
        workload["length_trace"] = str(path)


def cut_space_to_requirement(dims: tuple["Dimension", ...], req: Requirement,
                             source: str) -> tuple["Dimension", ...]:
    """The space without max_model_len values below the required context: they cannot serve it."""
    need = req.context_tokens
    dim = next((d for d in dims if d.name == "max_model_len"), None)
    if not need or dim is None:
        return dims
    where = "space.max_model_len"
    if _bounds(dim)[1] < need:
        raise _fail(source, where, f"every value ({_describe(dim)}) is below [requirement] "
                    f"context_tokens = {need}", f"search max_model_len >= {need}")
    if dim.choices:
        new = replace(dim, choices=tuple(c for c in dim.choices if c >= need))
    elif dim.low < need:
        low = need if not dim.step else dim.low + math.ceil((need - dim.low) / dim.step) * dim.step
        if low > dim.high:
            raise _fail(source, where, f"no step of {_describe(dim)} reaches [requirement] "
                        f"context_tokens = {need}", f"search max_model_len >= {need}")
        new = replace(dim, low=int(low) if dim.kind == "int" else low)
    else:
        return dims
    return tuple(new if d is dim else d for d in dims)


def _wl_type(annotation):
    text = str(annotation)
    if "float" in text:
        return float
    if "int" in text:
        return int
    if "str" in text:
        return str
    return object
