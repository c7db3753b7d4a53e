"""An FP8 (e4m3) copy of a target's weights: the cheap model of the FP8 pre-filter.

Format: ``torch.float8_e4m3fn`` codes with one fp32 scale per output channel (row of ``W [N, K]``):
``scale[n] = max_k |W[n, k]| / 448`` (1 for an all-zero row, whose codes are then all zero) and
``q = fp8(W / scale)``. e4m3 keeps 3 mantissa bits, so a normal code is within 2^-4 of its value
relatively and a subnormal one (``|W / scale| < 2^-6``) within ``2^-10 · scale`` absolutely:
``|W - q·scale| ≤ max(2^-4 |W|, 2^-10 scale)`` element-wise (the bound the tests check). Half the
bytes of bf16 plus 4 bytes per row.

Two ways to compute ``x @ Wᵀ``; :func:`use_scaled_mm` is the one place that chooses:

* **FP8 GEMM** — CUDA with compute capability ≥ 8.9 (FP8 tensor cores), bf16 input, N and K
  multiples of 16: the activations are quantized as well (one dynamic scale per row, ``[M, 1]``),
  M is padded to a multiple of 16, and ``torch._scaled_mm`` multiplies FP8 by FP8 with row-wise
  scales into bf16, at twice the bf16 tensor-core rate. That is what makes the cheap forward cheap
  where a large verify batch is compute-bound.
* **dequantized** — everywhere else (the CPU, older GPUs, odd shapes): the weights are
  dequantized to the input's dtype and multiplied with ``F.linear``: the same weight rounding,
  emulated, with no saving. The tests run this path.

The two paths round differently (the GEMM path also rounds the activations). Neither decides a
committed token: the cheap model only tells the pre-filter where to cut a block.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from specpilot.mechanisms.weight_copy import (
    CopiedArgmaxHead,
    QuantWeight,
    channel_scales,
    copy_model,
    dequantize,
)
from specpilot.models.transformer import Transformer

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
"""Largest finite e4m3fn value; codes are clamped to it (a larger value would convert to NaN)."""
_MIN_ACT_SCALE = 1e-12  # an all-zero activation row (M padding) keeps a finite scale


Fp8Weight = QuantWeight
"""float8_e4m3fn codes with per-channel scales."""


def quantize(w: Tensor) -> Fp8Weight:
    """Per-output-channel FP8 e4m3 of a 2-D weight ``[N, K]`` (any float dtype)."""
    wf, scale = channel_scales(w, FP8_MAX, "FP8")  # [N, K], [N]
    q = (wf / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)  # [N, K]
    return QuantWeight(q=q.contiguous(), scale=scale.contiguous())


def scaled_mm_supported(device: torch.device) -> bool:
    """Whether ``device`` runs ``torch._scaled_mm`` with row-wise scales (FP8 tensor cores)."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def use_scaled_mm(x: Tensor, w: Fp8Weight, supported: bool) -> bool:
    """The FP8 GEMM (True) or the dequantized product (False) for ``x [M, K] @ Wᵀ``."""
    n, k = w.shape
    return supported and x.is_cuda and x.dtype == torch.bfloat16 and n % 16 == 0 and k % 16 == 0


def _scaled_mm(x: Tensor, w: Fp8Weight) -> Tensor:  # x [M, K] bf16 -> [M, N] bf16
    m = x.shape[0]
    pad = -m % 16
    xf = F.pad(x, (0, 0, 0, pad)).float()  # [Mp, K]
    xs = (xf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_(min=_MIN_ACT_SCALE)  # [Mp, 1]
    xq = (xf / xs).clamp_(-FP8_MAX, FP8_MAX).to(FP8)  # [Mp, K] row-major
    y = torch._scaled_mm(
        xq, w.q.t(), scale_a=xs, scale_b=w.scale.view(1, -1), out_dtype=torch.bfloat16
    )  # [Mp, N]; w.q.t() is the column-major [K, N] operand the FP8 GEMM wants
    return y[:m]


class Fp8Linear:
    """``fn(x [.., K], bias [N] | None) -> [.., N]`` from an FP8 copy of ``weight``."""

    def __init__(self, weight: Tensor, scaled_mm: bool = False) -> None:
        self.fp8 = quantize(weight)
        self.scaled_mm = scaled_mm
        """The device runs the FP8 GEMM (``scaled_mm_supported``); shapes decide per call."""

    def copy_nbytes(self) -> int:
        return self.fp8.nbytes()

    def __call__(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        n, k = self.fp8.shape
        x2 = x.reshape(-1, k)  # [M, K]
        if x2.shape[0] > 0 and use_scaled_mm(x2, self.fp8, self.scaled_mm):
            y = _scaled_mm(x2.contiguous(), self.fp8)  # [M, N]
            if bias is not None:
                y = y + bias
        else:
            y = F.linear(x2, dequantize(self.fp8, x.dtype), bias)  # [M, N]
        return y.view(*x.shape[:-1], n)


class Fp8ArgmaxHead(CopiedArgmaxHead):
    """``x [B, R, hidden] -> [B, R]`` greedy tokens of the FP8 LM head (lowest id on ties)."""

    def __init__(self, lm_head: Tensor, scaled_mm: bool = False) -> None:
        super().__init__(Fp8Linear(lm_head, scaled_mm))


def fp8_model(
    target: Transformer, lm_head: bool = True, scaled_mm: bool | None = None
) -> Transformer:
    """A model sharing ``target``'s tensors whose linear layers (and LM head) read FP8 copies;
    ``scaled_mm=None`` uses the FP8 GEMM wherever the device has it."""
    supported = scaled_mm_supported(target.device) if scaled_mm is None else scaled_mm
    return copy_model(
        target,
        lambda w: Fp8Linear(w, supported),
        (lambda w: Fp8ArgmaxHead(w, supported)) if lm_head else None,
    )


__all__ = [
    "FP8",
    "FP8_MAX",
    "Fp8ArgmaxHead",
    "Fp8Linear",
    "Fp8Weight",
    "dequantize",
    "fp8_model",
    "quantize",
    "scaled_mm_supported",
    "use_scaled_mm",
]
