"""How long a candidate will take before it is started: the budget check of ``tune``.

The loop's generic check (``TrialRunner.time_left``: one more chunk as long as the median chunk)
cannot see that some candidates cost far more than the median: a mechanism whose kernels compile
for each new tiling (issue 26: a fused-GEMV candidate built for 83 s when 40 s were left, and the
tune overran by more than 50 s). So every finished trial's wall seconds are kept by the set of
mechanisms it enables (its kernels, hence its compiles), seeded from the memory's earlier trials
of this deployment, and a candidate is started only if the slowest trial of its kind so far fits
in what is left. A kind never seen falls back to the generic check.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from specpilot.engine.config import EngineConfig


def kind(config: EngineConfig | dict[str, Any]) -> frozenset[str]:
    """The mechanisms a config enables (with W12's kernel, whose builds differ)."""
    mechs = config.mechanisms if isinstance(config, EngineConfig) else config.get("mechanisms", {})
    out = set(mechs)
    if "w12" in mechs:
        out.add(f"w12:{mechs['w12'].get('kernel', 'table')}")
    return frozenset(out)


class BuildEstimates:
    """Slowest seen wall seconds per :func:`kind`."""

    def __init__(self, earlier: Iterable[tuple[dict[str, Any], float]] = ()) -> None:
        self.slowest: dict[frozenset[str], float] = {}
        for config, wall in earlier:
            self.record(config, wall)

    def record(self, config: EngineConfig | dict[str, Any], wall_s: float) -> None:
        k = kind(config)
        self.slowest[k] = max(self.slowest.get(k, 0.0), wall_s)

    def estimate(self, config: EngineConfig) -> float | None:
        """Seconds the slowest trial of this kind took, or None if none ran yet."""
        return self.slowest.get(kind(config))

    def fits(self, configs: Iterable[EngineConfig], left_s: float) -> tuple[bool, str]:
        """Whether every config's estimate fits in ``left_s``; if not, why (for the log)."""
        for c in configs:
            est = self.estimate(c)
            if est is not None and est > left_s:
                names = ", ".join(sorted(kind(c))) or "stock"
                return False, f"a {names} candidate took {est:.0f}s here before, {left_s:.0f}s left"
        return True, ""


__all__ = ["BuildEstimates", "kind"]
