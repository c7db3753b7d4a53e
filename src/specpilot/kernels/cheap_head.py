"""The cheap head: a low-precision copy of the LM head with the bound terms of its rows, and the
terms of each hidden row (the inputs of the certified exact-argmax head's bounds).

:func:`prepare_cheap_head` quantizes ``W [V, H]`` (int8 with a per-row scale, or fp16 scaled by
one power of two) and bounds, per vocabulary row, what that loses (``beta``), the row's norm
(``omega``) and the cheap logit's magnitude (``gamma``), all rounded up, in float64 chunks.
:func:`row_terms` scales each hidden row by a power of two, rounds it to the cheap dtype and bounds
what that loses (``a``, ``b``, ``tau``). Every term, and its rounding, is defined in the proof
(``mechanisms/exact_argmax.py``); the bounds built from them: ``kernels/argmax_bound.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

U32 = 2.0**-24
"""Unit roundoff of float32."""
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
