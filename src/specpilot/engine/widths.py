"""Per-row verify widths for the packed ragged verify of the static batched engine.

A width policy runs on the host between cycles: it knows each row's accepted length from the
cycle's one read-back (so choosing widths costs no extra sync) and returns ``w_b`` per row, the
tokens row b verifies next cycle (1 = the pending token alone, ``k + 1`` = pending + every draft).
Whatever the widths, the committed tokens are the target's argmax (the verify is exact and
acceptance runs per row on its own width), so a policy changes speed, never output.

Policies:

* :class:`FixedWidths` — every active row verifies ``k + 1`` (the stock engine, packed);
* :class:`TieredBudget` — a per-step budget of verify tokens is handed out one token at a time to
  the row whose next draft position has the highest estimated probability of being accepted
  (the survival ``prod_{i<=j} r_b[i]`` of the row's per-position acceptance EMA);
* :class:`RowBlockLength` — each row drafts as far as its survival stays above a threshold
  (per-request drafter block length, no global budget).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol


class WidthPolicy(Protocol):
    name: str

    def reset(self, batch: int, k: int, bucket: int) -> None:
        """Start a batch of ``batch`` rows drafting up to ``k`` tokens each; the packed verify
        rounds its rows up to a multiple of ``bucket``."""
        ...

    def widths(self, active: Sequence[bool]) -> list[int]:
        """Verify width per row for the next cycle (0 for inactive rows)."""
        ...

    def observe(self, row: int, drafted: int, accepted: int) -> None:
        """Row ``row`` verified ``drafted`` drafts and accepted the first ``accepted``."""
        ...

    def reset_row(self, row: int) -> None:
        """Row ``row`` takes a new sequence (continuous batching): forget the old one."""
        ...


class FixedWidths:
    name = "fixed"

    def __init__(self) -> None:
        self.k = 0

    def reset(self, batch: int, k: int, bucket: int) -> None:
        self.k = k

    def widths(self, active: Sequence[bool]) -> list[int]:
        return [self.k + 1 if a else 0 for a in active]

    def observe(self, row: int, drafted: int, accepted: int) -> None:
        return None

    def reset_row(self, row: int) -> None:
        return None


class AcceptanceEMA:
    """Per-row, per-draft-position conditional acceptance rates ``r_b[j]`` (exponential average).

    Position j of a row is *tested* in a cycle when every earlier draft was accepted and j was
    verified; it then counts 1 if accepted, 0 if rejected. Untested positions keep their value.
    """

    def __init__(self, decay: float, prior: float) -> None:
        if not 0.0 < decay <= 1.0 or not 0.0 <= prior <= 1.0:
            raise ValueError("decay must be in (0, 1] and prior in [0, 1].")
        self.decay = decay
        self.prior = prior
        self.rates: list[list[float]] = []

    def reset(self, batch: int, k: int) -> None:
        self.rates = [[self.prior] * k for _ in range(batch)]

    def reset_row(self, row: int) -> None:
        if row < len(self.rates):
            self.rates[row] = [self.prior] * len(self.rates[row])

    def observe(self, row: int, drafted: int, accepted: int) -> None:
        r = self.rates[row]
        for j in range(min(accepted + 1, drafted)):
            hit = 1.0 if j < accepted else 0.0
            r[j] += self.decay * (hit - r[j])

    def survival(self, row: int) -> list[float]:
        """``s[j]``: estimated probability that drafts 0..j are all accepted."""
        out, p = [], 1.0
        for r in self.rates[row]:
            p *= r
            out.append(p)
        return out


class TieredBudget:
    """Divide ``budget`` verify tokens per row on average among the active rows by expected gain.

    Every active row gets its pending token plus ``min_draft`` drafts (so its EMA keeps learning);
    the rest of ``ceil(budget * active)`` tokens, rounded up to the packed bucket (whose padding
    rows cost the same as real ones), goes to the highest survivals.
    """

    name = "tiered_budget"

    def __init__(
        self,
        budget: float,
        decay: float = 0.2,
        prior: float = 0.8,
        min_draft: int = 1,
    ) -> None:
        if budget < 1.0 or min_draft < 0:
            raise ValueError("budget must be at least 1 and min_draft at least 0.")
        self.budget = budget
        self.min_draft = min_draft
        self.fill_to = 1
        self.ema = AcceptanceEMA(decay, prior)
        self.k = 0

    def reset(self, batch: int, k: int, bucket: int) -> None:
        self.k = k
        self.fill_to = bucket
        self.ema.reset(batch, k)

    def total(self, n_active: int) -> int:
        want = math.ceil(self.budget * n_active - 1e-9)
        want = -(-want // self.fill_to) * self.fill_to
        return min(want, n_active * (self.k + 1))

    def widths(self, active: Sequence[bool]) -> list[int]:
        base = min(self.min_draft, self.k)
        out = [1 + base if a else 0 for a in active]
        left = self.total(sum(active)) - sum(out)
        if left <= 0:
            return out
        offers: list[tuple[float, int, int]] = []
        for row, a in enumerate(active):
            if a:
                surv = self.ema.survival(row)
                offers += [(-surv[j], j, row) for j in range(base, self.k)]
        offers.sort()  # survival is non-increasing in j, so each row gets a prefix
        for _, _, row in offers[:left]:
            out[row] += 1
        return out

    def observe(self, row: int, drafted: int, accepted: int) -> None:
        self.ema.observe(row, drafted, accepted)

    def reset_row(self, row: int) -> None:
        self.ema.reset_row(row)


class RowBlockLength:
    """Per-row drafter block length: draft position j is verified while ``s_b[j] >= threshold``."""

    name = "row_block_len"

    def __init__(
        self, threshold: float, decay: float = 0.2, prior: float = 0.8, min_draft: int = 1
    ) -> None:
        if not 0.0 <= threshold <= 1.0 or min_draft < 0:
            raise ValueError("threshold must be in [0, 1] and min_draft at least 0.")
        self.threshold = threshold
        self.min_draft = min_draft
        self.ema = AcceptanceEMA(decay, prior)
        self.k = 0

    def reset(self, batch: int, k: int, bucket: int) -> None:
        self.k = k
        self.ema.reset(batch, k)

    def widths(self, active: Sequence[bool]) -> list[int]:
        base = min(self.min_draft, self.k)
        out = []
        for row, a in enumerate(active):
            if not a:
                out.append(0)
                continue
            surv = self.ema.survival(row)
            out.append(1 + base + sum(1 for s in surv[base:] if s >= self.threshold))
        return out

    def observe(self, row: int, drafted: int, accepted: int) -> None:
        self.ema.observe(row, drafted, accepted)

    def reset_row(self, row: int) -> None:
        self.ema.reset_row(row)
