"""The search space: ranges of each vLLM flag, and `ServerParams`, one point of it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerParams:
    """One candidate set of tuned vLLM flags. None means "leave vLLM's default"."""

    gpu_memory_utilization: float | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enforce_eager: bool | None = None
    kv_cache_dtype: str | None = None

    def vllm_flags(self) -> list[str]:
        """The flags as `vllm serve` spells them, in a fixed order; defaults are omitted."""
        flags: list[str] = []
        if self.gpu_memory_utilization is not None:
            flags += ["--gpu-memory-utilization", f"{self.gpu_memory_utilization:g}"]
        if self.max_model_len is not None:
            flags += ["--max-model-len", str(self.max_model_len)]
        if self.max_num_seqs is not None:
            flags += ["--max-num-seqs", str(self.max_num_seqs)]
        if self.max_num_batched_tokens is not None:
            flags += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        if self.enforce_eager:
            flags += ["--enforce-eager"]
        if self.kv_cache_dtype is not None:
            flags += ["--kv-cache-dtype", self.kv_cache_dtype]
        return flags


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
    """ServerParams from a dict of flag values keyed by field name (unknown keys ignored)."""
    known = ServerParams.__dataclass_fields__
    return ServerParams(**{k: v for k, v in values.items() if k in known})


def scaled(params: ServerParams, memory_scale: float | None) -> ServerParams:
    """The params to launch when the study caps memory: gmu is then a share of the budget.

    With a 16 GiB budget on a 140 GiB card, a searched gmu of 0.92 launches as 0.92 * 16 / 140.
    """
    if memory_scale is None or params.gpu_memory_utilization is None:
        return params
    from dataclasses import replace
    return replace(params, gpu_memory_utilization=round(params.gpu_memory_utilization * memory_scale, 4))
