"""What a per-step saving predicts for a step: the one formula the mechanisms' cost models share
(``decode_attn_cost``, ``exact_argmax_cost``, ``fused_gemv_cost``, ``l2_prefetch_cost``), and
the base of their predictions (:class:`StepSaving`)."""

from __future__ import annotations

from abc import ABC, abstractmethod


def step_speedup(step_s: float, saved_s: float) -> float:
    """A step of ``step_s`` without the mechanism over the same step with it, which takes
    ``saved_s`` off (negative: adds)."""
    return step_s / max(step_s - saved_s, 1e-12)


class StepSaving(ABC):
    """A prediction of the time a mechanism takes off one step (forward)."""

    __slots__ = ()

    @property
    @abstractmethod
    def saved_s(self) -> float:
        """Seconds taken off one step (negative: added)."""

    def speedup(self, step_s: float) -> float:
        """A step of ``step_s`` without the mechanism over the same step with it."""
        return step_speedup(step_s, self.saved_s)


__all__ = ["StepSaving", "step_speedup"]
