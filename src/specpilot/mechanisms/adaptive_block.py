"""Per-request drafter block length, adapted online from each request's own acceptance.

In a batch, every drafted token costs verify compute on its row whether or not it is accepted,
and a batched verify is no longer free the way a batch-1 verify is (the GEMMs leave the
memory-bound regime as rows x tokens grows). So each request drafts about what it has been
accepting: an exponential moving average of its accepted length, plus ``slack`` tokens of
headroom (so a row that accepts everything keeps growing), clamped to ``[k_min, k]``. A request
that copies from its prompt keeps long blocks; one the drafter cannot predict stops paying for k.

Variant built: a width policy (``engine/widths.WidthPolicy``) of the chain verify plan: each row's
block is chosen before drafting; the drafter drafts up to its ``k`` and each row keeps at most its
own block (the dense verify pads to the widest row; with ``ragged-verify`` each row verifies only
its own).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from specpilot.errors import SpecPilotError
from specpilot.mechanisms.registry import Applicability, Knob, Mechanism

if TYPE_CHECKING:
    from specpilot.mechanisms.parts import EngineParts


@dataclass(slots=True)
class AdaptiveBlock:
    """``block = clamp(ceil(EMA(accepted) + slack), k_min, k)`` per row; starts optimistic at k."""

    k_min: int = 1
    """Fewest tokens a row drafts; at least 1, so that a row keeps probing its acceptance."""
    alpha: float = 0.3
    """Weight of the latest cycle in the moving average."""
    slack: float = 1.0
    """Tokens drafted beyond the expected accepted length."""
    name: str = "adaptive_block"
    k: int = 0
    ema: list[float] = field(default_factory=list)
    """Per row: the moving average of its accepted length."""

    def __post_init__(self) -> None:
        if self.k_min < 1:
            raise ValueError(f"k_min must be at least 1, got {self.k_min}")
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")
        if self.slack < 0:
            raise ValueError(f"slack must be at least 0, got {self.slack}")

    def reset(self, batch: int, k: int, bucket: int) -> None:
        self.k = k
        self.ema = [float(k)] * batch

    def reset_row(self, row: int) -> None:
        self.ema[row] = float(self.k)

    def block(self, row: int) -> int:
        want = math.ceil(self.ema[row] + self.slack - 1e-9)
        return max(min(self.k_min, self.k), min(want, self.k))

    def widths(self, active: Sequence[bool]) -> list[int]:
        return [1 + self.block(b) if a else 0 for b, a in enumerate(active)]

    def observe(self, row: int, drafted: int, accepted: int) -> None:
        if drafted > 0:
            self.ema[row] += self.alpha * (accepted - self.ema[row])


def _apply(build: EngineParts, knobs: Mapping[str, Any]) -> None:
    if build.width_policy is not None:
        raise SpecPilotError(
            f"Enable only one width policy; '{build.width_policy.name}' is already enabled."
        )
    build.width_policy = AdaptiveBlock(
        k_min=int(knobs["k_min"]), alpha=float(knobs["alpha"]), slack=float(knobs["slack"])
    )


MECHANISM = Mechanism(
    name="adaptive-block",
    component="verify",
    plug_point="drafter_schedule",
    lossless=(
        "It only chooses how many tokens each request drafts; the verify is unchanged and still "
        "commits only drafted tokens equal to the target's argmax plus the target's bonus token, "
        "so any block length commits the same tokens (fewer or more per cycle)."
    ),
    apply=_apply,
    knobs=(
        Knob("k_min", 1, low=1, high=8, doc="fewest tokens a request drafts per cycle"),
        Knob("alpha", 0.3, low=0.05, high=1.0, doc="EMA weight of the latest accepted length"),
        Knob("slack", 1.0, low=0.0, high=4.0, doc="tokens drafted beyond the expected accepted"),
    ),
    applies=Applicability(drafters=("ngram", "draft-model"), modes=("batched",)),
    summary="Per-request block length from an EMA of each request's accepted length (batched)",
)
