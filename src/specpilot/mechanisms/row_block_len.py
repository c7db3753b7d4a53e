"""Per-row drafter block length for the static batched engine (``engine/widths.RowBlockLength``).

Each row verifies draft position j only while its estimated probability of reaching j (the
survival of its per-position acceptance EMA) stays at or above ``threshold``: a row that keeps
accepting drafts long, one that keeps missing early drafts short. Unlike ``tiered-budget`` there
is no global budget, so the verify size follows the batch's acceptance. (The eager engine's
online variant is ``per_request_k``.)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from specpilot.engine.widths import RowBlockLength
from specpilot.mechanisms.registry import Applicability, Knob, Mechanism
from specpilot.mechanisms.tiered_budget import EMA_KNOBS, LOSSLESS, install_width_policy

if TYPE_CHECKING:
    from specpilot.mechanisms.parts import EngineParts


def _apply(build: EngineParts, knobs: Mapping[str, Any]) -> None:
    policy = RowBlockLength(
        threshold=float(knobs["threshold"]),
        decay=float(knobs["decay"]),
        prior=float(knobs["prior"]),
        min_draft=int(knobs["min_draft"]),
    )
    install_width_policy(build, policy)


MECHANISM = Mechanism(
    name="row-block-len",
    component="verify",
    plug_point="drafter_schedule",
    lossless=LOSSLESS,
    apply=_apply,
    knobs=(
        Knob("threshold", 0.3, low=0.0, high=1.0, doc="verify position j while P(reach j) >= this"),
        *EMA_KNOBS,
    ),
    applies=Applicability(modes=("batched",)),
    summary="Per-request draft length from each row's acceptance (static batched engine)",
)
