"""Decode GEMVs with their neighbours fused in: fewer, fatter kernels per decoder layer.

For M <= 4 rows a decoder layer runs, besides its four GEMVs, two RMSNorm kernels and one
SiLU·mul kernel, and on cuBLAS split-K reduce kernels for the narrow ``o`` and ``down`` products
(docs/GPU_PATH.md, "Where the AR step goes"). These wrappers run the bf16 GEMV of
``kernels/w12_gemv.py`` (one launch, split-K reduced in the kernel by an arrival counter; bf16
weights, or W12 v3 ones decoded in registers, whose escape gathers go through the same
prologue) with:

* ``norm_gemv``: the RMSNorm of ``x`` as its prologue (qkv after ``input_norm``, gate_up after
  ``post_attn_norm``). Every program computes its rows' ``1 / RMS`` itself from the whole row
  (``K`` bf16 values, in L2 after the first program) and normalises each ``x`` value as it loads
  it, rounding as ``reference.rms_norm_ref`` does: fp32 statistics, ``bf16(x · inv_rms)``, times
  the weight, ``bf16``;
* ``silu_gemv``: ``silu(gate) * up`` of the ``[M, 2I]`` gate_up output as its prologue (the down
  GEMV), rounded as ``reference.silu_mul_ref``: ``bf16(bf16(silu(g)) · u)``, silu in fp32;
* an ``[M, N]`` residual added in the epilogue, in fp32 before the single bf16 rounding, as
  ``torch.addmm(x, a, W.T)`` (the engine's fused residual on CUDA) does (``residual=``).

Numerics against the unfused kernels: the rounding steps are the same, so the normalised or
activated ``x`` is the unfused kernel's bit for bit, except that (a) the sum of squares is added
in another fp32 order than the RMSNorm kernel's (or torch's), which can move ``inv_rms`` by an
ulp and then rarely one normalised value by one bf16 ulp, and (b) ``exp`` and ``rsqrt`` are
Triton's, as in ``decode_triton`` (torch's CPU ``exp`` can differ in the last fp32 bit). The product
then differs from ``F.linear`` of the same ``x`` only in fp32 summation order (``w12_gemm``'s bound
``γ_K · Σ|x·w|``), as any two GEMM kernels do. Tests (``tests/test_fused_gemv.py``) pin each part.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from specpilot.kernels import reference
from specpilot.kernels.w12_gemv import (
    PROLOGUE_NONE,
    PROLOGUE_NORM,
    PROLOGUE_SILU,
    GemvConfig,
    _launch,
)
from specpilot.mechanisms.w12_format import W12Tensor

Weight = Tensor | W12Tensor
"""``[N, K]``: bf16 (contiguous, K % 4 == 0) or W12 v3 (decoded in the GEMV, PTX decoder on
the GPU)."""


def _formats(w: Weight) -> tuple[Tensor | None, W12Tensor | None]:
    return (None, w) if isinstance(w, W12Tensor) else (w, None)


def norm_gemv(
    x: Tensor,  # [M, K] bf16, M <= 4: the residual stream before the norm
    norm_weight: Tensor,  # [K] bf16
    eps: float,
    w: Weight,  # [N, K]
    counters: Tensor,  # from gemm_common.counter_buffer(N)
    bias: Tensor | None = None,  # [N] bf16
    cfg: GemvConfig | None = None,
    ptx: bool = True,
) -> Tensor:  # [M, N] bf16
    """``rms_norm(x, norm_weight) @ w.T (+ bias)`` in one launch (``ptx``: W12's PTX decoder)."""
    return _launch(
        x, w.shape[0], *_formats(w), bias, counters, cfg or GemvConfig(), ptx,
        prologue=PROLOGUE_NORM, norm_weight=norm_weight, eps=eps,
    )  # fmt: skip


def silu_gemv(
    gate_up: Tensor,  # [M, 2I] bf16, M <= 4 (gate first)
    w: Weight,  # [N, I], I % 4 == 0
    counters: Tensor,
    residual: Tensor | None = None,  # [M, N] bf16
    cfg: GemvConfig | None = None,
    ptx: bool = True,
) -> Tensor:  # [M, N] bf16
    """``(residual +) silu_mul(gate_up) @ w.T`` in one launch."""
    if gate_up.shape[1] != 2 * w.shape[1]:
        raise ValueError(
            f"gate_up has {gate_up.shape[1]} columns, the weight takes 2 x {w.shape[1]}"
        )
    return _launch(
        gate_up, w.shape[0], *_formats(w), None, counters, cfg or GemvConfig(), ptx,
        prologue=PROLOGUE_SILU, residual=residual,
    )  # fmt: skip


def residual_gemv(
    a: Tensor,  # [M, K] bf16, M <= 4
    w: Weight,  # [N, K]
    counters: Tensor,
    residual: Tensor,  # [M, N] bf16
    cfg: GemvConfig | None = None,
    ptx: bool = True,
) -> Tensor:  # [M, N] bf16
    """``residual + a @ w.T`` with one rounding, in one launch."""
    return _launch(
        a, w.shape[0], *_formats(w), None, counters, cfg or GemvConfig(), ptx,
        prologue=PROLOGUE_NONE, residual=residual,
    )  # fmt: skip


# ---------------------------------------------------------------- the unfused compositions
def norm_linear_ref(
    x: Tensor, norm_weight: Tensor, eps: float, w: Tensor, bias: Tensor | None = None
) -> Tensor:  # [M, K] -> [M, N]
    """What :func:`norm_gemv` replaces: the stock RMSNorm, then ``F.linear``."""
    return F.linear(reference.rms_norm_ref(x, norm_weight, eps), w, bias)


def silu_linear_ref(gate_up: Tensor, w: Tensor, residual: Tensor | None = None) -> Tensor:
    """What :func:`silu_gemv` replaces: the stock SiLU·mul, then ``(residual +) a @ w.T`` with
    ``addmm``'s one rounding."""
    act = reference.silu_mul_ref(gate_up)  # [M, I]
    if residual is None:
        return F.linear(act, w)
    return torch.addmm(residual, act, w.t())


__all__ = ["norm_gemv", "norm_linear_ref", "residual_gemv", "silu_gemv", "silu_linear_ref"]
