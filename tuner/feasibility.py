"""Memory model: KV bytes per token, KV budget for a gpu-memory-utilization, what fits; roofline."""

from __future__ import annotations

# SKELETON (owner: feasibility helper).
