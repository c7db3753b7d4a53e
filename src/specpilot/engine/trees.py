"""The static buffers of a tree verify, and how the host fills them between cycles.

A row's tree has a fixed width ``W = 1 + max nodes`` (forward row 0 is the root, the pending
token). Two sources fill it:

* a **static tree** (``drafters/static_tree.StaticTree``: topology fixed per shape) for a drafter
  that gives the top-R candidates of every block position on the device — node j's token is the
  candidate of its depth and rank, a gather (:meth:`TreeBuffers.gather_tokens`), so the host
  rewrites the topology only when a row's tree changes;
* a **host tree** (``drafters/tree.TreeProposal``: a trie per row, e.g. n-gram continuations),
  whose topology and tokens the host writes every cycle.

Either way one pinned host→device copy per change, no device→host sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from specpilot.drafters.static_tree import StaticTree
from specpilot.drafters.tree import TreeProposal


def tree_tables(
    parents: Sequence[int], depths: Sequence[int], ranks: Sequence[int], width: int
) -> tuple[list[list[int]], list[list[bool]]]:
    """Host rows ``[parents, depths, ranks, valid]`` (forward-row indices, root row 0) and the
    ``[W, W]`` ancestor mask of one tree (node i's parent index, -1 = root) padded to ``width``;
    padding rows see only themselves."""
    n = len(parents)
    par_row, dep, rnk = [0] * width, [0] * width, [0] * width
    valid = [1] + [0] * (width - 1)
    vis = [[i == j for i in range(width)] for j in range(width)]
    for j in range(1, n + 1):
        par = parents[j - 1] + 1  # forward row of the parent (0 = root)
        par_row[j], dep[j], rnk[j], valid[j] = par, depths[j - 1], ranks[j - 1], 1
        vis[j] = [a or b for a, b in zip(vis[j], vis[par], strict=True)]
    return [par_row, dep, rnk, valid], vis


@dataclass(slots=True)
class TreeBuffers:
    """Device buffers of the tree verify (and pinned host twins of what the host writes)."""

    tokens: Tensor  # [B, W] int64: root (pending) then node tokens
    topo: Tensor  # [4, B, W] int64: parent row, depth, rank, valid (root valid)
    visible: Tensor  # [B, W, W] bool: row j sees block row i (ancestors and itself)
    candidates: Tensor  # [B, k, R] int64: a candidate drafter's top-R per block position
    argmax: Tensor  # [B, W] int64: a_j of the last tree verify
    hidden: Tensor | None  # [n_sel, B, W, hidden] target states of the tree rows
    host_topo: Tensor  # [4, B, W] int64 (pinned on CUDA)
    host_visible: Tensor  # [B, W, W] bool (pinned on CUDA)
    host_tokens: Tensor  # [B, W] int64 (pinned on CUDA): host trees' node tokens
    current: list[StaticTree | None]  # per row: the static tree now in the device buffers

    @classmethod
    def allocate(
        cls,
        batch: int,
        width: int,
        k: int,
        ranks: int,
        hidden: tuple[int, int, torch.dtype] | None,  # (n_sel, hidden size, dtype)
        device: torch.device,
    ) -> TreeBuffers:
        pin = device.type == "cuda"

        def z(*shape: int, dtype: torch.dtype = torch.int64) -> Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        return cls(
            tokens=z(batch, width),
            topo=z(4, batch, width),
            visible=z(batch, width, width, dtype=torch.bool),
            candidates=z(batch, max(k, 1), max(ranks, 1)),
            argmax=z(batch, width),
            hidden=None
            if hidden is None
            else torch.zeros(hidden[0], batch, width, hidden[1], dtype=hidden[2], device=device),
            host_topo=torch.zeros(4, batch, width, dtype=torch.int64, pin_memory=pin),
            host_visible=torch.zeros(batch, width, width, dtype=torch.bool, pin_memory=pin),
            host_tokens=torch.zeros(batch, width, dtype=torch.int64, pin_memory=pin),
            current=[None] * batch,
        )

    @property
    def width(self) -> int:
        return int(self.tokens.shape[1])

    def _put(
        self, row: int, parents: Sequence[int], depths: Sequence[int], ranks: Sequence[int]
    ) -> None:
        if len(parents) + 1 > self.width:
            raise ValueError(f"A tree of {len(parents)} nodes does not fit {self.width - 1}.")
        topo, vis = tree_tables(parents, depths, ranks, self.width)
        self.host_topo[:, row] = torch.tensor(topo, dtype=torch.int64)
        self.host_visible[row] = torch.tensor(vis, dtype=torch.bool)

    def fill_static(self, trees: Sequence[StaticTree]) -> None:
        """Write the rows whose static tree changed; one host→device copy when anything did."""
        changed = False
        for row, tree in enumerate(trees):
            if self.current[row] is tree:
                continue
            if tree.max_rank >= self.candidates.shape[2]:
                raise ValueError(
                    f"Tree {tree.label()} needs rank {tree.max_rank}; the buffers hold "
                    f"{self.candidates.shape[2]}."
                )
            self._put(row, tree.parents, tree.depths, tree.ranks)
            self.current[row] = tree
            changed = True
        if changed:
            self.topo.copy_(self.host_topo, non_blocking=True)
            self.visible.copy_(self.host_visible, non_blocking=True)

    def fill_host(self, proposal: TreeProposal, pending: Tensor) -> None:
        """Write every row's host tree (topology and node tokens) and the root (``pending``)."""
        for row, n in enumerate(proposal.counts):
            parents = proposal.parents[row, :n].tolist()
            depths = proposal.depths[row, :n].tolist()
            self._put(row, parents, depths, [0] * n)
            self.host_tokens[row].zero_()
            self.host_tokens[row, 1 : n + 1] = proposal.tokens[row, :n]
            self.current[row] = None
        self.topo.copy_(self.host_topo, non_blocking=True)
        self.visible.copy_(self.host_visible, non_blocking=True)
        self.tokens.copy_(self.host_tokens, non_blocking=True)
        self.tokens[:, 0] = pending

    def gather_tokens(self, pending: Tensor) -> None:  # pending [B]
        """Root = pending token; node j = candidate (depth_j - 1, rank_j). Graph-safe."""
        b, k, r = self.candidates.shape
        depth, rank = self.topo[1], self.topo[2]  # [B, W]
        flat = ((depth - 1).clamp(min=0) * r + rank).clamp(max=k * r - 1)  # [B, W]
        self.tokens.copy_(self.candidates.view(b, k * r).gather(1, flat))
        self.tokens[:, 0] = pending
