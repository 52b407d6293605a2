"""The user's requirement: the context a config must serve and the sequences of it its KV cache must hold."""

from __future__ import annotations

from tuner.records import Requirement


def sequences_at_context(kv_cache_tokens: int | None, context_tokens: int | None) -> int | None:
    """How many requests of `context_tokens` fit in the KV cache at once (None when unknown)."""
    if not kv_cache_tokens or not context_tokens:
        return None
    return kv_cache_tokens // context_tokens


def context_shortfall(max_model_len: int | None, req: Requirement) -> float:
    """How far a context below the required one misses (> 0), 0 when it serves it or is unknown."""
    if not req.context_tokens or max_model_len is None or max_model_len >= req.context_tokens:
        return 0.0
    return max(0.01, req.context_tokens / max_model_len - 1)


def context_message(name: str, context: int | None, req: Requirement) -> str:
    """Why a config's context misses the requirement, in the words every command uses."""
    return f"{name} {context} < [requirement] context_tokens {req.context_tokens}"


def capacity_message(kv_cache_tokens: int | None, req: Requirement) -> str:
    """Why a launched server's KV cache misses the requirement, in the words every command uses."""
    return (f"the KV cache holds {kv_cache_tokens} tokens: "
            f"{sequences_at_context(kv_cache_tokens, req.context_tokens)} sequences of "
            f"{req.context_tokens} tokens, [requirement] asks {req.sequences_at_context}")


def capacity_shortfall(kv_cache_tokens: int | None, req: Requirement) -> float:
    """How far a launched server's KV cache misses the required sequences at context (> 0), else 0.

    Unknown capacity (vLLM logged no KV cache size) is not held against the config.
    """
    held = sequences_at_context(kv_cache_tokens, req.context_tokens)
    if not req.sequences_at_context or held is None or held >= req.sequences_at_context:
        return 0.0
    return max(0.01, 1 - kv_cache_tokens / (req.sequences_at_context * req.context_tokens))


def predicted_shortfall(prediction, req: Requirement, calibrated: bool) -> tuple[float, int]:
    """How far a config that the memory model says starts would still miss the required sequences
    at context (> 0, else 0), judged at the most KV cache its uncertainty band allows; and that
    most, in tokens. Nothing is held against a config before the model is calibrated by a launch."""
    if (not req.sequences_at_context or not req.context_tokens or prediction is None
            or not calibrated or not prediction.fits or prediction.kv_bytes_per_token <= 0):
        return 0.0, 0
    most = int(prediction.kv_cache_tokens + prediction.band_gib * 2**30 / prediction.kv_bytes_per_token)
    return capacity_shortfall(most, req), most
