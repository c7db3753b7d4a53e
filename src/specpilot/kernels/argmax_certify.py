"""The two device passes of the graph-safe exact-argmax certificate (``mechanisms/exact_argmax_graph.py``).

* :func:`int8_block_bounds` — the cheap pass as one INT8 GEMV/GEMM over the head
  (``kernels/int8_gemm.py`` with fp32 output: exact bf16 × int8 products, fp32 accumulation,
  split-K partials summed in fp32, one fp32 multiply by the per-row scale), then the per-element
  bound and the block maxima (``argmax_bound.bounds_from_sums``, torch ops over ``[R, V]``).
  Same contract as ``argmax_bound.block_bounds_ref``, which stays the ground truth.
* :func:`refine_logits` — ``x · w_v`` in float64 for ``C`` whole vocabulary blocks per row, the
  blocks given as a device tensor (fixed shapes). The Triton kernel reads each block's stock rows
  once (one program per row, block and slice of ``SUB`` vocabulary rows; products exact in
  float64, float64 sums); the torch reference gathers the rows and runs a float64 ``bmm``.

Both run under ``TRITON_INTERPRET=1`` on the CPU at small shapes.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from specpilot.kernels.argmax_bound import bounds_from_sums
from specpilot.kernels.cheap_head import CheapHead, RowTerms

SUB = 16
"""Vocabulary rows per refine program (a block of 64 is four programs)."""


def int8_block_bounds(
    head: CheapHead, terms: RowTerms, kc: float, counters: Tensor
) -> tuple[Tensor, Tensor]:
    """``(upper [R, nb], lower [R, nb])`` from the INT8 GEMM; ``counters``: its split-K buffer."""
    from specpilot.kernels.int8_gemm import int8_matmul

    if head.fmt != "int8":
        raise ValueError("the INT8 GEMM bound pass takes int8 heads")
    scaled = int8_matmul(
        terms.xq, head.weight, head.scale, counters, out_dtype=torch.float32
    )  # [R, V] fp32: fl(Σ x̂·q) · scale
    return bounds_from_sums(head, terms, kc, scaled)


def refine_logits_ref(
    x: Tensor,  # [R, H] final-normed hidden rows (the stock head's input)
    lm_head: Tensor,  # [V, H] stock weights
    blocks: Tensor,  # [R, C] int64 block indices
    block: int,
) -> Tensor:  # [R, C * block] float64; rows past the vocabulary are 0
    """Torch reference of :func:`refine_logits`."""
    r, c = blocks.shape
    v = lm_head.shape[0]
    ids = (blocks[:, :, None] * block + torch.arange(block, device=x.device)).flatten(1)
    rows = lm_head.index_select(0, ids.clamp(max=v - 1).flatten()).view(r, c * block, -1)
    s_hat = torch.bmm(rows.double(), x.double()[:, :, None]).squeeze(2)  # [R, C·block]
    return torch.where(ids < v, s_hat, torch.zeros_like(s_hat))


@functools.cache
def _refine_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def refine_kernel(
        x_ptr,  # [R, H]
        w_ptr,  # [V, H]
        blk_ptr,  # [R, >= C] int64, row stride stride_b
        out_ptr,  # [R, C * BLOCK] float64
        V,
        C,
        stride_b,
        stride_x,
        stride_w,
        H: tl.constexpr,  # constexpr: loops over it (and the interpreter needs a plain int)
        BLOCK: tl.constexpr,
        SUB_ROWS: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        r = tl.program_id(0)
        j = tl.program_id(1)
        part = tl.program_id(2)
        blk = tl.load(blk_ptr + r * stride_b + j)
        offs = part * SUB_ROWS + tl.arange(0, SUB_ROWS)  # [SUB] rows within the block
        rows = blk * BLOCK + offs
        rmask = rows < V
        acc = tl.zeros((SUB_ROWS, BLOCK_K), dtype=tl.float64)
        for k0 in range(0, H, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            kmask = ks < H
            x = tl.load(x_ptr + r * stride_x + ks, mask=kmask, other=0.0).to(tl.float64)
            w = tl.load(
                w_ptr + rows[:, None] * stride_w + ks[None, :],
                mask=rmask[:, None] & kmask[None, :],
                other=0.0,
            ).to(tl.float64)
            acc += w * x[None, :]  # exact products (≤ 24 + 24 significant bits)
        s = tl.sum(acc, axis=1)
        tl.store(out_ptr + (r * C + j) * BLOCK + offs, tl.where(rmask, s, 0.0))

    return refine_kernel


def refine_logits(
    x: Tensor,  # [R, H]
    lm_head: Tensor,  # [V, H]
    blocks: Tensor,  # [R, C] int64
    block: int,
) -> Tensor:  # [R, C * block] float64
    """``x[r] · lm_head[v]`` in float64 for every v of the blocks ``blocks[r]`` (0 past the
    vocabulary): the Triton kernel (each stock row read once, no float64 copy of the rows)."""
    r, c = blocks.shape
    v, h = lm_head.shape
    if block % SUB or x.stride(1) != 1 or lm_head.stride(1) != 1 or blocks.stride(1) != 1:
        raise ValueError(f"refine: want unit-stride rows and a block that is a multiple of {SUB}")
    out = torch.empty(r, c * block, dtype=torch.float64, device=x.device)
    grid = (r, c, block // SUB)
    _refine_kernel()[grid](
        x, lm_head, blocks, out, v, c, blocks.stride(0), x.stride(0), lm_head.stride(0),
        H=h, BLOCK=block, SUB_ROWS=SUB, BLOCK_K=min(128, max(16, 1 << (h - 1).bit_length())),
        num_warps=4,
    )  # fmt: skip
    return out


__all__ = ["SUB", "int8_block_bounds", "refine_logits", "refine_logits_ref"]
