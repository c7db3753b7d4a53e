"""Acceptance statistics with one documented convention.

``mean_accepted_len`` (τ) is committed tokens per target verify forward and **includes the bonus
token**: plain AR decoding has τ = 1, and a cycle that accepts all K drafted tokens scores K + 1.
``acceptance_rate(i)`` is P(draft position i accepted | position i was drafted), i from 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class AcceptanceStats:
    cycles: int = 0
    """Target verify forwards (prefill excluded)."""
    committed: int = 0
    """Tokens committed by those forwards (accepted + bonus)."""
    drafted: list[int] = field(default_factory=list)
    """drafted[i]: cycles in which draft position i was proposed."""
    accepted: list[int] = field(default_factory=list)
    """accepted[i]: cycles in which draft position i was accepted."""
    accept_hist: list[int] = field(default_factory=list)
    """accept_hist[n]: cycles that accepted exactly n drafted tokens."""

    def record(self, draft_len: int, accepted_len: int, committed: int) -> None:
        self.cycles += 1
        self.committed += committed
        grow = draft_len - len(self.drafted)  # accepted_len <= draft_len
        if grow > 0:
            self.drafted.extend([0] * grow)
            self.accepted.extend([0] * grow)
        for i in range(draft_len):
            self.drafted[i] += 1
        for i in range(accepted_len):
            self.accepted[i] += 1
        if accepted_len >= len(self.accept_hist):
            self.accept_hist.extend([0] * (accepted_len + 1 - len(self.accept_hist)))
        self.accept_hist[accepted_len] += 1

    def merge(self, other: AcceptanceStats) -> None:
        self.cycles += other.cycles
        self.committed += other.committed
        for name in ("drafted", "accepted", "accept_hist"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if len(theirs) > len(mine):
                mine.extend([0] * (len(theirs) - len(mine)))
            for i, c in enumerate(theirs):
                mine[i] += c

    @property
    def mean_accepted_len(self) -> float:
        """τ: committed tokens per verify forward, bonus included (AR = 1.0)."""
        return self.committed / self.cycles if self.cycles else 0.0

    def acceptance_rate(self, i: int) -> float:
        return (
            self.accepted[i] / self.drafted[i] if i < len(self.drafted) and self.drafted[i] else 0.0
        )

    def acceptance_rates(self) -> list[float]:
        return [self.acceptance_rate(i) for i in range(len(self.drafted))]

    def to_dict(self) -> dict[str, object]:
        return {
            "cycles": self.cycles,
            "committed": self.committed,
            "mean_accepted_len_incl_bonus": self.mean_accepted_len,
            "acceptance_rate_by_position": self.acceptance_rates(),
            "accept_hist": list(self.accept_hist),
        }
