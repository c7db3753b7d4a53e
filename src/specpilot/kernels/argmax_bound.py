"""Rigorous per-block bounds on LM-head logits from a low-precision copy of the head.

The certified exact-argmax head (``mechanisms/exact_argmax.py``, which holds the proof) needs, for
every hidden row r and every vocabulary block b of ``block`` rows, two numbers:

* ``upper[r, b]`` ≥ the largest *stock* logit ``z[r, v]`` over v in b, and
* ``lower[r, b]`` ≤ some stock logit ``z[r, v]`` with v in b,

computed from a cheap copy of the head (``kernels/cheap_head.py``: int8 with a per-row scale, or
an fp16 copy scaled by a power of two) plus per-row and per-vocab-row error terms. Per element the bound is

    c    = fl(x̂ · ŵ_v) · scale_v · x_scale_r                       (cheap logit)
    D    = pad · (((a_r · beta_v + b_r · omega_v) + kc · |c|) + tau_r)
    upper = c + D,  lower = c − D                                     (then max over the block)

with every term defined (and its rounding accounted for) in the exact-argmax module docstring.
``block_bounds_ref`` is the torch version (CPU, and ground truth of the tests); ``block_bounds_triton``
is the Triton kernel (CUDA, or the CPU under ``TRITON_INTERPRET=1``): one program per
(vocabulary block, row tile), a bf16 tensor-core dot of the scaled hidden rows with the int8 codes
(exact in bf16) accumulated in fp32, and the bound epilogue fused, so the head is read once as int8.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from specpilot.kernels.cheap_head import CheapHead, RowTerms, round_up_f32

PAD = 1.0 + 2.0**-18
"""Multiplier that absorbs the float32 roundings of the bound itself (see the proof, step 4)."""


def block_bounds_ref(head: CheapHead, terms: RowTerms, kc: float) -> tuple[Tensor, Tensor]:
    """Torch reference: ``(upper [R, nb], lower [R, nb])`` in float32, per-element bounds."""
    if head.fmt == "fp16":
        acc = F.linear(terms.xq, head.weight).float()  # [R, V] fp32 sums rounded once to fp16
    else:
        acc = terms.xq.float() @ head.weight.float().t()  # [R, V] exact products, fp32 sums
    return bounds_from_sums(head, terms, kc, acc.mul_(head.scale[None, :]))


def bounds_from_sums(
    head: CheapHead,
    terms: RowTerms,
    kc: float,
    scaled: Tensor,  # [R, V] fp32: fl(cheap sum) · scale[v], consumed (written over)
) -> tuple[Tensor, Tensor]:
    """``(upper [R, nb], lower [R, nb])`` from the scaled cheap sums of any kernel that keeps the
    rounding model (exact products, fp32 sums in any order, one fp32 multiply by the scale)."""
    c = scaled.mul_(terms.x_scale[:, None])  # [R, V] cheap logits (power-of-two scaling)
    # d = tau + a·beta + b·omega (one rank-2 product: ≤ 4 roundings), + kc·|c|, times PAD.
    ab = torch.stack([terms.a, terms.b], dim=1)  # [R, 2]
    beta_omega = torch.stack([head.beta, head.omega])  # [2, V]
    d = torch.addmm(terms.tau[:, None].expand(-1, c.shape[1]), ab, beta_omega)  # [R, V]
    d.add_(c.abs().mul_(kc)).mul_(PAD)
    # NaN propagates through amax and inf stays inf: such rows fail the caller's finiteness check.
    upper = head.block_max(c + d)
    lower = head.block_max(c.sub_(d))
    return upper, lower


def block_bounds_blockwise(head: CheapHead, terms: RowTerms, kc: float) -> tuple[Tensor, Tensor]:
    """fp16 heads, the fast CPU path: one bound per block, so only two passes over ``[R, V]``.

    With one power-of-two scale s_r = x_scale·2^e per row, max_{v∈b} c_v = s_r·max_{v∈b} acc_v,
    and D_b = PAD·(a·(B_b + kc·Γ_b) + b·Ω_b + τ) ≥ D_v for every v in b, where B, Γ, Ω are the
    block maxima of beta, gamma, omega and |c_v| ≤ a·gamma_v. Then upper = max c + D_b bounds every
    z_v of the block and lower = max c − D_b ≤ c_w − D_w ≤ z_w for the block's best w.
    """
    if head.fmt != "fp16":
        raise ValueError("block-wise bounds need the fp16 head (one scale for every row)")
    acc_max = head.block_max(F.linear(terms.xq, head.weight)).float()  # [R, nb] exact max
    c = acc_max * (terms.x_scale * head.scale_max)[:, None]  # power-of-two scaling: exact
    bmax = round_up_f32(head.block_beta.double() + kc * head.block_gamma.double())  # [nb]
    omax = head.block_omega  # [nb]
    d = terms.a[:, None] * bmax[None, :] + terms.b[:, None] * omax[None, :]
    d = (d + terms.tau[:, None]) * PAD
    return c + d, c - d


@functools.cache
def _triton_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def bound_kernel(
        x_ptr,  # [R, H] bf16
        q_ptr,  # [V, H] int8
        scale_ptr,  # [V] f32
        beta_ptr,  # [V] f32
        omega_ptr,  # [V] f32
        xs_ptr,  # [R] f32
        a_ptr,  # [R] f32
        b_ptr,  # [R] f32
        tau_ptr,  # [R] f32
        up_ptr,  # [R, nb] f32
        lo_ptr,  # [R, nb] f32
        R,
        V,
        stride_x,
        stride_q,
        nb,
        kc,
        pad,
        BLOCK_R: tl.constexpr,
        BLOCK_V: tl.constexpr,
        H: tl.constexpr,  # constexpr: loops over it (and the interpreter needs a plain int)
        BLOCK_K: tl.constexpr,
        DOT_F32: tl.constexpr,
    ):
        pid_v = tl.program_id(0)
        pid_r = tl.program_id(1)
        rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        vs = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        rmask = rows < R
        vmask = vs < V
        acc = tl.zeros((BLOCK_R, BLOCK_V), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            kmask = ks < H
            x = tl.load(
                x_ptr + rows[:, None] * stride_x + ks[None, :],
                mask=rmask[:, None] & kmask[None, :],
                other=0.0,
            )
            q = tl.load(
                q_ptr + vs[:, None] * stride_q + ks[None, :],
                mask=vmask[:, None] & kmask[None, :],
                other=0,
            )
            if DOT_F32:  # the interpreter's bf16 dot is broken; fp32 IEEE dot, same products
                acc = tl.dot(
                    x.to(tl.float32), tl.trans(q.to(tl.float32)), acc, input_precision="ieee"
                )
            else:  # |q| ≤ 127 is exact in bf16: exact products, fp32 accumulation
                acc = tl.dot(x, tl.trans(q.to(tl.bfloat16)), acc)
        sc = tl.load(scale_ptr + vs, mask=vmask, other=0.0)
        beta = tl.load(beta_ptr + vs, mask=vmask, other=0.0)
        omega = tl.load(omega_ptr + vs, mask=vmask, other=0.0)
        xs = tl.load(xs_ptr + rows, mask=rmask, other=1.0)
        a = tl.load(a_ptr + rows, mask=rmask, other=0.0)
        b = tl.load(b_ptr + rows, mask=rmask, other=0.0)
        tau = tl.load(tau_ptr + rows, mask=rmask, other=0.0)
        c = acc * sc[None, :] * xs[:, None]
        d = a[:, None] * beta[None, :] + b[:, None] * omega[None, :]
        d = (d + kc * tl.abs(c) + tau[:, None]) * pad
        bad = (c != c) | (tl.abs(c) == float("inf"))
        up = tl.where(bad, float("inf"), c + d)
        lo = c - d
        up = tl.where(vmask[None, :], up, float("-inf"))
        lo = tl.where(vmask[None, :], lo, float("-inf"))
        tl.store(up_ptr + rows * nb + pid_v, tl.max(up, axis=1), mask=rmask)
        tl.store(lo_ptr + rows * nb + pid_v, tl.max(lo, axis=1), mask=rmask)

    return bound_kernel


def block_bounds_triton(head: CheapHead, terms: RowTerms, kc: float) -> tuple[Tensor, Tensor]:
    """Triton kernel (int8 heads): same contract as :func:`block_bounds_ref`."""
    if head.fmt != "int8":
        raise ValueError("the Triton bound kernel takes int8 heads; use block_bounds_ref for fp16")
    xq = terms.xq.contiguous()
    q = head.weight
    if q.stride(1) != 1 or xq.dtype != torch.bfloat16:
        raise ValueError("bound kernel: want a row-major int8 head and bf16 rows")
    r, h = xq.shape
    nb = head.num_blocks
    upper = torch.empty(r, nb, dtype=torch.float32, device=xq.device)
    lower = torch.empty(r, nb, dtype=torch.float32, device=xq.device)
    block_r = min(64, max(16, 1 << (r - 1).bit_length()))
    grid = (nb, -(-r // block_r))
    _triton_kernel()[grid](
        xq,
        q,
        head.scale,
        head.beta,
        head.omega,
        terms.x_scale,
        terms.a,
        terms.b,
        terms.tau,
        upper,
        lower,
        r,
        head.vocab,
        xq.stride(0),
        q.stride(0),
        nb,
        kc,
        PAD,
        BLOCK_R=block_r,
        BLOCK_V=head.block,
        H=h,
        BLOCK_K=128 if h >= 128 else 32,
        DOT_F32=os.environ.get("TRITON_INTERPRET") == "1",
    )
    return upper, lower
