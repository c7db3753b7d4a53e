"""Rigorous per-block bounds on LM-head logits from a low-precision copy of the head.

The certified exact-argmax head (``mechanisms/exact_argmax.py``, which holds the proof) needs, for
every hidden row r and every vocabulary block b of ``block`` rows, two numbers:

* ``upper[r, b]`` ≥ the largest *stock* logit ``z[r, v]`` over v in b, and
* ``lower[r, b]`` ≤ some stock logit ``z[r, v]`` with v in b,

computed from a cheap copy of the head (int8 with a per-row scale, or an fp16 copy scaled by a power
of two) plus per-row and per-vocab-row error terms. Per element the bound is

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
import math
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

U32 = 2.0**-24
"""Unit roundoff of float32."""
PAD = 1.0 + 2.0**-18
"""Multiplier that absorbs the float32 roundings of the bound itself (see the proof, step 4)."""
TAU_PAD = 2.0**-120
"""Absolute slack for float32 underflow in the bound arithmetic (each op errs by ≤ 2^-150, or
≤ 2^-126 where a GPU kernel flushes subnormals to zero)."""
UNDERFLOW_PER_OP = 2.0**-124
"""Absolute error of one fp32 op of an accumulation on underflow, ≥ a flush to zero's 2^-126
(kernels we do not control may flush subnormals); the proof's τ terms count H + 2 of them."""
FORMATS = ("int8", "fp16")


def accumulation_error(hidden: int, device: torch.device) -> float:
    """κ: relative error bound (w.r.t. Σ|a_i b_i|) of an fp32-accumulated dot of H exact products.

    IEEE summation in any order (CPU: SSE/AVX adds and FMAs) errs by at most
    γ_H = H·u/(1 − H·u), u = 2^-24. GPU tensor cores accumulate with truncation of aligned
    significands, a few ulps per multi-term add (Fasi, Higham, Mikaitis, Pranesh 2021, "Numerical
    behavior of NVIDIA tensor cores"); for CUDA we take H·2^-21, 8x the IEEE bound.
    """
    if device.type == "cpu":
        if hidden * U32 >= 0.5:
            raise ValueError(f"hidden size {hidden} too large for the fp32 accumulation bound")
        return hidden * U32 / (1 - hidden * U32) * (1 + 2.0**-20)
    return hidden * 2.0**-21


def round_up_f32(t: Tensor) -> Tensor:
    """float64 → float32, rounded toward +inf (so the result is ≥ the input)."""
    y = t.float()
    return torch.where(y.double() < t, torch.nextafter(y, torch.full_like(y, math.inf)), y)


@dataclass(frozen=True, slots=True)
class CheapHead:
    """A low-precision copy of an LM head ``W [V, H]`` with the per-vocab-row bound terms."""

    fmt: str  # "int8" (per-row scale) or "fp16" (one power-of-two scale)
    weight: Tensor  # [V, H] int8 codes, or float16 values of W / 2^e
    scale: Tensor  # [V] float32: W[v] ≈ scale[v] · weight[v]
    beta: Tensor  # [V] float32 ≥ ||W[v] − scale[v]·weight[v]||₂ + κ(H)·scale[v]·||weight[v]||₂
    omega: Tensor  # [V] float32 ≥ ||W[v]||₂
    gamma: Tensor  # [V] float32: |c_v| ≤ a·gamma[v] (Cauchy–Schwarz on the cheap dot)
    block_beta: Tensor  # [nb] float32: max of beta over each block
    block_gamma: Tensor  # [nb] float32: max of gamma over each block
    block_omega: Tensor  # [nb] float32: max of omega over each block
    omega_max: float  # max_v omega[v]
    scale_max: float  # max_v scale[v]
    block: int  # vocabulary rows per block

    @property
    def vocab(self) -> int:
        return int(self.weight.shape[0])

    @property
    def hidden(self) -> int:
        return int(self.weight.shape[1])

    @property
    def num_blocks(self) -> int:
        return -(-self.vocab // self.block)

    def block_max(self, t: Tensor) -> Tensor:
        """``[..., V]`` → ``[..., nb]``: the maximum of every block (the last one may be short)."""
        return _block_max(t, self.block)

    def cheap_roundoff(self) -> float:
        """u_c: relative rounding of the cheap logit after accumulation (output cast + scaling)."""
        return 2.0**-11 + 2 * U32 if self.fmt == "fp16" else 2 * U32


def _block_max(t: Tensor, block: int) -> Tensor:
    v = t.shape[-1]
    full = v // block * block
    parts = [t[..., :full].unflatten(-1, (-1, block)).amax(dim=-1)] if full else []
    if full < v:
        parts.append(t[..., full:].amax(dim=-1, keepdim=True))
    return torch.cat(parts, dim=-1)


def prepare_cheap_head(
    weight: Tensor,  # [V, H] the stock LM head (any float dtype)
    fmt: str = "int8",
    block: int = 64,
    chunk_rows: int = 8192,
) -> CheapHead:
    """Quantize the head and compute its bound terms in float64, a chunk of rows at a time."""
    if fmt not in FORMATS:
        raise ValueError(f"cheap head format must be one of {FORMATS}, got {fmt!r}")
    v, h = weight.shape
    if fmt == "fp16" and h > 32768:
        raise ValueError("the fp16 cheap head needs hidden size ≤ 32768 (its sums must fit fp16)")
    kappa = accumulation_error(h, weight.device)
    dev = weight.device
    codes = torch.empty(v, h, dtype=torch.int8 if fmt == "int8" else torch.float16, device=dev)
    scale = torch.empty(v, dtype=torch.float32, device=dev)
    beta = torch.empty(v, dtype=torch.float32, device=dev)
    omega = torch.empty(v, dtype=torch.float32, device=dev)
    gamma = torch.empty(v, dtype=torch.float32, device=dev)
    wmax = float(weight.abs().max().float())
    if not math.isfinite(wmax):
        raise ValueError(
            "the LM head holds non-finite weights; the certified head needs finite ones"
        )
    # fp16: one power-of-two scale with max |W / 2^e| in [0.5, 1): exact scaling, sums < H.
    e16 = math.frexp(wmax)[1] if wmax > 0 else 0
    for lo in range(0, v, chunk_rows):
        w = weight[lo : lo + chunk_rows].double()  # [n, H] exact
        if fmt == "int8":
            s = (w.abs().amax(dim=1) / 127.0).float()  # [n]
            safe = torch.where(s > 0, s, torch.ones_like(s)).double()
            q = torch.round(w / safe[:, None]).clamp(-127, 127)
            q = torch.where(s[:, None] > 0, q, torch.zeros_like(q))
            codes[lo : lo + chunk_rows] = q.to(torch.int8)
            s64 = s.double()
        else:
            q16 = (w * 2.0**-e16).to(torch.float16)
            codes[lo : lo + chunk_rows] = q16
            q = q16.double()
            s = torch.full((w.shape[0],), 2.0**e16, dtype=torch.float32, device=dev)
            s64 = s.double()
        scale[lo : lo + chunk_rows] = s
        resid = (w - s64[:, None] * q).norm(dim=1)  # [n]
        cheap_norm = s64 * q.norm(dim=1)
        beta[lo : lo + chunk_rows] = round_up_f32((resid + kappa * cheap_norm) * (1 + 2.0**-40))
        omega[lo : lo + chunk_rows] = round_up_f32(w.norm(dim=1) * (1 + 2.0**-40))
        u_c = 2.0**-11 if fmt == "fp16" else 2 * U32
        gamma[lo : lo + chunk_rows] = round_up_f32(
            cheap_norm * (1 + kappa) * (1 + u_c) * (1 + 2.0**-40)
        )
    return CheapHead(
        fmt=fmt,
        weight=codes,
        scale=scale,
        beta=beta,
        omega=omega,
        gamma=gamma,
        block_beta=_block_max(beta, block),
        block_gamma=_block_max(gamma, block),
        block_omega=_block_max(omega, block),
        omega_max=float(omega.max()),
        scale_max=float(scale.max()),
        block=block,
    )


@dataclass(frozen=True, slots=True)
class RowTerms:
    """Per hidden row: the scaled low-precision copy and the row's bound terms."""

    xq: Tensor  # [R, H] bf16 (int8 head) or fp16 (fp16 head): x / x_scale, rounded
    x_scale: Tensor  # [R] float32 power of two
    a: Tensor  # [R] float32 ≥ ||x_scale · xq||₂
    b: Tensor  # [R] float32 ≥ ||x − x_scale·xq||₂ + ε_stock·||x||₂
    tau: Tensor  # [R] float32 absolute slack (underflow of the cheap and the stock sums)
    x_norm: Tensor  # [R] float64 ≥ ||x||₂
    ok: Tensor  # [R] bool: finite and far from overflow; other rows take the stock path


def row_terms(
    x: Tensor,  # [R, H] final-normed hidden rows (the stock head's input)
    head: CheapHead,
    eps_stock: float,
    tau_stock: float,
    max_logit: float,
    grow: float = 1.0,
) -> RowTerms:
    """Scale each row by a power of two, round it to the cheap dtype, and bound what that loses.

    ``a``, ``b`` and ``tau`` are multiplied by ``grow`` (the (1 + 2u_out) of the proof's step 2).
    """
    xf = x.float()
    amax = xf.abs().amax(dim=1)  # [R]
    finite = torch.isfinite(xf).all(dim=1)
    _, expo = torch.frexp(torch.where(finite & (amax > 0), amax, torch.ones_like(amax)))
    x_scale = torch.ldexp(torch.ones_like(amax), expo)  # [R] 2^e with max |x / 2^e| < 1
    lp = torch.bfloat16 if head.fmt == "int8" else torch.float16
    xq = (xf / x_scale[:, None]).to(lp)  # exact division (power of two), then rounded
    xd = x.double()
    xs = xq.double() * x_scale.double()[:, None]  # [R, H] exact
    x_norm = xd.norm(dim=1) * (1 + 2.0**-40)
    a = xs.norm(dim=1) * (1 + 2.0**-40)
    b = (xd - xs).norm(dim=1) * (1 + 2.0**-40) + eps_stock * x_norm
    h = head.hidden
    cheap_tau = (
        2.0**-24 * x_scale.double() * head.scale_max
        if head.fmt == "fp16"
        else (h + 2) * UNDERFLOW_PER_OP * x_scale.double() * head.scale_max
    )
    tau = 2 * cheap_tau + tau_stock + TAU_PAD
    # No stock partial sum can overflow when ||x||·max||W_v|| stays well inside the dtype's range.
    ok = finite & torch.isfinite(x_norm) & (x_norm * head.omega_max < max_logit / 4)
    return RowTerms(
        xq=xq,
        x_scale=x_scale,
        a=round_up_f32(a * grow),
        b=round_up_f32(b * grow),
        tau=round_up_f32(tau * grow),
        x_norm=x_norm,
        ok=ok,
    )


def _pad_blocks(t: Tensor, block: int) -> Tensor:
    """``[R, V]`` → ``[R, nb, block]``, padding the last block with -inf."""
    v = t.shape[1]
    nb = -(-v // block)
    return F.pad(t, (0, nb * block - v), value=-math.inf).view(t.shape[0], nb, block)


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
