"""Per-row drafter block length for the static batched engine (``engine/widths.RowBlockLength``).

Each row verifies draft position j only while its estimated probability of reaching j (the
survival of its per-position acceptance EMA) stays at or above ``threshold``: a row that keeps
accepting drafts long, one that keeps missing early drafts short. Unlike ``tiered-budget`` there
is no global budget, so the verify size follows the batch's acceptance. (The eager engine's
online variant is ``per_request_k``.)
"""

from __future__ import annotations

from specpilot.engine.widths import RowBlockLength
from specpilot.mechanisms.registry import Knob
from specpilot.mechanisms.tiered_budget import width_policy_mechanism

MECHANISM = width_policy_mechanism(
    "row-block-len",
    RowBlockLength,
    Knob("threshold", 0.3, low=0.0, high=1.0, doc="verify position j while P(reach j) >= this"),
    "Per-request draft length from each row's acceptance (static batched engine)",
)
