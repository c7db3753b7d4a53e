"""Certified exact-argmax LM head: the stock argmax, from a low-precision copy of the head.

Greedy decoding needs only ``argmax_v z[v]`` of the stock logits ``z = x Wᵀ`` (lowest id on ties).
Reading all of ``W [V, H]`` in the model dtype is the LM head's cost; this head reads an int8
(GPU, Triton kernel) or fp16 (CPU) copy instead, bounds every stock logit rigorously, and touches
the full-precision weights only for the few vocabulary blocks that could still hold the maximum.
When the bounds cannot separate a winner it returns the stock computation itself. Tiers:

1. **Bounds** (``kernels/argmax_bound.py``): per row r and block b, ``upper[r,b] ≥ max_{v∈b} z_v``
   and ``lower[r,b] ≤ z_v`` for some v in b. ``M_r = max_b lower[r,b]``; a block is a *candidate*
   if ``upper[r,b] ≥ M_r``.
2. **Refine**: for the union of candidate blocks, logits in float64 from the stock weights, each
   with an interval that contains the stock z_v. The row is *certified* if one candidate's
   interval lies strictly above every other candidate's.
3. **Stock**: if any row of the call is not certified (near-ties within rounding, exact ties,
   non-finite or huge hidden states, too many candidates), the head returns
   ``project(x, lm_head, …).argmax(-1)`` — literally the stock call on the same input.

Proof that the result equals ``torch.argmax`` of the stock logits (lowest id on ties)
----------------------------------------------------------------------------------------
Notation: s_v = x·w_v in exact real arithmetic; z_v = the stock head's floating-point logit;
u_out = unit roundoff of the model dtype (0 for fp32); A_v = Σ_i |x_i w_vi| ≤ ||x||·||w_v||.

*Stock rounding model* (the one assumption about a kernel we do not control): the stock head forms
each logit by multiplying input pairs (rounded first to TF32/bf16 when fp32 matmuls are allowed to
use them, relative error ≤ 2u_in), accumulating in fp32 or wider in any order (error ≤ κ·A_v with κ = γ_H = H·2^-24/(1 − H·2^-24)
on the CPU and κ = H·2^-21 = 8·H·2^-24 on CUDA, for truncating tensor-core adders), rounding partial
sums to the output dtype at most once (split-K reductions, ≤ u_p·A_v with u_p = u_out for 16-bit
dtypes) and the result once (≤ u_out·|z_v|), with underflow adding ≤ τ_out absolute. Hence
    |z_v − s_v| ≤ ε·||x||·||w_v|| + u_out·|z_v| + τ_out,  ε = (κ + u_p + 2.02·u_in)(1 + u_out).
Overflow is excluded by rejecting rows with ||x||·max_v||w_v|| ≥ max(dtype)/4 (tier 3).

Step 1 (cheap logit). Write x = x_s·x̂ + δ (x_s a power of two, x̂ = x/x_s rounded to bf16/fp16;
δ computed exactly in float64) and w_v = σ_v·ŵ_v + r_v (ŵ_v int8 codes or fp16 values; r_v exact
in float64). Then s_v = x_s·σ_v·(x̂·ŵ_v) + x_s·x̂·r_v + δ·w_v. The products x̂_i ŵ_vi are exact in
fp32 (≤ 8+8 or 11+11 significant bits); their fp32 sum errs by ≤ κ·Σ|x̂_i||ŵ_vi| ≤
κ·||x̂||·||ŵ_v||; the cheap logit c_v = fl(sum)·σ_v·x_s adds a relative rounding u_c (fp16 output
2^-11 plus 2 fp32 multiplies; powers of two are exact) and an underflow slack τ_c. Cauchy–Schwarz on
the other two terms:
    |c_v − s_v| ≤ a·β_v + g·ω_v + 2u_c|c_v| + 2τ_c,
a ≥ ||x_s x̂||, g ≥ ||δ||, β_v ≥ ||r_v|| + κ·σ_v||ŵ_v||, ω_v ≥ ||w_v||, all computed in float64
with a relative pad of 2^-40 (≫ float64 norm rounding) and rounded up to float32.
Step 2 (to the stock). |z_v − c_v| ≤ |z_v − s_v| + |s_v − c_v|, |z_v| ≤ |c_v| + |z_v − c_v| and
1/(1 − u_out) ≤ 1 + 2u_out give
    |z_v − c_v| ≤ D*_v := (1 + 2u_out)·(a·β_v + b·ω_v + k_c|c_v| + τ),
b = g + ε||x||, k_c = 2u_c + 2u_out, τ = 2τ_c + τ_out (row constants, in ``RowTerms``).
Step 3 (pruning). Every stock logit lies in [c_v − D*_v, c_v + D*_v]. Let M = max_v (c_v − D*_v),
attained at v_M: z_{v_M} ≥ M. If c_v + D*_v < M then z_v < z_{v_M}, so v is not an argmax of z and
no tie involves it. All maximisers of z (hence the lowest-id one) lie in candidate blocks, as
does v_M itself (its upper bound ≥ its lower bound = M).
Step 4 (rounding of the bound itself). The kernel evaluates D = PAD·(((a'·β + b'·ω) + k·|c|) + τ')
in fp32, where a', b', τ' are a, b, τ times (1 + 2u_out) rounded up, k = (1 + 2u_out)(k_c + 8·2^-24)
rounded up, and PAD = 1 + 2^-18. That is ≤ 7 roundings of non-negative terms, each losing at most
a factor (1 − 2^-24), or 2^-150 absolute on underflow (covered by the extra 2^-120 in τ), and
(1 + 2^-18)(1 − 2^-24)^7 ≥ 1 + 2^-19, so D ≥ (1 + 2^-19)·D* + 8·2^-24|c|. Then
fl(c + D) ≥ c + D − 2^-24(|c| + D) ≥ c + D*, and likewise fl(c − D) ≤ c − D*: the computed
bounds are valid. NaN or ±inf anywhere in a row (inputs, c, bounds) sends the call to tier 3
(a NaN would otherwise vanish in a max).
Step 4b (block-wise variant, fp16 copy on the CPU). With one power-of-two scale per row,
max_{v∈b} c_v is the block maximum of the fp16 sums times that scale (exact). Since |c_v| ≤ a·γ_v
(Cauchy–Schwarz on x̂·ŵ_v, plus κ and the fp16 rounding, γ_v precomputed and rounded up), one
constant D_b = PAD·(a·(B_b + k·Γ_b) + b·Ω_b + τ) with B, Γ, Ω the block maxima of β, γ, ω is
≥ every D_v of the block with the same padding argument (≤ 5 roundings, and k·a·Γ_b ≥ 8·2^-24|c|),
so upper = max c + D_b and lower = max c − D_b ≤ c_w − D_w (w the block's best) are valid.
Step 5 (refine). For the union of candidate blocks, ŝ_v = x·w_v in float64 (exact products,
|ŝ_v − s_v| ≤ 1.01·H·2^-53·A_v). As in step 2, |z_v − ŝ_v| ≤ (1 + 2u_out)((ε + 2H·2^-53)·||x||·ω_v
+ u_out|ŝ_v| + τ_out); E_v is that times (1 + 2^-30) plus 2^-50|ŝ_v|, which absorbs the float64
evaluation of E_v and of ŝ_v ± E_v. If the candidate v* with the largest lower end ŝ − E has a
lower end > the upper end ŝ + E of every other candidate, then z_{v*} > z_v for every other
candidate and, by step 3, for every non-candidate: v* is the unique maximiser, which is what
torch.argmax returns.
Step 6 (stock). Otherwise the call returns the stock call's own argmax on the same input, which
is the stock result by definition (kernels are deterministic for a fixed input and shape).
So the returned ids always equal the stock argmax; only speed depends on the data.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from specpilot.kernels import triton_usable
from specpilot.kernels.argmax_bound import (
    U32,
    CheapHead,
    RowTerms,
    accumulation_error,
    block_bounds_blockwise,
    block_bounds_ref,
    block_bounds_triton,
    prepare_cheap_head,
    row_terms,
)
from specpilot.mechanisms.registry import Applicability, Knob, Mechanism
from specpilot.models.transformer import Transformer

if TYPE_CHECKING:
    from specpilot.engine.build import EngineBuild


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
    tau = (hidden + 2) * 2.0**-148 + tiny
    return StockRounding(eps=eps, u_out=u_out, tau=tau, max_logit=float(torch.finfo(dtype).max))


@dataclass(slots=True)
class HeadStats:
    """Rows answered by each tier (counters of this head instance)."""

    calls: int = 0
    rows: int = 0
    certified_rows: int = 0
    stock_calls: int = 0
    candidate_blocks: int = 0

    def to_dict(self) -> dict[str, int]:
        return {
            "calls": self.calls,
            "rows": self.rows,
            "certified_rows": self.certified_rows,
            "stock_calls": self.stock_calls,
            "candidate_blocks": self.candidate_blocks,
        }


def _kc(head: CheapHead, stock: StockRounding) -> float:
    """Coefficient of |c| in the fp32 bound (step 4): k_c, the stock output rounding and 8u."""
    k = (1 + 2 * stock.u_out) * (2 * head.cheap_roundoff() + 2 * stock.u_out + 8 * U32)
    return k * (1 + 2.0**-20)  # ≥ k after the cast to float32


def certify(
    x: Tensor,  # [N, H] final-normed hidden rows
    head: CheapHead,
    lm_head: Tensor,  # [V, H] stock weights
    stock: StockRounding,
    use_triton: bool,
    max_refine_rows: int,
    stats: HeadStats | None = None,
    blockwise: bool = True,
) -> Tensor | None:
    """Certified argmax ids ``[N]``, or None when some row needs the stock path (tier 3)."""
    # (1 + 2u_out) of step 2 is folded into the row terms.
    terms: RowTerms = row_terms(
        x, head, stock.eps, stock.tau, stock.max_logit, grow=1 + 2 * stock.u_out
    )
    kc = _kc(head, stock)
    if use_triton:
        bounds = block_bounds_triton
    elif head.fmt == "fp16" and blockwise:
        bounds = block_bounds_blockwise
    else:
        bounds = block_bounds_ref
    upper, lower = bounds(head, terms, kc)  # [N, nb] each
    best_lower = lower.amax(dim=1)  # [N]: M_r
    ok = terms.ok & torch.isfinite(upper).all(dim=1) & torch.isfinite(best_lower)
    cand = upper >= best_lower[:, None]  # [N, nb]
    blocks = cand.any(dim=0).nonzero().squeeze(1)  # [nc] union over rows (host sync)
    if stats is not None:
        stats.candidate_blocks += int(cand.sum())
    bsz = head.block
    if not bool(ok.all()) or blocks.numel() * bsz > max_refine_rows:
        return None
    ids = (blocks[:, None] * bsz + torch.arange(bsz, device=x.device)).flatten()  # [n]
    valid = ids < head.vocab
    ids = ids.clamp(max=head.vocab - 1)
    s_hat = x.double() @ lm_head[ids].double().t()  # [N, n]
    h = head.hidden
    omega = head.omega[ids].double()  # [n]
    err = (1 + 2 * stock.u_out) * (1 + 2.0**-30) * (
        (stock.eps + 2 * h * 2.0**-53) * terms.x_norm[:, None] * omega[None]
        + stock.u_out * s_hat.abs()
        + stock.tau
    ) + 2.0**-50 * s_hat.abs()  # [N, n]
    row_cand = cand[:, ids // bsz] & valid[None, :]  # [N, n]
    lo = torch.where(row_cand, s_hat - err, -math.inf)
    hi = torch.where(row_cand, s_hat + err, -math.inf)
    pick = lo.argmax(dim=1, keepdim=True)  # [N, 1]
    pick_lo = lo.gather(1, pick).squeeze(1)
    others = hi.scatter(1, pick, -math.inf).amax(dim=1)
    certified = torch.isfinite(pick_lo) & (pick_lo > others)
    if not bool(certified.all()):
        return None
    return ids[pick.squeeze(1)]


class ExactArgmaxHead:
    """The ``Transformer.argmax_head`` plug: final-normed hidden ``[B, R, H]`` → ids ``[B, R]``."""

    graph_safe = False
    """It decides on the host whether its certificate holds (else the stock head answers), so
    the engine runs the verify step that holds it eagerly, also when the rest runs on graphs."""

    def __init__(
        self,
        model: Transformer,
        fmt: str = "auto",
        block: int = 64,
        max_refine_rows: int = 4096,
        use_triton: bool | None = None,
    ) -> None:
        dev = model.device
        if fmt == "auto":
            fmt = "int8" if dev.type == "cuda" else "fp16"
        if fmt == "fp16":
            reduced = (
                torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction
                if dev.type == "cuda"
                else getattr(
                    torch._C, "_get_cpu_allow_fp16_reduced_precision_reduction", lambda: True
                )()
            )
            if reduced:
                raise ValueError(
                    "The fp16 certified head needs fp32 accumulation; turn off fp16 reduced-"
                    "precision reduction or use fmt='int8'."
                )
        self.model = model
        self.head = prepare_cheap_head(model.lm_head.detach(), fmt, block)
        if use_triton is None:
            use_triton = fmt == "int8" and triton_usable(dev)
        self.use_triton = use_triton
        self.max_refine_rows = max_refine_rows
        self.stats = HeadStats()

    def stock(self, x: Tensor) -> Tensor:
        """Tier 3: exactly what ``Transformer.forward_argmax`` does without a plug."""
        b, r, h = x.shape
        logits = self.model.stock_forward().logits_normed(x.reshape(b * r, h))
        return logits.argmax(dim=-1).view(b, r)

    def __call__(self, x: Tensor) -> Tensor:  # x: [B, R, H] → [B, R] int64
        b, r, h = x.shape
        self.stats.calls += 1
        self.stats.rows += b * r
        stock = stock_rounding(self.model.dtype, x.device, h)
        ids = certify(
            x.reshape(b * r, h),
            self.head,
            self.model.lm_head,
            stock,
            self.use_triton,
            self.max_refine_rows,
            self.stats,
        )
        if ids is None:
            self.stats.stock_calls += 1
            return self.stock(x)
        self.stats.certified_rows += b * r
        return ids.view(b, r)


def _apply(build: EngineBuild, knobs: Mapping[str, Any]) -> None:
    model = build.target.model
    model.argmax_head = ExactArgmaxHead(
        model,
        fmt=str(knobs["format"]),
        block=int(knobs["block"]),
        max_refine_rows=int(knobs["max_refine_rows"]),
    )


MECHANISM = Mechanism(
    name="exact-argmax",
    component="lm_head",
    plug_point="lm_head_argmax",
    lossless=(
        "Rigorous per-block bounds on every stock logit (low-precision copy + Cauchy–Schwarz error "
        "terms + the stock kernel's rounding model) prune the vocabulary; a winner is returned only "
        "if its float64 interval lies strictly above every other candidate's, else the stock head "
        "itself answers. Proof in mechanisms/exact_argmax.py."
    ),
    apply=_apply,
    knobs=(
        Knob(
            "format",
            "auto",
            choices=("auto", "int8", "fp16"),
            doc="cheap copy: int8 per-row scale (GPU, Triton) or fp16 (CPU); auto picks by device",
        ),
        Knob("block", 64, choices=(32, 64, 128), doc="vocabulary rows per bound block"),
        Knob(
            "max_refine_rows",
            4096,
            low=64,
            high=65536,
            doc="most vocabulary rows refined in float64 per call before the stock head answers",
        ),
    ),
    applies=Applicability(),
    summary="LM-head argmax from an int8/fp16 copy with a rigorous certificate; stock fallback",
)


__all__ = ["MECHANISM", "ExactArgmaxHead", "HeadStats", "StockRounding", "certify"]
