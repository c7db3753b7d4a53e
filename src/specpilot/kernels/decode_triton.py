"""Triton kernels for the decode step: RMSNorm, (q/k-norm +) RoPE + KV-cache write, SiLU·mul.

Each replaces a chain of small torch ops (7 launches for an RMSNorm, ~14 for RoPE on q and k plus
two index_put for the cache) with one launch; in a memory-bound decode step those launches, not
their bytes, are the cost. Rounding follows the torch references in ``reference.py`` step by step
(float32 statistics, cast to the activation dtype before scaling by the weight).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from specpilot.kernels import pdl


@triton.jit
def _rms_norm_kernel(
    x_ptr, x_row_stride, w_ptr, out_ptr, n_cols, eps, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    pdl.trigger(PDL)  # a dependent GEMV may start streaming its weights now (kernels/pdl.py)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * x_row_stride + offs, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n_cols
    h = (xf * tl.rsqrt(var + eps)).to(x.dtype)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    out = (w.to(tl.float32) * h.to(tl.float32)).to(x.dtype)
    tl.store(out_ptr + row * n_cols + offs, out, mask=mask)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``x [M, N]`` with unit column stride (rows may be strided: a draft model normalises
    every second row of a width-2 forward in place) → contiguous ``[M, N]``."""
    m, n = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _rms_norm_kernel[(m,)](
        x, x.stride(0), weight, out, n, eps, BLOCK=triton.next_power_of_2(n),
        PDL=pdl.supported(x.device), num_warps=8,
    )  # fmt: skip
    return out


@triton.jit
def _rope_qkv_kernel(
    qkv_ptr,  # [M, row_stride]: q heads at col 0, then k heads at q_cols, then v heads
    row_stride,
    q_cols,
    pos_ptr,  # [M] int64: RoPE position of each row (also its cache slot unless HAS_SLOTS)
    cos_ptr,  # [P, D] float32
    sin_ptr,
    qn_ptr,  # [D] q norm weight (read only when HAS_NORM)
    kn_ptr,
    q_out_ptr,  # [B, H_kv, G*T, D]
    k_cache_ptr,  # [B, H_kv, S, D] (strides below)
    v_cache_ptr,
    cache_b_stride,
    cache_h_stride,
    eps,
    T,
    H,  # q heads handled here (0: only write K/V)
    H_KV,
    G,
    place_ptr,  # PACKED: [4, M] int64: q batch row, q offset t, cache row, cache slot
    place_stride,  # HAS_SLOTS (not PACKED): place_ptr is [M] int64 cache slots
    D: tl.constexpr,
    HAS_NORM: tl.constexpr,
    PACKED: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.trigger(PDL)
    row = tl.program_id(0)
    head = tl.program_id(1)
    half: tl.constexpr = D // 2
    offs = tl.arange(0, half)
    pos = tl.load(pos_ptr + row)
    if PACKED:
        b = tl.load(place_ptr + row)
        t = tl.load(place_ptr + place_stride + row)
        kv_b = tl.load(place_ptr + 2 * place_stride + row)
        slot = tl.load(place_ptr + 3 * place_stride + row)
    else:
        b = row // T
        t = row % T
        kv_b = b
        if HAS_SLOTS:  # noqa: SIM108 (a constexpr branch, kept as a statement for Triton)
            slot = tl.load(place_ptr + row)
        else:
            slot = pos
    is_q = head < H
    kv_head = head - H
    col = tl.where(is_q, head * D, q_cols + kv_head * D)
    src = qkv_ptr + row * row_stride + col
    x1 = tl.load(src + offs)
    x2 = tl.load(src + half + offs)
    dtype = x1.dtype
    a1 = x1.to(tl.float32)
    a2 = x2.to(tl.float32)
    if HAS_NORM:
        var = (tl.sum(a1 * a1, axis=0) + tl.sum(a2 * a2, axis=0)) / D
        r = tl.rsqrt(var + eps)
        if is_q:
            w1 = tl.load(qn_ptr + offs)
            w2 = tl.load(qn_ptr + half + offs)
        else:
            w1 = tl.load(kn_ptr + offs)
            w2 = tl.load(kn_ptr + half + offs)
        a1 = (w1.to(tl.float32) * (a1 * r).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        a2 = (w2.to(tl.float32) * (a2 * r).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    c = tl.load(cos_ptr + pos * D + offs)
    s = tl.load(sin_ptr + pos * D + offs)
    o1 = (a1 * c + (-a2) * s).to(dtype)
    o2 = (a2 * c + a1 * s).to(dtype)
    if is_q:
        kvh = head // G
        g = head % G
        dst = q_out_ptr + (((b * H_KV + kvh) * G + g) * T + t) * D
        tl.store(dst + offs, o1)
        tl.store(dst + half + offs, o2)
    else:
        off = kv_b * cache_b_stride + kv_head * cache_h_stride + slot * D
        tl.store(k_cache_ptr + off + offs, o1)
        tl.store(k_cache_ptr + off + half + offs, o2)
        vsrc = qkv_ptr + row * row_stride + q_cols + H_KV * D + kv_head * D
        tl.store(v_cache_ptr + off + offs, tl.load(vsrc + offs))
        tl.store(v_cache_ptr + off + half + offs, tl.load(vsrc + half + offs))


def _launch_rope(
    qkv: Tensor,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    positions: Tensor,
    cos_table: Tensor,
    sin_table: Tensor,
    q_norm: Tensor | None,
    k_norm: Tensor | None,
    eps: float,
    q_out: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    width: int,  # T (dense) or W (packed): query rows per batch row of ``q_out``
    groups: int,
    where: Tensor,  # dense: the cache slots [M]; packed: the placement table [4, M]
    where_stride: int,
    packed: bool,
    has_slots: bool,
) -> None:
    """One launch of ``_rope_qkv_kernel`` over the ``M`` rows of ``qkv``, all heads."""
    has_norm = q_norm is not None and k_norm is not None
    dummy = cos_table
    _rope_qkv_kernel[(qkv.shape[0], q_heads + kv_heads)](
        qkv,
        qkv.stride(0),
        q_heads * head_dim,
        positions,
        cos_table,
        sin_table,
        q_norm if has_norm else dummy,
        k_norm if has_norm else dummy,
        q_out,
        k_cache,
        v_cache,
        k_cache.stride(0),
        k_cache.stride(1),
        eps,
        width,
        q_heads,
        kv_heads,
        groups,
        where,
        where_stride,
        D=head_dim,
        HAS_NORM=has_norm,
        PACKED=packed,
        HAS_SLOTS=has_slots,
        PDL=pdl.supported(qkv.device),
        num_warps=1,
    )


def rope_qkv_write(
    qkv: Tensor,  # [M, q_cols + 2 * H_kv * D] contiguous (M = B * T)
    q_heads: int,  # 0 writes only K/V
    kv_heads: int,
    head_dim: int,
    batch: int,
    positions: Tensor,  # [M] int64 RoPE positions (the cache slots unless ``slots``)
    cos_table: Tensor,  # [P, D] float32
    sin_table: Tensor,
    q_norm: Tensor | None,
    k_norm: Tensor | None,
    eps: float,
    k_cache: Tensor,  # [B, H_kv, S, D]
    v_cache: Tensor,
    slots: Tensor | None = None,  # [M] int64 cache slots; None: the positions
) -> Tensor:
    """Rotate q and k (after q/k RMSNorm when given), write k and v into the cache.

    Row i is rotated at ``positions[i]`` and its K/V written at slot ``slots[i]`` (tree verify:
    slot = block offset, position = depth) or, without ``slots``, at ``positions[i]``.
    Returns q as ``[B, H_kv, G*T, D]`` (row ``g*T + t``): the GQA group folded into the query
    rows, so attention runs as plain multi-head attention over the H_kv cached heads.
    """
    m = qkv.shape[0]
    t = m // batch
    g = max(q_heads // kv_heads, 1)
    q_out = torch.empty(batch, kv_heads, g * t, head_dim, dtype=qkv.dtype, device=qkv.device)
    assert k_cache.stride(3) == 1 and k_cache.stride(2) == head_dim
    assert v_cache.stride() == k_cache.stride()
    _launch_rope(
        qkv, q_heads, kv_heads, head_dim, positions, cos_table, sin_table, q_norm, k_norm, eps,
        q_out, k_cache, v_cache, t, g, positions if slots is None else slots, 0,
        packed=False, has_slots=slots is not None,
    )  # fmt: skip
    return q_out


def rope_qkv_write_packed(
    qkv: Tensor,  # [M, q_cols + 2 * H_kv * D] contiguous: packed rows
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    batch: int,
    width: int,
    positions: Tensor,  # [M] int64 RoPE positions
    place: Tensor,  # [4, M] int64: q batch row (batch = a trash slab), q offset, cache row, slot
    cos_table: Tensor,
    sin_table: Tensor,
    q_norm: Tensor | None,
    k_norm: Tensor | None,
    eps: float,
    k_cache: Tensor,  # [B, H_kv, S, D]
    v_cache: Tensor,
) -> Tensor:
    """The packed ragged verify's RoPE + K/V write + query scatter in one launch.

    Packed row i is rotated at ``positions[i]``, its K/V written at cache ``(place[2, i],
    place[3, i])`` and its query heads scattered to row ``place[1, i]`` of batch ``place[0, i]``
    of the padded block. Returns q ``[B + 1, H_kv, G*W, D]`` (zeros where no row landed; slab B
    collects the bucket's padding rows and is not attended).
    """
    g = max(q_heads // kv_heads, 1)
    q_out = torch.zeros(
        batch + 1, kv_heads, g * width, head_dim, dtype=qkv.dtype, device=qkv.device
    )
    assert k_cache.stride(3) == 1 and k_cache.stride(2) == head_dim
    assert v_cache.stride() == k_cache.stride() and place.stride(1) == 1
    _launch_rope(
        qkv, q_heads, kv_heads, head_dim, positions, cos_table, sin_table, q_norm, k_norm, eps,
        q_out, k_cache, v_cache, width, g, place, place.stride(0), packed=True, has_slots=False,
    )  # fmt: skip
    return q_out


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, inter, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.trigger(PDL)
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    g = tl.load(gu_ptr + row * 2 * inter + offs, mask=mask, other=0.0)
    u = tl.load(gu_ptr + row * 2 * inter + inter + offs, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    out = (s.to(tl.float32) * u.to(tl.float32)).to(g.dtype)
    tl.store(out_ptr + row * inter + offs, out, mask=mask)


def silu_mul(gate_up: Tensor) -> Tensor:
    """``gate_up [M, 2I]`` → ``[M, I]``."""
    gate_up = gate_up.contiguous()
    m, two_i = gate_up.shape
    inter = two_i // 2
    out = torch.empty(m, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(m, triton.cdiv(inter, block))](
        gate_up, out, inter, BLOCK=block, PDL=pdl.supported(gate_up.device), num_warps=4
    )
    return out
