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
