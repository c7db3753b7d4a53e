"""One launch for the tree rule's accept and K/V compaction (``engine/accept.py`` holds the rule).

The torch path (``accepted_path`` + ``compact_kv``) is about 25 small ops for the path and a
gather and a scatter per cache tensor: ~130 launches per cycle at 32 layers, ≈ 0.85 ms of a
batch-1 cycle on the H200 even replayed from a CUDA graph (docs/BENCHMARKS.md, issue 6). Here one
program per (row, cache tensor, KV head) recomputes its row's accepted path from the tree buffers
(a few KB, all in registers), then moves that head's path rows of that tensor; program
``(b, 0, 0)`` also writes ``n``, ``src`` and the committed chain. No host sync, fixed shapes:
capturable in the tree accept's CUDA graph.

Every layer's K and V are separate tensors of one shape; the kernel reaches them through one base
pointer (``k[0]``) and a table of element offsets (``KVCache.tensor_offsets``), so all of them
move in the same launch.

Exactly the torch rule: ``ok_j`` = node j carries its parent's argmax and is valid (the root
always ok); node j is accepted when every row of ``visible[j]`` is ok; the best node maximises
``depth * (W + 1) + (W - j)`` over accepted rows (deepest, first in DFS order on ties); ``n`` is
its depth (0 for a frozen row); ``src[d]`` the path's node at depth d (identity past n and for
frozen rows); the chain ``argmax[src[d]]``. Precondition (the tree plan's): every node's depth is
at most k. Copies whose slot would fall past the cache are skipped (the torch path clamps them
onto the last slot, which no query reads).

In-place safety: within a (row, tensor, head) the path's rows are read into registers, then a
barrier, then written; ``src[d] >= d``, so a copy only ever moves a row down.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _tree_accept_kernel(
    tokens_ptr,  # [B, W] int64: root then node tokens
    argmax_ptr,  # [B, W] int64: a_j per block row
    topo_ptr,  # [4, B, W] int64: parent row, depth, rank, valid
    vis_ptr,  # [B, W, W] uint8: the ancestor mask (itself included)
    active_ptr,  # [B] int64
    committed_ptr,  # [B] int64: committed_len (the root sits at slot committed_len - 1)
    n_ptr,  # [B] int64 out: accepted path length
    src_ptr,  # [B, K1] int64 out: block row of the path's node at each depth
    chain_ptr,  # [B, >= K1] out (row stride chain_stride): committed tokens a_src[d]
    chain_stride,
    kv_ptr,  # the first cache tensor; every other one at kv_ptr + offs[t]
    offs_ptr,  # [T] int64 element offsets of the cache tensors (K of every layer, then V)
    B,
    W,
    S,  # cache slots
    stride_b,
    stride_h,
    stride_s,
    K1: tl.constexpr,  # k + 1: depths 0..k
    KP: tl.constexpr,  # next power of two >= K1
    WP: tl.constexpr,  # next power of two >= W
    D: tl.constexpr,  # head dim (contiguous)
    DP: tl.constexpr,  # next power of two >= D
):
    b = tl.program_id(0)
    t = tl.program_id(1)
    h = tl.program_id(2)
    cols = tl.arange(0, WP)
    cm = cols < W
    row = b * W
    tok = tl.load(tokens_ptr + row + cols, mask=cm, other=-1)
    par = tl.load(topo_ptr + row + cols, mask=cm, other=0)
    dep = tl.load(topo_ptr + B * W + row + cols, mask=cm, other=0)
    val = tl.load(topo_ptr + 3 * B * W + row + cols, mask=cm, other=0)
    par_arg = tl.load(argmax_ptr + row + par, mask=cm, other=-2)
    ok = ((tok == par_arg) & (val != 0)) | (cols == 0)
    vis = tl.load(
        vis_ptr + (row + cols[:, None]) * W + cols[None, :],
        mask=cm[:, None] & cm[None, :],
        other=0,
    )  # [WP, WP]
    bad = ((vis != 0) & (ok[None, :] == 0)).to(tl.int32)
    acc = (tl.max(bad, axis=1) == 0) & cm  # [WP]: every row on its root path is ok
    score = tl.where(acc, dep * (W + 1) + (W - cols), -1)
    top = tl.max(score, axis=0)
    best = W - top % (W + 1)
    on = tl.load(active_ptr + b) != 0
    n = tl.where(on, top // (W + 1), 0)
    path = tl.load(vis_ptr + (row + best) * W + cols, mask=cm, other=0) != 0  # [WP]
    ds = tl.arange(0, KP)
    hit = path[None, :] & (dep[None, :] == ds[:, None])  # [KP, WP]: the path's node at depth d
    src = tl.sum(tl.where(hit, cols[None, :], 0), axis=1)
    src = tl.where(on & (ds <= n), src, ds)  # [KP]
    dm = ds < K1
    if (t == 0) & (h == 0):
        tl.store(n_ptr + b, n)
        tl.store(src_ptr + b * K1 + ds, src, mask=dm)
        chain = tl.load(argmax_ptr + row + tl.minimum(src, W - 1), mask=dm, other=0)
        tl.store(chain_ptr + b * chain_stride + ds, chain, mask=dm)
    start = tl.load(committed_ptr + b) - 1
    move = dm & (ds <= n) & (src != ds) & (start + src < S)  # [KP]
    base = kv_ptr + tl.load(offs_ptr + t) + b * stride_b + h * stride_h
    dcol = tl.arange(0, DP)
    both = move[:, None] & (dcol[None, :] < D)  # [KP, DP]
    x = tl.load(base + (start + src)[:, None] * stride_s + dcol[None, :], mask=both, other=0.0)
    tl.debug_barrier()  # every row read before any is overwritten
    tl.store(base + (start + ds)[:, None] * stride_s + dcol[None, :], x, mask=both)


def _check(name: str, t: Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
        raise ValueError(
            f"tree accept: {name} must be a contiguous {dtype} tensor of shape {shape}, "
            f"got {tuple(t.shape)} {t.dtype}"
        )


def tree_accept_compact(
    tokens: Tensor,  # [B, W] int64
    argmax: Tensor,  # [B, W] int64
    topo: Tensor,  # [4, B, W] int64
    visible: Tensor,  # [B, W, W] bool
    active: Tensor,  # [B] int64
    committed_len: Tensor,  # [B] int64
    k: int,
    caches: Sequence[Tensor],  # every cache tensor, [B, H_kv, S, D] each, same shape and dtype
    offsets: Tensor,  # [len(caches)] int64: element offsets from caches[0] (KVCache.tensor_offsets)
    chain_out: Tensor,  # [B, >= k+1] int64, unit column stride (verify_argmax)
) -> tuple[Tensor, Tensor]:
    """Accept each row's longest argmax path, write its committed tokens to ``chain_out[:, :k+1]``
    and move its K/V to consecutive slots from the root's; returns ``(n [B], src [B, k+1])``."""
    b, w = tokens.shape
    dev = tokens.device
    _check("tokens", tokens, (b, w), torch.int64)
    _check("argmax", argmax, (b, w), torch.int64)
    _check("topo", topo, (4, b, w), torch.int64)
    _check("visible", visible, (b, w, w), torch.bool)
    _check("active", active, (b,), torch.int64)
    _check("committed_len", committed_len, (b,), torch.int64)
    kv = caches[0]
    _check("the first cache tensor", kv, tuple(kv.shape), kv.dtype)
    if kv.shape[0] != b or offsets.shape != (len(caches),) or offsets.device != dev:
        raise ValueError("tree accept: the caches and offsets do not match the tree buffers")
    if chain_out.shape[0] != b or chain_out.shape[1] < k + 1 or chain_out.stride(1) != 1:
        raise ValueError(f"tree accept: chain_out must be [{b}, >= {k + 1}] with unit columns")
    _, heads, slots, d = kv.shape
    n = torch.empty(b, dtype=torch.int64, device=dev)
    src = torch.empty(b, k + 1, dtype=torch.int64, device=dev)
    wp = triton.next_power_of_2(w)
    _tree_accept_kernel[(b, len(caches), heads)](
        tokens,
        argmax,
        topo,
        visible.view(torch.uint8),
        active,
        committed_len,
        n,
        src,
        chain_out,
        chain_out.stride(0),
        kv,
        offsets,
        b,
        w,
        slots,
        kv.stride(0),
        kv.stride(1),
        kv.stride(2),
        K1=k + 1,
        KP=triton.next_power_of_2(k + 1),
        WP=wp,
        D=d,
        DP=triton.next_power_of_2(d),
        num_warps=8 if wp >= 128 else 4,
    )
    return n, src
