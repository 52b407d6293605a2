"""The search space: `ServerParams`, one point of it, drawn from the study's dimensions."""

from __future__ import annotations

from dataclasses import dataclass

from tuner import engines


@dataclass(frozen=True)
class ServerParams:
    """One candidate set of tuned flags. None means "leave the engine's default".

    The named fields are the flags the memory model reasons about; any other row of the engine's
    flag table rides in `extra` (sorted (name, value) pairs), so adding a flag is one table row.
    """

    gpu_memory_utilization: float | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enforce_eager: bool | None = None
    kv_cache_dtype: str | None = None
    cpu_offload_gb: float | None = None
    extra: tuple[tuple[str, object], ...] = ()

    def value(self, name: str):
        """The value of one flag of the table (None when unset)."""
        if name in _FIELDS:
            return getattr(self, name)
        return dict(self.extra).get(name)

    def values(self) -> dict:
        """Every set flag by name, in the table's order."""
        return {f.name: self.value(f.name) for f in engines.flags()
                if self.value(f.name) is not None}

    def vllm_flags(self) -> list[str]:
        """The flags as the engine spells them, in the table's order; defaults are omitted."""
        return engines.flag_argv(engines.flags(), self.values())


_FIELDS = frozenset(f for f in ServerParams.__dataclass_fields__ if f != "extra")


def suggest(trial, dimensions) -> ServerParams:
    """Draw one ServerParams from an Optuna trial (a FrozenTrial replays its stored params)."""
    values = {}
    for d in dimensions:
        if d.choices:
            values[d.name] = trial.suggest_categorical(d.name, list(d.choices))
        elif d.kind == "float":
            values[d.name] = trial.suggest_float(d.name, d.low, d.high, step=d.step, log=d.log)
        else:
            values[d.name] = trial.suggest_int(d.name, int(d.low), int(d.high),
                                               step=int(d.step or 1), log=d.log)
    return params_from(values)


def params_from(values: dict) -> ServerParams:
    """ServerParams from a dict of flag values keyed by flag name (names not in the table ignored)."""
    table = {f.name for f in engines.flags()}
    named = {k: v for k, v in values.items() if k in _FIELDS}
    extra = tuple(sorted((k, v) for k, v in values.items()
                         if k in table and k not in _FIELDS and v is not None))
    return ServerParams(**named, extra=extra)


def scaled(params: ServerParams, memory_scale: float | None) -> ServerParams:
    """The params to launch when the study caps memory: gmu is then a share of the budget.

    With a 16 GiB budget on a 140 GiB card, a searched gmu of 0.92 launches as 0.92 * 16 / 140.
    """
    if memory_scale is None or params.gpu_memory_utilization is None:
        return params
    from dataclasses import replace
    return replace(params, gpu_memory_utilization=round(params.gpu_memory_utilization * memory_scale, 4))
