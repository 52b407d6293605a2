"""The engines the tuner can launch, by name; each one a module holding its flag table and its knowledge of the server."""

from __future__ import annotations

from tuner.engines.base import Engine, Flag, flag_argv  # noqa: F401

NAMES = ("vllm",)


def get(name: str = "vllm") -> Engine:
    """The engine called `name` (only vLLM so far)."""
    if name == "vllm":
        from tuner.engines.vllm import ENGINE

        return ENGINE
    raise KeyError(name)


def flags(name: str = "vllm") -> tuple[Flag, ...]:
    """The engine's flag table, read at call time (so a row added to it is seen everywhere)."""
    return get(name).flags


def flag(name: str, engine: str = "vllm") -> Flag | None:
    """One row of the engine's flag table by its TOML name, or None."""
    return next((f for f in flags(engine) if f.name == name), None)
