"""Certified exact-argmax LM head: the stock argmax, from a low-precision copy of the head.

Greedy decoding needs only ``argmax_v z[v]`` of the stock logits ``z = x Wᵀ`` (lowest id on ties).
Reading all of ``W [V, H]`` in the model dtype is the LM head's cost; this head reads an int8
(GPU, Triton kernel) or fp16 (CPU) copy instead, bounds every stock logit rigorously, and touches
the full-precision weights only for the few vocabulary blocks that could still hold the maximum.
When the bounds cannot separate a winner it returns the stock computation itself. Tiers:

1. **Bounds** (``kernels/argmax_bound.py``, from the cheap head of ``kernels/cheap_head.py``): per
   row r and block b, ``upper[r,b] ≥ max_{v∈b} z_v`` and ``lower[r,b] ≤ z_v`` for some v in b.
   ``M_r = max_b lower[r,b]``; a block is a *candidate* if ``upper[r,b] ≥ M_r``.
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
dtypes) and the result once (≤ u_out·|z_v|), with underflow adding ≤ τ_out absolute (H + 2 ops
of ≤ 2^-124 each: a kernel may flush subnormals to zero). Hence
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
a factor (1 − 2^-24), or ≤ 2^-126 absolute on underflow, flush to zero included (covered by the
extra 2^-120 in τ), and
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

The graph-safe head (``mechanisms/exact_argmax_graph.py``) computes the same steps differently:
Step 1 through the INT8 GEMM with fp32 output (``kernels/int8_gemm.py``: the products x̂_i·q_vi
exact, fp32 sums in a fixed order with split-K partials added in fp32 — "any order" above — and
one fp32 multiply by σ_v; the multiply by x_s in the epilogue is exact), or in one fused kernel
for the row terms (``kernels/argmax_fused.py``: the same norms, float64 sums in another order,
covered by the 2^-40 pad, then rounded up to float32). Step 3b (fixed shapes): only the C blocks
with the largest upper bounds are refined, and a row counts as certified only if the (C+1)-th
largest upper bound is < M; then every block with upper ≥ M is among the C, so step 3 holds for
them. Step 6 becomes *abstain*: the call returns meaningless ids with a device flag set, and its
only caller that reads ids without checking the flag first, the engine's verify, commits nothing
and redoes the verify with the stock head (``engine/abstain.py``); calling the head itself checks
the flag on the host and returns the stock call's argmax, as here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from specpilot.kernels import triton_usable
from specpilot.kernels.argmax_bound import (
    block_bounds_blockwise,
    block_bounds_ref,
    block_bounds_triton,
)
from specpilot.kernels.cheap_head import CheapHead, prepare_cheap_head
from specpilot.mechanisms.exact_argmax_cert import (
    BoundsFn,
    StockRounding,
    bound_rows,
    certified_pick,
    cheap_format,
    refine_intervals,
    stock_argmax,
    stock_rounding,
)
from specpilot.mechanisms.exact_argmax_graph import GraphArgmaxHead
from specpilot.mechanisms.registry import Applicability, Knob, Mechanism
from specpilot.models.transformer import Transformer

if TYPE_CHECKING:
    from specpilot.mechanisms.parts import EngineParts


@dataclass(slots=True)
class HeadStats:
    """Rows answered by each tier (counters of this head instance)."""

    calls: int = 0
    rows: int = 0
    certified_rows: int = 0
    stock_calls: int = 0
    candidate_blocks: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


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
    if use_triton:
        bounds: BoundsFn = block_bounds_triton
    elif head.fmt == "fp16" and blockwise:
        bounds = block_bounds_blockwise
    else:
        bounds = block_bounds_ref
    bd = bound_rows(x, head, stock, bounds)
    terms, upper, best_lower, ok = bd.terms, bd.upper, bd.best_lower, bd.ok
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
    row_cand = cand[:, ids // bsz] & valid[None, :]  # [N, n]
    omega = head.omega[ids].double()  # [n]
    lo, hi = refine_intervals(s_hat, omega, terms.x_norm, row_cand, stock, head.hidden)
    pick, certified = certified_pick(lo, hi)
    if not bool(certified.all()):
        return None
    return ids[pick]


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
        fmt = cheap_format(fmt, dev, "int8" if dev.type == "cuda" else "fp16")
        self.model = model
        self.head = prepare_cheap_head(model.lm_head.detach(), fmt, block)
        if use_triton is None:
            use_triton = fmt == "int8" and triton_usable(dev)
        self.use_triton = use_triton
        self.max_refine_rows = max_refine_rows
        self.stats = HeadStats()

    def stock(self, x: Tensor) -> Tensor:
        """Tier 3: exactly what ``Transformer.forward_argmax`` does without a plug."""
        return stock_argmax(self.model, x)

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


def _apply(build: EngineParts, knobs: Mapping[str, Any]) -> None:
    model = build.target.model
    path = str(knobs["path"])
    if path == "auto":
        path = "graph" if model.device.type == "cuda" else "host"
    fmt, block = str(knobs["format"]), int(knobs["block"])
    if path == "graph":
        model.argmax_head = GraphArgmaxHead(
            model, fmt=fmt, block=block, candidates=int(knobs["candidates"])
        )
        return
    model.argmax_head = ExactArgmaxHead(
        model, fmt=fmt, block=block, max_refine_rows=int(knobs["max_refine_rows"])
    )


MECHANISM = Mechanism(
    name="exact-argmax",
    component="lm_head",
    plug_point="lm_head_argmax",
    lossless=(
        "Rigorous per-block bounds on every stock logit (low-precision copy + Cauchy–Schwarz error "
        "terms + the stock kernel's rounding model) prune the vocabulary; a winner is returned only "
        "if its float64 interval lies strictly above every other candidate's, else the stock head "
        "itself answers (the graph-safe head abstains instead and the engine redoes that verify "
        "with the stock head before committing). Proof in mechanisms/exact_argmax.py."
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
            "path",
            "auto",
            choices=("auto", "graph", "host"),
            doc="graph: fixed shapes, abstain flag, CUDA graphs (exact_argmax_graph.py); host: "
            "decides on the host, runs eagerly; auto: graph on CUDA, host elsewhere",
        ),
        Knob(
            "candidates",
            8,
            low=1,
            high=64,
            doc="graph path: blocks refined per row (C); a row needing more makes the call abstain",
            when=(("path", ("auto", "graph")),),
        ),
        Knob(
            "max_refine_rows",
            4096,
            low=64,
            high=65536,
            doc="host path: most vocabulary rows refined in float64 per call before the stock "
            "head answers",
            when=(("path", ("auto", "host")),),
        ),
    ),
    applies=Applicability(),
    summary=(
        "LM-head argmax from an int8/fp16 copy with a rigorous certificate; stock fallback. Pays "
        "where the head's bytes are a large part of a step (small targets, big vocabularies); "
        "never for a drafter's head (exact_argmax_cost.py)"
    ),
)


__all__ = ["MECHANISM", "ExactArgmaxHead", "HeadStats", "StockRounding", "certify"]
