"""Which static draft tree each row of the static engine verifies next cycle (host side).

Like a width policy (``engine/widths.py``), a tree policy runs between cycles on the host from the
accepted lengths the engine already read back, so choosing costs no extra sync. It returns one
:class:`StaticTree` per row; rows of one verify may get different trees (ragged trees). Whatever
it picks, every committed token is the target's argmax (verify and acceptance are exact), so a
policy changes speed, never output.

* :class:`FixedTree` — every row verifies the same tree (batch 1, or a uniform batch);
* :class:`RaggedTrees` — rows whose chain is likely to run long keep a deep chain, the least
  confident rows get a wider tree (siblings near the root), within a total verify-token budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from specpilot.drafters.static_tree import StaticTree
from specpilot.engine.widths import AcceptanceEMA


class TreePolicy(Protocol):
    name: str

    @property
    def shapes(self) -> tuple[StaticTree, ...]:
        """Every tree it may return (the engine sizes its static buffers from them)."""
        ...

    def reset(self, batch: int, k: int) -> None: ...

    def trees(self, active: Sequence[bool]) -> list[StaticTree]:
        """One tree per row for the next cycle (inactive rows: any; they commit nothing)."""
        ...

    def observe(self, row: int, drafted: int, accepted: int) -> None:
        """Row ``row`` verified a tree of depth ``drafted`` and accepted a path of ``accepted``."""
        ...

    def reset_row(self, row: int) -> None:
        """Row ``row`` takes a new sequence (continuous batching)."""
        ...


class FixedTree:
    name = "fixed_tree"

    def __init__(self, tree: StaticTree) -> None:
        self.tree = tree

    @property
    def shapes(self) -> tuple[StaticTree, ...]:
        return (self.tree,)

    def reset(self, batch: int, k: int) -> None:
        return None

    def trees(self, active: Sequence[bool]) -> list[StaticTree]:
        return [self.tree] * len(active)

    def observe(self, row: int, drafted: int, accepted: int) -> None:
        return None

    def reset_row(self, row: int) -> None:
        return None


class RaggedTrees:
    """Per-row choice between a ``confident`` tree (usually a chain) and an ``uncertain`` one.

    Each row's expected accepted chain length is the sum of its per-position acceptance survival
    (an EMA of what it accepted). Rows are taken least confident first; each gets ``uncertain``
    while the cycle's verify tokens (``1 + nodes`` per row) stay within ``budget`` per active row
    on average, the rest get ``confident``. Low-acceptance rows gain most from siblings near the
    root; high-acceptance rows from depth.
    """

    name = "ragged_trees"

    def __init__(
        self,
        confident: StaticTree,
        uncertain: StaticTree,
        budget: float,
        decay: float = 0.2,
        prior: float = 0.8,
    ) -> None:
        if budget < 1 + confident.nodes:
            raise ValueError(
                f"A ragged-tree budget of {budget} tokens per row cannot hold the confident tree "
                f"({1 + confident.nodes} tokens); raise the budget."
            )
        self.confident, self.uncertain, self.budget = confident, uncertain, budget
        self.ema = AcceptanceEMA(decay, prior)

    @property
    def shapes(self) -> tuple[StaticTree, ...]:
        return (self.confident, self.uncertain)

    def reset(self, batch: int, k: int) -> None:
        self.ema.reset(batch, k)

    def trees(self, active: Sequence[bool]) -> list[StaticTree]:
        rows = [b for b, a in enumerate(active) if a]
        left = int(self.budget * len(rows)) - (1 + self.confident.nodes) * len(rows)
        extra = self.uncertain.nodes - self.confident.nodes
        out = [self.confident] * len(active)
        for b in sorted(rows, key=lambda b: (sum(self.ema.survival(b)), b)):
            if extra > left:
                break
            out[b] = self.uncertain
            left -= extra
        return out

    def observe(self, row: int, drafted: int, accepted: int) -> None:
        self.ema.observe(row, drafted, accepted)

    def reset_row(self, row: int) -> None:
        self.ema.reset_row(row)
