"""What a per-step saving predicts for a step: the one formula the mechanisms' cost models share
(``decode_attn_cost``, ``exact_argmax_cost``, ``fused_gemv_cost``, ``l2_prefetch_cost``)."""

from __future__ import annotations


def step_speedup(step_s: float, saved_s: float) -> float:
    """A step of ``step_s`` without the mechanism over the same step with it, which takes
    ``saved_s`` off (negative: adds)."""
    return step_s / max(step_s - saved_s, 1e-12)


__all__ = ["step_speedup"]
