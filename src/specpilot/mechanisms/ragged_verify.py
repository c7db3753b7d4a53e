"""Packed ragged verify (``engine/plans.PackedPlan`` over ``models/layout.PackedLayout``).

Row b of a batch verifies its own width ``w_b`` in one target forward: the projections, MLP and
LM head run on the ``sum(w_b)`` real rows rounded up to ``bucket`` (one CUDA graph per bucket and
attention length), attention pads per row under the causal additive mask, and K/V are written for
real tokens only. On its own (every row at ``k + 1``) it drops finished rows from the verify GEMMs;
with a width policy (``tiered-budget``, ``row-block-len``) it is what turns fewer verify tokens
into less verify time.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from specpilot.mechanisms.registry import Applicability, Knob, Mechanism

if TYPE_CHECKING:
    from specpilot.mechanisms.parts import EngineParts


def _apply(build: EngineParts, knobs: Mapping[str, Any]) -> None:
    build.packed_bucket = int(knobs["bucket"])


MECHANISM = Mechanism(
    name="ragged-verify",
    component="verify",
    plug_point="kernel_choice",
    lossless=(
        "Each real token of the packed verify gets the same inputs, positions, visible keys and "
        "weights as in the padded verify, so its argmax is the target's own (up to kernel "
        "rounding, counted as near-ties in bf16); padding rows are masked from every real query, "
        "write K/V only to a slot no query sees, and are never committed; acceptance runs per row "
        "on its own width, committing the accepted drafts and the target's bonus token."
    ),
    apply=_apply,
    knobs=(Knob("bucket", 16, choices=(8, 16, 32, 64), doc="packed rows are rounded up to this"),),
    applies=Applicability(modes=("batched",)),
    summary="Verify a different width per row in one packed forward (GEMMs on sum(w_b) rows)",
)
