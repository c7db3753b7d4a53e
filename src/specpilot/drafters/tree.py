"""Draft trees: shape knobs, the proposal handed to the tree verifier, and a budgeted trie.

A tree drafter proposes, per row, nodes ``0..N-1`` below a root (the pending token, whose KV is not
yet cached). Node i has a token, a parent (``-1`` = the root) and a depth (root 0, children 1, …).
Nodes come in DFS pre-order with each node's preferred child first, so the drafter's top-1 chain is
nodes ``0..d-1``: when that chain is accepted, its KV is already contiguous and needs no copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from specpilot.drafters.base import DraftRows


@dataclass(frozen=True, slots=True)
class TreeShape:
    """Static limits of a draft tree."""

    depth: int
    """Most drafted tokens on one root-to-leaf path."""
    widths: tuple[int, ...]
    """Most nodes at depth 1, 2, …, ``depth`` (one entry per depth)."""
    max_nodes: int
    """Total node budget below the root (the verify forward feeds ``1 + max_nodes`` tokens)."""
    branch: int = 2
    """Children a drafter proposes per expanded node (top-k of its distribution)."""

    def __post_init__(self) -> None:
        if self.depth < 1:
            raise ValueError(f"tree depth must be at least 1, got {self.depth}")
        if len(self.widths) != self.depth or min(self.widths) < 1:
            raise ValueError(f"tree widths need {self.depth} entries ≥ 1, got {self.widths}")
        if self.max_nodes < 1 or self.branch < 1:
            raise ValueError("tree max_nodes and branch must be at least 1")

    @classmethod
    def uniform(cls, depth: int, width: int, max_nodes: int, branch: int = 2) -> TreeShape:
        return cls(depth=depth, widths=(width,) * depth, max_nodes=max_nodes, branch=branch)

    @classmethod
    def chain(cls, k: int) -> TreeShape:
        """A tree of one path: the chain of k tokens."""
        return cls(depth=k, widths=(1,) * k, max_nodes=k, branch=1)


@dataclass(slots=True)
class TreeProposal:
    """Draft trees of a batch, padded to the widest row."""

    tokens: Tensor  # [B, N] int64 (host), 0 past a row's count
    parents: Tensor  # [B, N] int64 (host): parent node index, -1 = the root; -1 past the count
    depths: Tensor  # [B, N] int64 (host): 1..depth; 1 past the count
    counts: list[int]  # [B]: valid nodes per row

    @property
    def width(self) -> int:
        return int(self.tokens.shape[1])

    def max_depth(self, row: int) -> int:
        n = self.counts[row]
        return int(self.depths[row, :n].max()) if n else 0


@dataclass(slots=True)
class TreeNode:
    token: int
    parent: int  # index into the row's node list, -1 = root
    depth: int
    children: list[int] = field(default_factory=list)


def pack_trees(rows: Sequence[Sequence[TreeNode]]) -> TreeProposal:
    """Pack per-row node lists into a :class:`TreeProposal`, renumbered in DFS pre-order.

    Children are visited in the order they were added, so add each node's preferred child first.
    """
    ordered: list[list[tuple[int, int, int]]] = []  # per row: (token, parent, depth) in DFS order
    for nodes in rows:
        out: list[tuple[int, int, int]] = []
        new_index: dict[int, int] = {}
        stack = [i for i, nd in enumerate(nodes) if nd.parent < 0][::-1]
        while stack:
            i = stack.pop()
            nd = nodes[i]
            new_index[i] = len(out)
            out.append((nd.token, new_index[nd.parent] if nd.parent >= 0 else -1, nd.depth))
            stack.extend(reversed(nd.children))
        ordered.append(out)
    b = len(ordered)
    width = max((len(o) for o in ordered), default=0)
    tokens = torch.zeros(b, width, dtype=torch.int64)
    parents = torch.full((b, width), -1, dtype=torch.int64)
    depths = torch.ones(b, width, dtype=torch.int64)
    for row, out in enumerate(ordered):
        if out:
            t = torch.tensor(out, dtype=torch.int64)  # [n, 3]
            tokens[row, : len(out)] = t[:, 0]
            parents[row, : len(out)] = t[:, 1]
            depths[row, : len(out)] = t[:, 2]
    return TreeProposal(
        tokens=tokens, parents=parents, depths=depths, counts=[len(o) for o in ordered]
    )


def empty_trees(batch: int) -> TreeProposal:
    return pack_trees([[] for _ in range(batch)])


class TrieBuilder:
    """Merges candidate continuations into one tree under a :class:`TreeShape` budget."""

    def __init__(self, shape: TreeShape, max_depth: int) -> None:
        self.shape = shape
        self.max_depth = min(shape.depth, max_depth)
        self.nodes: list[TreeNode] = []
        self._per_depth = [0] * (shape.depth + 1)
        self._child: dict[tuple[int, int], int] = {}  # (parent, token) -> node

    @property
    def full(self) -> bool:
        return len(self.nodes) >= self.shape.max_nodes

    def insert(self, continuation: Sequence[int]) -> None:
        """Add a path from the root, sharing existing prefixes; stop at any exhausted budget."""
        parent = -1
        for depth, tok in enumerate(continuation[: self.max_depth], start=1):
            node = self._child.get((parent, tok))
            if node is None:
                if self.full or self._per_depth[depth] >= self.shape.widths[depth - 1]:
                    return
                node = len(self.nodes)
                self.nodes.append(TreeNode(token=tok, parent=parent, depth=depth))
                if parent >= 0:
                    self.nodes[parent].children.append(node)
                self._child[(parent, tok)] = node
                self._per_depth[depth] += 1
            parent = node


@runtime_checkable
class TreeDrafter(Protocol):
    """A host drafter that can also propose tries (the tree verify plan's host trees)."""

    name: str
    k: int

    def propose_tree(self, rows: DraftRows, shape: TreeShape) -> TreeProposal:
        """A tree per decoding row (empty for the other rows) within ``shape``."""
        ...
