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
from specpilot.errors import SpecPilotError
from specpilot.mechanisms.registry import Applicability, Knob, Mechanism
from specpilot.mechanisms.tiered_budget import LOSSLESS

if TYPE_CHECKING:
    from specpilot.engine.build import EngineBuild


def _apply(build: EngineBuild, knobs: Mapping[str, Any]) -> None:
    if build.width_policy is not None:
        raise SpecPilotError(
            f"Enable only one width policy; '{build.width_policy.name}' is already enabled."
        )
    build.width_policy = RowBlockLength(
        threshold=float(knobs["threshold"]),
        decay=float(knobs["decay"]),
        prior=float(knobs["prior"]),
        min_draft=int(knobs["min_draft"]),
    )
    build.packed_bucket = build.packed_bucket or 16


MECHANISM = Mechanism(
    name="row-block-len",
    component="verify",
    plug_point="drafter_schedule",
    lossless=LOSSLESS,
    apply=_apply,
    knobs=(
        Knob("threshold", 0.3, low=0.0, high=1.0, doc="verify position j while P(reach j) >= this"),
        Knob("decay", 0.2, low=0.01, high=1.0, doc="weight of the newest cycle in the EMA"),
        Knob("prior", 0.8, low=0.0, high=1.0, doc="initial per-position acceptance estimate"),
        Knob("min_draft", 1, low=0, high=16, doc="drafts every row verifies regardless"),
    ),
    engines=("static",),
    applies=Applicability(modes=("batched",)),
    summary="Per-request draft length from each row's acceptance (static batched engine)",
)
