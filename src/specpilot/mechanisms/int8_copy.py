"""An INT8 copy of a target's weights: the cheap model of two-level verification.

Format: weight-only, symmetric, one fp32 scale per output channel (row of ``W [N, K]``):
``scale[n] = max_k |W[n, k]| / 127`` and ``q[n, k] = round(W[n, k] / scale[n])`` in [-127, 127],
so ``|W - q·scale| ≤ scale / 2`` element-wise (the round-trip bound the tests check). Half the
bytes of bf16 plus 4 bytes per row.

:func:`cheap_model` builds a second :class:`Transformer` that *shares* every tensor of the target
(embeddings, norms, biases, RoPE tables: nothing copied) and computes every decoder linear layer
from the INT8 copy (``DecoderLayer.linear_fns``) and its greedy token from an INT8 LM head
(``Transformer.argmax_head``). It is a different, approximate model: it never decides a committed
token, it only proposes. Rows beyond ``max_m`` per call (prefill) use the target's own weights, so
the cheap model's KV of a prompt is computed exactly; that can only raise its agreement.

Why not INT6: 6-bit codes read 0.75× the bytes of INT8 (the cheap level would fall from ~0.5 to
~0.4 of an exact verify), but they do not sit on byte boundaries, so the kernel must unpack them
with shifts and masks; the W12 measurement (docs/MECHANISMS.md) shows this GPU's small-M GEMMs
turning ALU-bound under exactly that kind of in-register decode (0.40–0.53× the bf16 kernel), and
the per-channel error is 4× larger (lower agreement). Not built until INT8 shows the cheap level
paying at all.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from specpilot.kernels import triton_usable
from specpilot.mechanisms.weight_copy import (
    CopiedArgmaxHead,
    QuantWeight,
    channel_scales,
    copy_model,
    dequantize,
)
from specpilot.models.transformer import Transformer

QMAX = 127


Int8Weight = QuantWeight
"""Symmetric INT8 codes in [-127, 127] with per-channel scales."""


def quantize(w: Tensor) -> Int8Weight:
    """Per-output-channel symmetric INT8 of a 2-D weight ``[N, K]`` (any float dtype)."""
    wf, scale = channel_scales(w, QMAX, "INT8")  # [N, K], [N]
    q = torch.round(wf / scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)  # [N, K]
    return QuantWeight(q=q.contiguous(), scale=scale.contiguous())


class Int8Linear:
    """``fn(x [.., K], bias [N] | None) -> [.., N]`` from an INT8 copy of ``weight``.

    bf16 inputs of at most ``max_m`` rows run the Triton kernel (when ``use_triton``); other
    inputs of at most ``max_m`` rows the torch reference; more rows (prefill) ``F.linear`` on the
    original ``weight``.
    """

    def __init__(self, weight: Tensor, max_m: int = 64, use_triton: bool | None = None) -> None:
        from specpilot.kernels.int8_gemm import counter_buffer

        self.weight = weight  # [N, K]: the target's parameter, used for M > max_m
        self.int8 = quantize(weight)
        self.max_m = max_m
        self.use_triton = triton_usable(weight.device) if use_triton is None else use_triton
        self.counters = counter_buffer(weight.shape[0], weight.device)  # [tiles] int32

    def copy_nbytes(self) -> int:
        return self.int8.nbytes()

    def __call__(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        from specpilot.kernels.int8_gemm import int8_matmul, int8_matmul_reference

        n, k = self.int8.shape
        x2 = x.reshape(-1, k)  # [M, K]
        m = x2.shape[0]
        if m == 0 or m > self.max_m:
            return F.linear(x, self.weight, bias)
        if self.use_triton and x.dtype == torch.bfloat16:
            if x2.stride(1) != 1:
                x2 = x2.contiguous()
            y = int8_matmul(x2, self.int8.q, self.int8.scale, self.counters, bias)  # [M, N]
        else:
            y = int8_matmul_reference(x2, self.int8.q, self.int8.scale, bias)  # [M, N]
        return y.view(*x.shape[:-1], n)


class Int8ArgmaxHead(CopiedArgmaxHead):
    """``x [B, R, hidden] -> [B, R]`` greedy tokens of the INT8 LM head (lowest id on ties)."""

    def __init__(self, lm_head: Tensor, max_m: int = 64, use_triton: bool | None = None) -> None:
        super().__init__(Int8Linear(lm_head, max_m, use_triton))


def cheap_model(
    target: Transformer,
    max_m: int = 64,
    lm_head: bool = True,
    use_triton: bool | None = None,
) -> Transformer:
    """A model sharing ``target``'s tensors whose linear layers (and LM head) read INT8 copies."""
    return copy_model(
        target,
        lambda w: Int8Linear(w, max_m, use_triton),
        (lambda w: Int8ArgmaxHead(w, max_m, use_triton)) if lm_head else None,
    )


__all__ = [
    "Int8ArgmaxHead",
    "Int8Linear",
    "Int8Weight",
    "cheap_model",
    "dequantize",
    "quantize",
]
