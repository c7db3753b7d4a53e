"""Static draft trees for the CUDA-graph engine: a fixed topology filled from per-depth top-k.

A block drafter (DFlash-like) gives a distribution for every block position in one forward, so a
tree needs no further drafter calls: node i at depth d with rank r takes the r-th most likely
token of block position d. The topology — parent, depth and rank per node — is fixed per shape
(static shapes for CUDA graphs); only the tokens change each cycle.

:func:`build_static_tree` picks the nodes: candidate children (rank < ``branch``) of chosen nodes,
best first by a prior path score (rank 0 continues with ``p_first``, rank r ≥ 1 with
``(1 - p_first) / 2**(r - 1)``), within ``widths`` per depth and ``max_nodes`` in all. Nodes are
returned in DFS pre-order, rank 0 first, so the first-choice chain is nodes ``0..d-1``: when it is
accepted its K/V is already in place.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from torch import Tensor

from specpilot.drafters.base import DraftRows
from specpilot.drafters.tree import TreeShape


@dataclass(frozen=True, slots=True)
class StaticTree:
    """One tree topology; node i (0-based, DFS pre-order) is forward row ``i + 1`` (row 0: root)."""

    parents: tuple[int, ...]  # [N] parent node index, -1 = the root
    depths: tuple[int, ...]  # [N] 1..depth
    ranks: tuple[int, ...]  # [N] rank of the node's token in its block position's top-k

    def __post_init__(self) -> None:
        n = len(self.parents)
        if n < 1 or len(self.depths) != n or len(self.ranks) != n:
            raise ValueError("A static tree needs at least one node and one depth/rank per node.")
        for i, (par, dep) in enumerate(zip(self.parents, self.depths, strict=True)):
            want = 1 if par < 0 else self.depths[par] + 1
            if par >= i or dep != want or self.ranks[i] < 0:
                raise ValueError(f"Static tree node {i} is not in DFS order under its parent.")

    @property
    def nodes(self) -> int:
        return len(self.parents)

    @property
    def depth(self) -> int:
        return max(self.depths)

    @property
    def max_rank(self) -> int:
        return max(self.ranks)

    @classmethod
    def chain(cls, k: int) -> StaticTree:
        """The chain of k first choices (a tree of one path)."""
        return cls(tuple(range(-1, k - 1)), tuple(range(1, k + 1)), (0,) * k)

    def label(self) -> str:
        if self.max_rank == 0 and self.nodes == self.depth:
            return f"chain{self.nodes}"
        return f"tree{self.nodes}d{self.depth}"


def build_static_tree(shape: TreeShape, p_first: float = 0.7) -> StaticTree:
    """The ``shape.max_nodes`` best nodes by prior path score (see the module docstring)."""
    if not 0.0 < p_first < 1.0:
        raise ValueError(f"p_first must lie in (0, 1), got {p_first}.")

    def q(rank: int) -> float:
        return p_first if rank == 0 else (1.0 - p_first) / 2 ** (rank - 1)

    # chosen: (parent, depth, rank); heap of (-score, tie, parent, depth, rank)
    chosen: list[tuple[int, int, int]] = []
    per_depth = [0] * (shape.depth + 1)
    heap: list[tuple[float, int, int, int, int]] = []
    tie = 0
    for r in range(shape.branch):
        heap.append((-q(r), tie, -1, 1, r))
        tie += 1
    heapq.heapify(heap)
    while heap and len(chosen) < shape.max_nodes:
        neg, _, par, dep, rank = heapq.heappop(heap)
        if per_depth[dep] >= shape.widths[dep - 1]:
            continue
        per_depth[dep] += 1
        me = len(chosen)
        chosen.append((par, dep, rank))
        if dep < shape.depth:
            for r in range(shape.branch):
                heapq.heappush(heap, (neg * q(r), tie, me, dep + 1, r))
                tie += 1
    children: list[list[int]] = [[] for _ in chosen]
    roots: list[int] = []
    for i, (par, _, _) in enumerate(chosen):
        (roots if par < 0 else children[par]).append(i)
    order: list[int] = []
    stack = sorted(roots, key=lambda i: chosen[i][2], reverse=True)
    while stack:
        i = stack.pop()
        order.append(i)
        stack.extend(sorted(children[i], key=lambda c: chosen[c][2], reverse=True))
    new = {old: new for new, old in enumerate(order)}
    return StaticTree(
        parents=tuple(-1 if chosen[i][0] < 0 else new[chosen[i][0]] for i in order),
        depths=tuple(chosen[i][1] for i in order),
        ranks=tuple(chosen[i][2] for i in order),
    )


def parse_tree(text: str, p_first: float = 0.7) -> StaticTree:
    """``chain15`` or ``nodes=24,depth=15,width=3,branch=2`` (width: most nodes per depth)."""
    text = text.replace(" ", "")
    if text.startswith("chain") and text[5:].isdigit():
        return StaticTree.chain(int(text[5:]))
    try:
        fields = dict(part.split("=", 1) for part in text.split(","))
        shape = TreeShape.uniform(
            depth=int(fields["depth"]),
            width=int(fields.get("width", 2)),
            max_nodes=int(fields["nodes"]),
            branch=int(fields.get("branch", 2)),
        )
    except (KeyError, ValueError) as e:
        raise ValueError(
            f"Bad tree '{text}' ({e}); write 'chain15' or 'nodes=24,depth=15,width=3,branch=2'."
        ) from None
    return build_static_tree(shape, p_first)


@runtime_checkable
class StaticTreeDrafter(Protocol):
    """A device drafter that can give the top-R candidates of every block position."""

    name: str
    k: int

    def draft_candidates(self, rows: DraftRows, attn_len: int, out: Tensor) -> None:
        """Fill ``out [B, k, R]`` (int64): the R best tokens of draft positions 1..k, best first;
        graph-safe (captured with the draft step)."""
        ...
