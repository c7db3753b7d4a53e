"""The per-position acceptance profile and the expected tokens per cycle.

Convention (the same as :class:`~specpilot.engine.stats.AcceptanceStats`): for draft position
``i`` (from 0),

* ``reach[i]  = q_i = P(draft length > i)`` — the drafter proposed position i at all
  (n-gram lookup often proposes fewer than k tokens; a fixed-k drafter has q_i = 1);
* ``accept[i] = a_i = P(accepted length > i | draft length > i)`` — ``AcceptanceStats``'s
  ``acceptance_rate(i)``; acceptance is a prefix, so this already includes "and every earlier
  position was accepted".

Expected committed tokens per cycle, **bonus included** (AR = 1):

    E = 1 + Σ_i P(accepted length > i) = 1 + Σ_i q_i · a_i

since the accepted length n contributes n tokens and the bonus one more, and
``E[n] = Σ_i P(n > i)``. On a measured run this equals τ = committed / cycles exactly.
A simulated profile gives conditional rates r_i = P(position i accepted | i − 1 accepted) with a
fixed k; then q_i = 1 and a_i = r_0 · … · r_i.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specpilot.engine.stats import AcceptanceStats

SOURCES = ("measured", "simulated", "assumed")


@dataclass(frozen=True, slots=True)
class AcceptanceCurve:
    accept: tuple[float, ...]
    """a_i = P(accepted length > i | draft length > i)."""
    reach: tuple[float, ...]
    """q_i = P(draft length > i); non-increasing, same length as ``accept``."""
    source: str
    """``measured`` (a real run), ``simulated`` (injected profile) or ``assumed`` (on paper)."""
    cycles: int = 0
    """Cycles behind a measured curve (0 otherwise)."""

    def __post_init__(self) -> None:
        if len(self.accept) != len(self.reach):
            raise ValueError("accept and reach need one entry per draft position")
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, got {self.source!r}")
        for x in (*self.accept, *self.reach):
            if not 0.0 <= x <= 1.0:
                raise ValueError(f"probabilities must lie in [0, 1], got {x}")

    @property
    def k(self) -> int:
        return len(self.accept)

    def expected_tokens(self) -> float:
        """E[committed tokens per cycle], bonus included: 1 + Σ q_i · a_i."""
        return 1.0 + sum(q * a for q, a in zip(self.reach, self.accept, strict=True))

    def draft_len_probs(self) -> list[float]:
        """P(draft length = j) for j = 0..k (from the reach probabilities)."""
        reach = [1.0, *self.reach, 0.0]
        return [max(reach[j] - reach[j + 1], 0.0) for j in range(self.k + 1)]

    def expected_draft_len(self) -> float:
        return sum(self.reach)

    def to_dict(self) -> dict[str, object]:
        return {
            "source": self.source,
            "k": self.k,
            "accept_by_position": list(self.accept),
            "reach_by_position": list(self.reach),
            "expected_tokens_per_cycle_incl_bonus": self.expected_tokens(),
            "cycles": self.cycles,
        }

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_stats(cls, stats: AcceptanceStats, source: str = "measured") -> AcceptanceCurve:
        """From a run's counts: q_i = drafted[i] / cycles, a_i = accepted[i] / drafted[i]."""
        if stats.cycles == 0:
            raise ValueError("no cycles recorded")
        n = len(stats.drafted)
        while n and stats.drafted[n - 1] == 0:  # positions never drafted carry no information
            n -= 1
        reach = tuple(min(stats.drafted[i] / stats.cycles, 1.0) for i in range(n))
        accept = tuple(stats.acceptance_rate(i) for i in range(n))
        return cls(accept=accept, reach=reach, source=source, cycles=stats.cycles)

    @classmethod
    def from_conditional(cls, rates: Sequence[float], source: str = "simulated") -> AcceptanceCurve:
        """From conditional rates r_i (every position drafted): a_i = r_0 · … · r_i."""
        accept, p = [], 1.0
        for r in rates:
            p *= r
            accept.append(p)
        return cls(accept=tuple(accept), reach=(1.0,) * len(accept), source=source)

    @classmethod
    def constant(cls, tau: float, k: int, source: str = "assumed") -> AcceptanceCurve:
        """One conditional rate α for all k positions with 1 + α + … + α^k = τ (bisection)."""
        if not 1.0 <= tau <= k + 1:
            raise ValueError(f"tau must lie in [1, {k + 1}] for {k} draft positions")
        lo, hi = 0.0, 1.0
        for _ in range(100):
            mid = (lo + hi) / 2
            if 1.0 + sum(mid**j for j in range(1, k + 1)) < tau:
                lo = mid
            else:
                hi = mid
        return cls.from_conditional([(lo + hi) / 2] * k, source=source)

    @classmethod
    def none(cls) -> AcceptanceCurve:
        """Plain AR: nothing drafted, E = 1."""
        return cls(accept=(), reach=(), source="measured")
