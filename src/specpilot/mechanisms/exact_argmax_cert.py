"""The steps of the exact-argmax certificate that both of its heads share (proof, steps 2 and 5,
in ``mechanisms/exact_argmax.py``): the stock head's rounding model, the bound coefficient of the
cheap logit, and the float64 refine that picks a winner only when its interval is strictly above
every other candidate's."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from specpilot.kernels.cheap_head import (
    U32,
    UNDERFLOW_PER_OP,
    CheapHead,
    RowTerms,
    accumulation_error,
    row_terms,
)
from specpilot.models.transformer import Transformer

BoundsFn = Callable[[CheapHead, RowTerms, float], tuple[Tensor, Tensor]]
"""``(head, terms, kc) -> (upper [N, nb], lower [N, nb])``: one of ``kernels/argmax_bound``'s."""


def cheap_format(fmt: str, device: torch.device, auto: str) -> str:
    """The cheap copy's format (``auto`` for "auto"), refused where the proof does not hold."""
    if fmt == "auto":
        fmt = auto
    if fmt == "fp16":
        reduced = (
            torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction
            if device.type == "cuda"
            else getattr(
                torch._C, "_get_cpu_allow_fp16_reduced_precision_reduction", lambda: True
            )()
        )
        if reduced:
            raise ValueError(
                "The fp16 certified head needs fp32 accumulation; turn off fp16 reduced-"
                "precision reduction or use fmt='int8'."
            )
    return fmt


def stock_argmax(model: Transformer, x: Tensor) -> Tensor:  # x: [B, R, H] → [B, R] int64
    """Exactly what ``Transformer.forward_argmax`` does without a plug (the stock answer)."""
    b, r, h = x.shape
    logits = model.stock_forward().logits_normed(x.reshape(b * r, h))
    return logits.argmax(dim=-1).view(b, r)


@dataclass(frozen=True, slots=True)
class StockRounding:
    """The stock head's rounding model (module docstring): |z − s| ≤ eps·||x||·||w|| + u_out|z| + tau."""

    eps: float
    u_out: float
    tau: float
    max_logit: float


def stock_rounding(dtype: torch.dtype, device: torch.device, hidden: int) -> StockRounding:
    """Read from the dtype, the device and torch's current matmul precision settings."""
    u_out = 0.0 if dtype == torch.float32 else float(torch.finfo(dtype).eps) / 2
    u_p = u_out
    u_in = 0.0
    if device.type == "cuda" and dtype == torch.float32:
        prec = torch.get_float32_matmul_precision()
        if prec == "medium":
            u_in = 2.0**-8
        elif prec == "high" or torch.backends.cuda.matmul.allow_tf32:
            u_in = 2.0**-11
    eps = (accumulation_error(hidden, device) + u_p + 2.02 * u_in) * (1 + u_out)
    tiny = float(torch.finfo(dtype).smallest_normal) * float(torch.finfo(dtype).eps)
    tau = (hidden + 2) * UNDERFLOW_PER_OP + tiny
    return StockRounding(eps=eps, u_out=u_out, tau=tau, max_logit=float(torch.finfo(dtype).max))


def kc_coefficient(head: CheapHead, stock: StockRounding) -> float:
    """Coefficient of |c| in the fp32 bound (step 4): k_c, the stock output rounding and 8u."""
    k = (1 + 2 * stock.u_out) * (2 * head.cheap_roundoff() + 2 * stock.u_out + 8 * U32)
    return k * (1 + 2.0**-20)  # ≥ k after the cast to float32


@dataclass(frozen=True, slots=True)
class Bounded:
    """Steps 1–4 for a call's rows: the row terms, the block bounds and the pruning threshold."""

    terms: RowTerms
    upper: Tensor  # [N, nb] float32 ≥ every stock logit of the block
    lower: Tensor  # [N, nb] float32 ≤ some stock logit of the block
    best_lower: Tensor  # [N] M_r = max_b lower
    ok: Tensor  # [N] bool: finite, far from overflow, finite bounds


def bound_rows(x: Tensor, head: CheapHead, stock: StockRounding, bounds: BoundsFn) -> Bounded:
    """Row terms (with step 2's (1 + 2u_out) folded in) and block bounds of ``x [N, H]``."""
    terms = row_terms(x, head, stock.eps, stock.tau, stock.max_logit, grow=1 + 2 * stock.u_out)
    upper, lower = bounds(head, terms, kc_coefficient(head, stock))
    best_lower = lower.amax(dim=1)
    ok = terms.ok & torch.isfinite(upper).all(dim=1) & torch.isfinite(best_lower)
    return Bounded(terms, upper, lower, best_lower, ok)


def refine_coefficients(stock: StockRounding, hidden: int) -> tuple[float, float, float]:
    """Step 5's error ``E = c_n·||x||·ω + c_a·|ŝ| + c_t + 2^-50·|ŝ|`` as ``(c_n, c_a, c_t)``."""
    g = (1 + 2 * stock.u_out) * (1 + 2.0**-30)
    return g * (stock.eps + 2 * hidden * 2.0**-53), g * stock.u_out, g * stock.tau


def refine_intervals(
    s_hat: Tensor,  # [N, n] float64: x·w_v of the refined vocabulary rows
    omega: Tensor,  # [n] or [N, n] float64 ≥ ||w_v||
    x_norm: Tensor,  # [N] float64 ≥ ||x||
    cand: Tensor,  # [N, n] bool: v is a candidate of row r (others never win, step 3)
    stock: StockRounding,
    hidden: int,
) -> tuple[Tensor, Tensor]:
    """Step 5: ``(lo, hi) [N, n]`` with every candidate's stock logit in ``[lo, hi]``; -inf
    for non-candidates."""
    if omega.dim() == 1:
        omega = omega[None]
    c_n, c_a, c_t = refine_coefficients(stock, hidden)
    err = c_n * x_norm[:, None] * omega + (c_a + 2.0**-50) * s_hat.abs() + c_t  # [N, n]
    lo = torch.where(cand, s_hat - err, -math.inf)
    hi = torch.where(cand, s_hat + err, -math.inf)
    return lo, hi


def certified_pick(lo: Tensor, hi: Tensor) -> tuple[Tensor, Tensor]:
    """``(pick [N], certified [N] bool)``: the candidate with the largest lower end, certified
    when that lower end is above the upper end of every other candidate."""
    pick = lo.argmax(dim=1, keepdim=True)  # [N, 1]
    pick_lo = lo.gather(1, pick).squeeze(1)
    others = hi.scatter(1, pick, -math.inf).amax(dim=1)
    return pick.squeeze(1), torch.isfinite(pick_lo) & (pick_lo > others)


__all__ = [
    "Bounded",
    "BoundsFn",
    "StockRounding",
    "bound_rows",
    "certified_pick",
    "cheap_format",
    "kc_coefficient",
    "refine_coefficients",
    "refine_intervals",
    "stock_argmax",
    "stock_rounding",
]
