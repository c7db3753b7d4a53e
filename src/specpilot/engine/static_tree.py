"""Static tree verify for the CUDA-graph engine: draft, verify and accept a tree per row on the
device (issue 6's tree verification on the fast path; ragged trees across a batch, issue 8).

Terminology as in ``mechanisms/tree_verify.py``: block row 0 is the **root** (the pending token),
rows ``1..N_b`` are row b's drafted nodes in DFS pre-order (first choices first), padded to the
static width ``W = 1 + max nodes``. Per cycle, three graph replays:

* **draft**: the drafter gives the top-R candidates of every block position
  (:class:`~specpilot.drafters.static_tree.StaticTreeDrafter`); node j's token is the candidate of
  its depth and rank — a gather, since the topology is fixed per row;
* **verify**: one packed target forward (``models/packed_forward.py``) over the ``1 + N_b`` real
  rows of each row: node j is written at cache slot ``start + j``, rotated at position
  ``start + depth(j)`` and sees the committed prefix and its ancestors (itself included) through
  the tree mask; its argmax ``a_j`` is the target's greedy token after the path root → j;
* **accept** (:func:`tree_accept_and_commit`): node j is accepted when every node on its path
  (itself included) carries the argmax of its parent; the deepest accepted node (first in DFS
  order at equal depth) ends the accepted path of length n; the committed tokens are
  ``a_{src_0}, …, a_{src_n}`` where ``src_d`` is the path's node at depth d — the accepted nodes'
  tokens and the bonus, each the target's argmax after the committed prefix, hence lossless.
  The path's K/V (and the drafter's hidden states) are **compacted** to consecutive slots
  ``start + d`` by a gather/scatter, no recompute: a node's K/V depends only on its token, its
  position and its ancestors' K/V, exactly what a chain over the path computes.

Which tree each row verifies is chosen on the host between cycles (``engine/tree_policy.py``) and
written into the static buffers here (pinned copy; rewritten only when it changes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from specpilot.drafters.static_tree import StaticTree
from specpilot.engine.device_state import DecodeState, commit_block
from specpilot.models.kv_cache import KVCache


def tree_tables(tree: StaticTree | None, width: int) -> tuple[list[list[int]], list[list[bool]]]:
    """Host rows ``[parents, depths, ranks, valid]`` (forward-row indices, root row 0) and the
    ``[W, W]`` ancestor mask of one tree padded to ``width``; padding rows see only themselves."""
    n = 0 if tree is None else tree.nodes
    parents, depths, ranks = [0] * width, [0] * width, [0] * width
    valid = [1] + [0] * (width - 1)
    vis = [[i == j for i in range(width)] for j in range(width)]
    for j in range(1, n + 1):
        assert tree is not None
        par = tree.parents[j - 1] + 1  # forward row of the parent (0 = root)
        parents[j], depths[j], ranks[j], valid[j] = par, tree.depths[j - 1], tree.ranks[j - 1], 1
        vis[j] = [a or b for a, b in zip(vis[j], vis[par], strict=True)]
    return [parents, depths, ranks, valid], vis


@dataclass(slots=True)
class TreeBuffers:
    """Static device buffers of the tree verify (and pinned host twins of the topology)."""

    tokens: Tensor  # [B, W] int64: root (pending) then node tokens
    topo: Tensor  # [4, B, W] int64: parent row, depth, rank, valid (root valid)
    visible: Tensor  # [B, W, W] bool: row j sees block row i (ancestors and itself)
    candidates: Tensor  # [B, k, R] int64: the drafter's top-R per block position
    argmax: Tensor  # [B, W] int64: a_j of the last tree verify
    hidden: Tensor | None  # [n_sel, B, W, hidden] target states of the tree rows (drafter context)
    host_topo: Tensor  # [4, B, W] int64 (pinned on CUDA)
    host_visible: Tensor  # [B, W, W] bool (pinned on CUDA)
    current: list[StaticTree | None]  # per row: the tree now in the device buffers

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
            candidates=z(batch, max(k, 1), ranks),
            argmax=z(batch, width),
            hidden=None
            if hidden is None
            else torch.zeros(hidden[0], batch, width, hidden[1], dtype=hidden[2], device=device),
            host_topo=torch.zeros(4, batch, width, dtype=torch.int64, pin_memory=pin),
            host_visible=torch.zeros(batch, width, width, dtype=torch.bool, pin_memory=pin),
            current=[None] * batch,
        )

    @property
    def width(self) -> int:
        return int(self.tokens.shape[1])

    def fill(self, trees: Sequence[StaticTree]) -> None:
        """Write the rows whose tree changed; one host→device copy when anything did."""
        w = self.width
        changed = False
        for row, tree in enumerate(trees):
            if self.current[row] is tree:
                continue
            if tree.nodes + 1 > w or tree.max_rank >= self.candidates.shape[2]:
                raise ValueError(
                    f"Tree {tree.label()} does not fit the engine's tree buffers "
                    f"({w - 1} nodes, {self.candidates.shape[2]} ranks)."
                )
            topo, vis = tree_tables(tree, w)
            self.host_topo[:, row] = torch.tensor(topo, dtype=torch.int64)
            self.host_visible[row] = torch.tensor(vis, dtype=torch.bool)
            self.current[row] = tree
            changed = True
        if changed:
            self.topo.copy_(self.host_topo, non_blocking=True)
            self.visible.copy_(self.host_visible, non_blocking=True)

    def gather_tokens(self, pending: Tensor) -> None:  # pending [B]
        """Root = pending token; node j = candidate (depth_j - 1, rank_j). Graph-safe."""
        b, k, r = self.candidates.shape
        depth, rank = self.topo[1], self.topo[2]  # [B, W]
        flat = ((depth - 1).clamp(min=0) * r + rank).clamp(max=k * r - 1)  # [B, W]
        self.tokens.copy_(self.candidates.view(b, k * r).gather(1, flat))
        self.tokens[:, 0] = pending


def accepted_path(
    tokens: Tensor,  # [B, W] root then node tokens
    argmax: Tensor,  # [B, W] a_j per block row
    topo: Tensor,  # [4, B, W] parent row, depth, rank, valid
    visible: Tensor,  # [B, W, W] bool ancestor mask (itself included)
    active: Tensor,  # [B] int64
    k: int,
) -> tuple[Tensor, Tensor]:
    """``(n [B], src [B, k+1])``: accepted path length and the block row of its node at each
    depth (identity past n, and for frozen rows)."""
    b, w = tokens.shape
    dev = tokens.device
    parent, depth, valid = topo[0], topo[1], topo[3].bool()  # [B, W]
    ok = (tokens == argmax.gather(1, parent)) & valid  # [B, W] carries its parent's argmax
    ok[:, 0] = True  # the root is committed already
    acc = ~(visible & ~ok[:, None, :]).any(dim=2)  # [B, W]: every ancestor (and itself) ok
    col = torch.arange(w, device=dev)
    score = torch.where(acc, depth * (w + 1) + (w - col), torch.full_like(depth, -1))  # [B, W]
    best = score.argmax(dim=1)  # [B]: deepest accepted row, first in DFS order on ties
    on = active.bool()
    n = torch.where(on, depth.gather(1, best[:, None]).squeeze(1), torch.zeros_like(best))  # [B]
    path = visible.gather(1, best[:, None, None].expand(b, 1, w)).squeeze(1)  # [B, W]
    ident = torch.arange(k + 2, device=dev).expand(b, k + 2).contiguous()  # [B, k+2]
    src = ident.clone()
    slot = torch.where(path, depth.clamp(max=k), torch.full_like(depth, k + 1))  # [B, W]
    src.scatter_(1, slot, col.expand(b, w).contiguous())  # off-path rows land in column k+1
    src = torch.where(on[:, None], src, ident)[:, : k + 1]  # [B, k+1]
    return n, src


def compact_kv(cache: KVCache, start: Tensor, src: Tensor) -> None:
    """Copy K/V of block rows ``src[b, d]`` to slots ``start_b + d`` for every layer. Graph-safe:
    the whole source is gathered before anything is written."""
    b, d = src.shape
    last = cache.max_seq_len - 1
    src_slot = (start[:, None] + src).clamp(max=last)  # [B, k+1]
    dst_slot = (start[:, None] + torch.arange(d, device=src.device)).clamp(max=last)
    for kc, vc in zip(cache.k, cache.v, strict=True):
        h, hd = kc.shape[1], kc.shape[3]
        gi = src_slot[:, None, :, None].expand(b, h, d, hd)  # [B, H_kv, k+1, D]
        di = dst_slot[:, None, :, None].expand(b, h, d, hd)
        kc.scatter_(2, di, kc.gather(2, gi))
        vc.scatter_(2, di, vc.gather(2, gi))


def tree_accept_and_commit(
    state: DecodeState,
    bufs: TreeBuffers,
    cache: KVCache,
    k: int,
    chain_hidden: Tensor | None,  # [n_sel, B, k+1, hidden]: the drafter's context rows, or None
) -> None:
    """Accept each row's longest argmax path, compact its K/V, commit it plus the bonus.

    Leaves ``verify_argmax[:, :k+1]`` and ``accepted`` exactly as a chain verify of the path
    would (the host reads them back the same way), and the path's hidden states in
    ``chain_hidden`` for the drafter's context.
    """
    start = state.committed_len - 1  # [B] the root's slot
    n, src = accepted_path(bufs.tokens, bufs.argmax, bufs.topo, bufs.visible, state.active, k)
    w = bufs.width
    srcw = src.clamp(max=w - 1)  # [B, k+1] (past the path: not used)
    compact_kv(cache, start, src)
    if chain_hidden is not None and bufs.hidden is not None:
        ns, b, _, h = bufs.hidden.shape
        idx = srcw[None, :, :, None].expand(ns, b, k + 1, h)
        chain_hidden.copy_(bufs.hidden.gather(2, idx))
    chain = bufs.argmax.gather(1, srcw)  # [B, k+1]: path tokens a_0..a_{n-1}, then the bonus a_n
    state.verify_argmax[:, : k + 1].copy_(chain)
    commit_block(state, chain, n)
