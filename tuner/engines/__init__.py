"""The engines the tuner can launch, by name; each one a module holding its flag table and its knowledge of the server."""

from __future__ import annotations

from tuner.engines.base import Engine, Flag, flag_argv  # noqa: F401

NAMES = ("vllm", "llamacpp", "sglang")
DEFAULT = "vllm"

# The engine of the study being run: a process tunes one study at a time, and the flag table it
# searches is that engine's. `use` sets it (config.parse_study does, from `[server] engine`);
# the table readers (space, config, report, export) read it through `flags()`.
_current = DEFAULT


class UnknownEngine(KeyError):
    """A name that is not one of NAMES."""


def get(name: str | None = None) -> Engine:
    """The engine called `name` (None: the one in use)."""
    name = name or _current
    if name == "vllm":
        from tuner.engines.vllm import ENGINE

        return ENGINE
    if name == "llamacpp":
        from tuner.engines.llamacpp import ENGINE

        return ENGINE
    if name == "sglang":
        from tuner.engines.sglang import ENGINE

        return ENGINE
    raise UnknownEngine(name)


def use(name: str) -> Engine:
    """Make `name` the engine in use; the engine."""
    global _current
    engine = get(name)
    _current = name
    return engine


def current() -> str:
    return _current


def flags(name: str | None = None) -> tuple[Flag, ...]:
    """The engine's flag table, read at call time (so a row added to it is seen everywhere)."""
    return get(name).flags


def flag(name: str, engine: str | None = None) -> Flag | None:
    """One row of the engine's flag table by its TOML name, or None."""
    return next((f for f in flags(engine) if f.name == name), None)
