"""Tiered verification budget for the static batched engine (``engine/widths.TieredBudget``).

Each cycle, ``budget × active rows`` verify tokens (rounded up to the packed bucket) are divided
among the rows by expected gain: every row keeps its pending token plus ``min_draft`` drafts, and
each further token goes to the row whose next draft position has the highest estimated
probability of being accepted (its per-position acceptance EMA). At B = 16..24 a verify of
``B × (k + 1)`` rows is no longer free, so the tokens are spent where they are likely to land.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from specpilot.engine.widths import TieredBudget, WidthPolicy
from specpilot.errors import SpecPilotError
from specpilot.mechanisms.registry import Applicability, Knob, Mechanism

if TYPE_CHECKING:
    from specpilot.mechanisms.parts import EngineParts

LOSSLESS = (
    "It only chooses how many of the drafted tokens each row verifies; the verify is exact and "
    "acceptance runs per row on its own width, so every committed token is an accepted draft "
    "equal to the target's argmax or the target's bonus token; unverified drafts and padding "
    "rows are never committed."
)


EMA_KNOBS = (
    Knob("decay", 0.2, low=0.01, high=1.0, doc="weight of the newest cycle in the EMA"),
    Knob("prior", 0.8, low=0.0, high=1.0, doc="initial per-position acceptance estimate"),
    Knob("min_draft", 1, low=0, high=16, doc="drafts every row verifies regardless"),
)
"""Knobs of the per-row, per-position acceptance average that every width policy keeps."""


def install_width_policy(build: EngineParts, policy: WidthPolicy) -> None:
    """Give the static engine its (single) width policy and a packed verify to carry it."""
    if build.width_policy is not None:
        raise SpecPilotError(
            f"Enable only one width policy; '{build.width_policy.name}' is already enabled."
        )
    build.width_policy = policy
    build.packed_bucket = build.packed_bucket or 16


def width_policy_mechanism(
    name: str, policy: Callable[..., WidthPolicy], knob: Knob, summary: str
) -> Mechanism:
    """A batched-mode mechanism that installs one width policy: ``policy(<knob>=..., decay=...,
    prior=..., min_draft=...)`` from its own first knob and the shared EMA knobs."""

    def apply(build: EngineParts, knobs: Mapping[str, Any]) -> None:
        ema = {"decay": float(knobs["decay"]), "prior": float(knobs["prior"])}
        first = {knob.name: float(knobs[knob.name]), "min_draft": int(knobs["min_draft"])}
        install_width_policy(build, policy(**first, **ema))

    return Mechanism(
        name=name,
        component="verify",
        plug_point="drafter_schedule",
        lossless=LOSSLESS,
        apply=apply,
        knobs=(knob, *EMA_KNOBS),
        applies=Applicability(modes=("batched",)),
        summary=summary,
    )


MECHANISM = width_policy_mechanism(
    "tiered-budget",
    TieredBudget,
    Knob("budget", 6.0, low=1.0, high=32.0, doc="verify tokens per active row per cycle"),
    "Divide a per-cycle verify-token budget among rows by expected accepted tokens",
)
