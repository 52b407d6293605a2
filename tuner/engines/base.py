"""What an engine tells the tuner: its flag table, the argv of a config, readiness, log verdicts, capacity, metric names, defaults."""

from __future__ import annotations

import importlib
import math
import re
from dataclasses import dataclass
from typing import Protocol

KINDS = ("float", "int", "bool", "str")
_PARSE = {"float": float, "int": int, "str": str}


@dataclass(frozen=True)
class Flag:
    """One searchable flag: adding a flag to the tuner is adding one of these to an engine's table.

    The name is the TOML key ([space], [[baselines]]), the ServerParams value and the CSV column.
    """

    name: str                      # e.g. "max_num_seqs"
    kind: str                      # float | int | bool | str
    cli: str                       # the engine's spelling, e.g. "--max-num-seqs"
    default: object = None         # the engine's value when the flag is absent (assumed when it cannot be
    #                                asked; None = it depends on the model)
    read_default: str = ""         # where the engine's resolved config holds its default ("" = not read)
    # How the flag moves what fits in memory, for "an earlier launch already failed for memory":
    #   "supply": more of it gives the KV cache more memory (a failure at a higher value rules this out)
    #   "demand": more of it needs more KV cache per request (a failure at a lower value rules this out)
    #   "equal":  it changes what fits, in no order: only failures with the same value say anything
    #   "":       it does not change whether one request fits
    memory: str = ""
    # What the flag does to speed, for screening a config with launches already measured
    # (search/screen.py):
    #   "slots": caps the requests served at once (max_num_seqs): with fewer slots a config can
    #            at best match a measured launch's figures at that concurrency
    #   "size":  only sizes memory (a KV share, the context): a config that starts is no faster
    #            than one with the same other flags
    #   "":      may change speed in ways not modelled (graphs, batching, offload, dtype)
    speed: str = ""
    low: float | None = None       # allowed range (None = unbounded on that side)
    high: float | None = None
    low_open: bool = False         # low itself is refused: (low, high]
    choices: tuple = ()            # allowed values of a str flag
    required: bool = False         # every study searches it
    hand_tuned: object = None      # the hand-tuned baseline's value
    help: str = ""
    aliases: tuple[str, ...] = ()  # the engine's other spellings (llama.cpp's --ctx-size for -c)

    @property
    def spellings(self) -> tuple[str, ...]:
        """Every way the engine takes this flag on its command line, `cli` first."""
        return (self.cli, *self.aliases)

    @property
    def takes_value(self) -> bool:
        """A bool flag is present or absent (`--enforce-eager`); every other flag takes a value."""
        return self.kind != "bool"

    def parse(self, text: str):
        """The value of `--flag TEXT`; the text itself when it does not parse (then `problem` says why)."""
        try:
            return _PARSE[self.kind](text)
        except (KeyError, ValueError):
            return text

    def argv(self, value) -> list[str]:
        """The flag as the engine spells it; [] for an unset value or a false bool."""
        if value is None or (self.kind == "bool" and not value):
            return []
        if self.kind == "bool":
            return [self.cli]
        return [self.cli, f"{value:g}" if self.kind == "float" else str(value)]

    def problem(self, value, engine: str = "the engine") -> str | None:
        """Why the engine would refuse `value`, in one phrase; None when it accepts it."""
        name = self.name
        if self.kind == "bool":
            return None if isinstance(value, bool) else f"{name} must be true or false, got {value!r}"
        if self.kind == "str":
            if self.choices and value not in self.choices:
                return f"{name} {value!r} is not one of {engine}'s: " + ", ".join(self.choices)
            return None if isinstance(value, str) else f"{name} must be a string, got {value!r}"
        numeric = (int, float) if self.kind == "float" else (int,)
        ok = not isinstance(value, bool) and isinstance(value, numeric)
        if ok and self.kind == "float":
            ok = math.isfinite(value)   # nan and inf pass no range check an engine would make
        if ok and self.low is not None:
            ok = value > self.low if self.low_open else value >= self.low
        if ok and self.high is not None:
            ok = value <= self.high
        if ok:
            return None
        if self.kind == "float":
            lo = "(" if self.low_open else "["
            hi = "inf)" if self.high is None else f"{self.high:g}]"
            return f"{name} must be in {lo}{_g(self.low, '-inf')}, {hi}, got {value}"
        if self.low == 1 and self.high is None:
            return f"{name} must be a positive integer (>= 1), got {value}"
        if self.high is None:
            return f"{name} must be an integer >= {self.low:g}, got {value}"
        return f"{name} must be an integer in [{_g(self.low, '-inf')}, {self.high:g}], got {value}"


def _g(x, none: str) -> str:
    return none if x is None else f"{x:g}"


def flag_argv(flags: tuple[Flag, ...], values: dict) -> list[str]:
    """Any dict of flag values as command-line flags, in the table's order (the one place a value
    becomes a flag, as vLLM's sweep `apply_to_cmd` does)."""
    out: list[str] = []
    for f in flags:
        out += f.argv(values.get(f.name))
    return out


@dataclass(frozen=True)
class TokenizerApi:
    """How a server's /tokenize and /detokenize are asked: the JSON keys differ between engines."""

    text_key: str                  # request key of the text to tokenize
    special_key: str               # request key of "add the special tokens (BOS)"
    count_key: str                 # response key of the token count ("" = len(tokens))
    detokenized_key: str           # response key of /detokenize's text
    chat_messages: bool            # /tokenize takes chat `messages` (else no chat prompts)
    special_by_default: bool = True  # a body without special_key adds them (as the request does)
    out_of_range_5xx: bool = False   # /detokenize of an id past the vocabulary is HTTP 500, not a fault
    tokenize_path: str = "/tokenize"
    detokenize_path: str = "/detokenize"

    def tokenize_body(self, model: str, text: str, add_special: bool) -> dict:
        body = {"model": model, self.text_key: text}
        if not (add_special and self.special_by_default):
            body[self.special_key] = add_special
        return body

    def count(self, answer: dict):
        """The token count of a /tokenize answer, None when it holds none."""
        if self.count_key:
            return answer.get(self.count_key)
        tokens = answer.get("tokens")
        return len(tokens) if isinstance(tokens, list) else None


class LogsInModule:
    """For an engine whose log knowledge is a sibling module (`logs_module`) with classify,
    parse_capacity and launch_phases: each method imports it on first use, so reading a study file
    never loads the patterns."""

    logs_module: str = ""

    def classify(self, log_text: str):
        return importlib.import_module(self.logs_module).classify(log_text)

    def parse_capacity(self, log_text: str, metrics_text: str = "", ready_s: float = 0.0):
        return importlib.import_module(self.logs_module).parse_capacity(log_text, metrics_text, ready_s)

    def launch_phases(self, log_text: str) -> dict[str, float]:
        return importlib.import_module(self.logs_module).launch_phases(log_text)


class Engine(Protocol):
    """An inference server the tuner can launch and measure."""

    name: str                        # "vllm"
    label: str                       # how messages name it: "vLLM"

    @property
    def flags(self) -> tuple[Flag, ...]:
        """The searchable flags, in the order they are written on a command line."""

    def argv(self, engine_cmd: tuple[str, ...], model: str, flag_values: dict,
             extra_args: tuple[str, ...], host: str, port: int) -> list[str]:
        """The server's full command line for one config."""

    readiness_paths: tuple[str, ...]   # GET paths that all answer 200 once the server serves
    metric_prefix: str                 # of its /metrics samples ("vllm:", "llamacpp:")
    metric_names: dict[str, str]       # preemptions, kv_cache_usage, requests_waiting, ttft_seconds,
    #                                    itl_seconds -> its sample name (absent: it has none)
    tokenizer_api: TokenizerApi        # its /tokenize and /detokenize
    api_key_env: str                   # the environment variable holding its API key
    keep_alive: bool                   # a connection serves more than one streamed request

    # modules its console script imports first, for a warm spare to import ahead (run/spare.py);
    # an engine without the attribute gets none (a `python -m MODULE` command needs none)
    warm_imports: tuple[str, ...]

    request_context_name: str          # how messages name the longest request ("max_model_len")
    export_cmd: tuple[str, ...]        # the program an exported command starts ("vllm", "serve")
    default_port: int                  # where it serves without --port

    def request_context(self, values: dict) -> int | None:
        """The longest request (prompt + output tokens) a config's flag values serve; None = unknown."""

    def fixed_output(self, output_tokens: int) -> dict:
        """Request fields that make the output exactly `output_tokens` long (no early EOS)."""

    def default_cmd(self) -> tuple[str, ...]:
        """The command that starts the server when the study names none."""

    def env(self) -> dict[str, str]:
        """Environment the server needs beyond the caller's."""

    def version(self) -> str:
        """The installed engine's version ("" when unknown)."""

    def served_model(self, model: str) -> str:
        """The model argument the server is given for a model folder (a GGUF written for it...)."""

    def classify(self, log_text: str):
        """The LaunchFailure a server log shows, or None if it shows none."""

    def parse_capacity(self, log_text: str, metrics_text: str = "", ready_s: float = 0.0):
        """Capacity facts from a ready server's log (and its /metrics page)."""

    def launch_phases(self, log_text: str) -> dict[str, float]:
        """Seconds of each launch phase its log names ("weights", "compile", "profile", "graphs");
        {} when the engine's log names none."""

    server_gauges: tuple[str, ...]     # /metrics gauges the load test samples (peaks)
    server_counters: tuple[str, ...]   # /metrics counters it differences over a level

    def read_defaults(self, engine_cmd: tuple[str, ...], model: str, extra_args: tuple[str, ...],
                      env: dict | None = None) -> dict | None:
        """The engine's own values of its flags when absent, for this model and device; None when
        they cannot be read (then each flag's `default` is assumed)."""

    def budget_batch_defaults(self, budget_gib: float, platform) -> dict:
        """Flag values the engine would pick by itself on a card of `budget_gib` where they differ
        from this device's, for a launch under a memory budget to pin ({} when none differ)."""

    def memory_model(self, model_dir: str, device_memory_bytes: int, platform: str,
                     extra_args=(), device_name: str = ""):
        """A model predicting which configs fit in memory, or None when the engine has none;
        `extra_args` are the fixed flags it is launched with (a --dtype among them); the device's
        name decides some of vLLM's defaults (an A100 gets the small batch defaults)."""


# ---------------------------------------------------------------- helpers for log classifiers

# A Python exception line, also behind vLLM's "(EngineCore pid=N) ERROR date time [file]" prefix.
_EXCEPTION_LINE = re.compile(r"^\s*(?:\([^)]*pid=\d+\)\s*)?(?:ERROR\s+[\d-]+\s+[\d:.]+\s+\[[^\]]*\]\s*)?"
                             r"[\w.]*(?:Error|Exception):\s.*$", re.M)
# argparse refusing the command line ("api_server.py: error: unrecognized arguments: --x", the
# xllamacpp wrapper's "llama-server (xllamacpp): error: ..."): the program's name, then the reason.
# It prints no exception, so without this a bad fixed flag read "server exited with code 2".
_USAGE_ERROR = re.compile(r"^[^\s:][^:\n]*: error: \S.*$", re.M)
_PYDANTIC_HEAD = re.compile(r"\d+ validation errors? for [\w.]+$")
TAIL_LINES = 40


def log_tail(text: str, lines: int = TAIL_LINES) -> str:
    """The last lines of a log, kept with a failure."""
    return "\n".join(text.rstrip("\n").splitlines()[-lines:])


def line_at(text: str, pos: int) -> str:
    """The whole line of `text` around offset `pos`."""
    start = text.rfind("\n", 0, pos) + 1
    end = text.find("\n", pos)
    return text[start:end if end >= 0 else len(text)].strip()


def root_cause(log_text: str) -> str:
    """The first exception line of the log (servers print the root cause before the wrappers),
    else the line with which the server's argument parser refused its command line; "" if none."""
    found = _EXCEPTION_LINE.search(log_text) or _USAGE_ERROR.search(log_text)
    if not found:
        return ""
    cause = found[0].strip()
    if _PYDANTIC_HEAD.search(cause):
        # "1 validation error for ModelConfig" says nothing yet: the reason is the indented line
        # below it ("  Value error, The checkpoint ... has model type `foobar` but ...")
        below = log_text[found.end():].lstrip("\n").split("\n", 1)[0]
        if below[:1].isspace() and below.strip():
            cause += ": " + below.strip()
    return cause
