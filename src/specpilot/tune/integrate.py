"""A round's winners, integrated: the best candidate of each direction that won, stacked on the
current best config (``TuneLoop`` re-measures the stack: gains do not simply add)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from specpilot.engine.config import EngineConfig
from specpilot.tune.evaluate import TrialResult
from specpilot.tune.proposal import Proposal

Derive = Callable[[EngineConfig, dict[str, Any]], EngineConfig]


def per_direction(
    winners: Sequence[tuple[Proposal, TrialResult]],
) -> dict[str, tuple[Proposal, TrialResult]]:
    """Each winning direction's fastest candidate, by direction name (first seen wins ties)."""
    out: dict[str, tuple[Proposal, TrialResult]] = {}
    for p, r in winners:
        if p.explorer not in out or r.speedup > out[p.explorer][1].speedup:
            out[p.explorer] = (p, r)
    return out


def stacked(
    best: EngineConfig,
    winners: Sequence[tuple[Proposal, TrialResult]],
    derive: Mapping[str, Derive],
) -> EngineConfig | None:
    """``best`` with every winning direction's fastest candidate applied in turn (each
    direction's ``derive`` by name), or None when only one direction won (nothing to stack)."""
    by_direction = per_direction(winners)
    if len(by_direction) < 2:
        return None
    cfg = best
    for p, _ in by_direction.values():
        cfg = derive[p.explorer](cfg, p.params)
    return cfg


__all__ = ["per_direction", "stacked"]
