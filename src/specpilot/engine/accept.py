"""Accept and commit on the device: the greedy chain rule and the tree rule, graph-safe.

Terminology (Leviathan et al. 2023, greedy; trees after SpecInfer, Miao et al. 2024) is in
``engine/verify.py`` for chains and below for trees. Both leave ``verify_argmax[:, :n+1]`` holding
the committed tokens of each row and ``accepted`` holding n, so the host reads one cycle back the
same way whatever was verified.

Tree rule: block row 0 is the **root** (the pending token), rows ``1..N_b`` are row b's drafted
nodes in DFS pre-order (first choices first). Node j is accepted when every node on its path
(itself included) carries the target's argmax at its parent; the deepest accepted node (first in
DFS order at equal depth) ends the accepted path of length n; the committed tokens are
``a_{src_0}, …, a_{src_n}`` where ``src_d`` is the path's node at depth d: the accepted nodes'
tokens and the bonus, each the target's argmax after the committed prefix, hence lossless. The
path's K/V (and the drafter's hidden states) are **compacted** to consecutive slots
``start + d`` by a gather then a scatter, no recompute: a node's K/V depends only on its token,
its position and its ancestors' K/V, exactly what a chain over the path computes.

**Abstain**: a verify whose LM head may abstain (``Transformer.argmax_head`` with an
``abstain_flag``, e.g. the graph-safe exact-argmax head) passes that flag to the accept. Once it is
set, ``state.halted`` stays set and every accept commits nothing (``committed_len``, ``pending``,
``prev_committed``, ``cycle`` unchanged; ``accepted = ABSTAINED``, which the host sees in its
read-back) until the host clears it and redoes the verify with the stock head (``engine/engine.py``).
The tree accept's K/V compaction is not gated: it writes only slots past the committed K/V, all of
which the redone tree verify writes again before its own accept.

Two implementations of the tree rule, chosen in one place (:func:`use_fused_tree_accept`): the
torch ops below (the CPU, and the reference), and one Triton launch that computes the path and
moves the K/V of every layer (``kernels/tree_accept.py``; CUDA, or the CPU under
``TRITON_INTERPRET=1``). Both give exactly the same ``n``, path, committed tokens and cache.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specpilot.engine.rows import RowState
from specpilot.engine.verify import greedy_verify
from specpilot.kernels import triton_usable
from specpilot.models.kv_cache import KVCache

ABSTAINED = -1
"""``accepted`` of a cycle whose verify head abstained: nothing was committed."""


def accept_and_commit(state: RowState, k: int, abstain: Tensor | None = None) -> None:
    """Greedy acceptance of ``drafts[:, :k]`` (at most ``cut`` of each row's) against
    ``verify_argmax[:, :k+1]``, then the commit. Frozen rows commit nothing; nothing is
    committed once ``abstain [1]`` (the verify head's flag) is set (module docstring)."""
    argmax = state.verify_argmax[:, : k + 1]  # [B, k+1]
    lens = torch.minimum(state.draft_lens, state.cut)  # [B]
    outcome = greedy_verify(state.drafts[:, :k], lens, argmax)
    commit_block(state, argmax, outcome.accepted_len * state.active, abstain)


def commit_block(state: RowState, block: Tensor, n: Tensor, abstain: Tensor | None = None) -> None:
    """Commit ``block[b, :n[b] + 1]`` (accepted tokens, then the bonus ``block[b, n[b]]``) for
    every active row. All of ``block [B, W]`` is scattered after the committed prefix; only the
    first ``n + 1`` become committed. Frozen rows commit nothing, and no row does while the
    verify head's ``abstain [1]`` flag (sticky in ``state.halted``) is set."""
    bonus = block.gather(1, n[:, None]).squeeze(1)  # [B]
    last = state.capacity - 1
    idx = (state.committed_len[:, None] + torch.arange(block.shape[1], device=block.device)).clamp_(
        max=last
    )  # [B, W]
    state.tokens.scatter_(1, idx, block)  # past the committed prefix: scratch until committed
    if abstain is None:
        state.prev_committed.copy_(state.committed_len)
        state.committed_len.add_((n + 1) * state.active)
        state.pending.copy_(torch.where(state.active.bool(), bonus, state.pending))
        state.accepted.copy_(n)
        state.cycle.add_(1)
        return
    state.halted.bitwise_or_(abstain)
    go = 1 - state.halted  # [1]
    live = state.active * go  # [B]
    state.prev_committed.copy_(torch.where(go.bool(), state.committed_len, state.prev_committed))
    state.committed_len.add_((n + 1) * live)
    state.pending.copy_(torch.where(live.bool(), bonus, state.pending))
    state.accepted.copy_(torch.where(go.bool(), n, ABSTAINED))
    state.cycle.add_(go)


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


def use_fused_tree_accept(device: torch.device) -> bool:
    """Whether the tree accept runs as the one Triton launch (wherever Triton kernels run: CUDA,
    or ``TRITON_INTERPRET=1``) rather than the torch ops. The one place this is decided."""
    return triton_usable(device)


def tree_accept_and_commit(
    state: RowState,
    tokens: Tensor,  # [B, W] root then node tokens
    argmax: Tensor,  # [B, W] a_j of the tree verify
    topo: Tensor,  # [4, B, W]
    visible: Tensor,  # [B, W, W]
    cache: KVCache,
    k: int,
    tree_hidden: Tensor | None,  # [n_sel, B, W, hidden] target states of the tree rows, or None
    chain_hidden: Tensor | None,  # [n_sel, B, >= k+1, hidden]: where the drafter reads them
    fused: bool = False,
    abstain: Tensor | None = None,  # [1] the verify head's abstain flag
) -> None:
    """Accept each row's longest argmax path, compact its K/V, commit it plus the bonus
    (module docstring); the path's hidden states go to ``chain_hidden`` in chain order.
    ``fused``: the Triton kernel instead of the torch ops (:func:`use_fused_tree_accept`)."""
    w = tokens.shape[1]
    chain = state.verify_argmax[:, : k + 1]  # [B, k+1]: path tokens a_0..a_{n-1}, then a_n
    if fused:
        from specpilot.kernels.tree_accept import tree_accept_compact

        n, src = tree_accept_compact(
            tokens, argmax, topo, visible, state.active, state.committed_len, k,
            [*cache.k, *cache.v], cache.tensor_offsets(), state.verify_argmax,
        )  # fmt: skip
    else:
        start = state.committed_len - 1  # [B] the root's slot
        n, src = accepted_path(tokens, argmax, topo, visible, state.active, k)
        compact_kv(cache, start, src)
        chain.copy_(argmax.gather(1, src.clamp(max=w - 1)))
    if chain_hidden is not None and tree_hidden is not None:
        ns, b, _, h = tree_hidden.shape
        idx = src.clamp(max=w - 1)[None, :, :, None].expand(ns, b, k + 1, h)
        chain_hidden[:, :, : k + 1].copy_(tree_hidden.gather(2, idx))
    commit_block(state, chain, n, abstain)
