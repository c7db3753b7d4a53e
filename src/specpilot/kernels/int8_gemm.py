"""``y[M, N] = (x[M, K] @ q^T) * scale (+ b)`` for small M, reading an INT8 weight copy.

The cheap level of two-level verification (``mechanisms/two_level.py``) reads the target's linear
weights as per-output-channel symmetric INT8 (``mechanisms/int8_copy.py``): half the bytes of
bf16. This kernel streams the int8 codes and dequantizes in registers.

Per program: a ``[BLOCK_M, BLOCK_N]`` output tile over one K range of ``k_split`` columns. The
dense loop loads ``x [BLOCK_M, BLOCK_K]`` (bf16) and ``q [BLOCK_N, BLOCK_K]`` (int8), converts the
codes to bf16 (every integer in [-127, 127] is exact in bf16) and accumulates in fp32 with
``tl.dot`` (M padded to 16), or, for one row (``USE_DOT=False``), with FMAs into a
``[BLOCK_N, BLOCK_K]`` fp32 accumulator reduced once after the loop. The per-channel scale is
applied once per output column after the loop (it factors out of the sum). Split-K, when there
are too few output tiles to fill the GPU, follows ``w12_gemm``: fp32 partials, an ``acq_rel``
arrival counter per tile, the last split sums the partials in split order (deterministic), scales,
adds the bias and rounds to bf16 once.

Result: ``Σ_k x[m,k]·q[n,k]`` in fp32 (products exact: bf16 × small integer), times ``scale[n]``,
plus the bias, rounded to bf16 (or kept in fp32: ``out_dtype``); the torch reference (``int8_matmul_reference``) computes the same
quantities in another order, so the two differ by fp32 addition order and one bf16 rounding.
Runs under ``TRITON_INTERPRET=1`` on the CPU (the same interpreter workarounds as ``w12_gemm``).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from specpilot.kernels.gemm_common import (
    MAX_SPLIT_K,
    GemmConfig,
    _block_m,
    _dense_step,
    _split,
    _store_tile,
    _tile,
    counter_buffer,
    default_config,
    outputs,
)


@triton.jit(do_not_specialize=["M", "split"])
def _int8_kernel(
    x_ptr,  # [M, K] bf16, row stride stride_xm
    q_ptr,  # [N, K] int8
    scale_ptr,  # [N] fp32
    bias_ptr,  # [N] bf16 (HAS_BIAS)
    y_ptr,  # [M, N] bf16 or fp32, row stride stride_ym
    part_ptr,  # [split, M, N] fp32 (split > 1)
    count_ptr,  # [tiles] int32, zero between calls (split > 1)
    M,
    N,
    K,
    stride_xm,
    stride_ym,
    k_split,
    split,
    HAS_BIAS: tl.constexpr,
    USE_DOT: tl.constexpr,
    EVEN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MAX_SPLIT: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    pid_m, pid_n, pid_k, offs_m, offs_n, m_ok, n_ok, k_lo, k_hi = _tile(
        M, N, K, k_split, BLOCK_M, BLOCK_N
    )
    if USE_DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    if INTERPRET:  # the interpreter cannot take a runtime range() bound (numpy >= 2)
        k0 = k_lo
        while k0 < k_hi:
            acc = _dense_step(
                acc, k0, k_hi, offs_m, offs_n, m_ok, n_ok, x_ptr, stride_xm, q_ptr, K,
                USE_DOT, EVEN, BLOCK_K, INTERPRET,
            )  # fmt: skip
            k0 += BLOCK_K
    else:
        for k0 in range(k_lo, k_hi, BLOCK_K):
            acc = _dense_step(
                acc, k0, k_hi, offs_m, offs_n, m_ok, n_ok, x_ptr, stride_xm, q_ptr, K,
                USE_DOT, EVEN, BLOCK_K, INTERPRET,
            )  # fmt: skip
    if not USE_DOT:
        acc = tl.reshape(tl.sum(acc, axis=1), (BLOCK_M, BLOCK_N))

    _store_tile(
        acc, scale_ptr, y_ptr, bias_ptr, part_ptr, count_ptr, offs_m, offs_n, m_ok, n_ok,
        stride_ym, 0, M, N, pid_m, pid_n, pid_k, split, True, HAS_BIAS, MAX_SPLIT, INTERPRET,
    )  # fmt: skip


def int8_matmul(
    x: Tensor,  # [M, K] bf16, unit stride along K
    q: Tensor,  # [N, K] int8 contiguous
    scale: Tensor,  # [N] fp32
    counters: Tensor,  # from counter_buffer(N)
    bias: Tensor | None = None,  # [N] bf16
    cfg: GemmConfig | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> Tensor:  # [M, N] out_dtype
    """``(x @ q^T) * scale (+ bias)`` with the int8 codes dequantized in registers.

    ``out_dtype=torch.float32`` keeps the scaled fp32 sums unrounded (the certified exact-argmax
    head's cheap logits: exact products, fp32 accumulation, split-K partials summed in fp32, one
    fp32 multiply by the scale)."""
    m, k = x.shape
    n = q.shape[0]
    if x.dtype != torch.bfloat16 or x.stride(1) != 1:
        raise ValueError("x must be bf16 with unit stride along K")
    if q.dtype != torch.int8 or not q.is_contiguous() or q.shape[1] != k:
        raise ValueError(f"q must be a contiguous int8 [N, {k}] matrix")
    if scale.dtype != torch.float32 or scale.shape != (n,):
        raise ValueError(f"scale must be fp32 [{n}]")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"out_dtype must be bf16 or fp32, got {out_dtype}")
    cfg = cfg or default_config(m, n, k)
    if not cfg.use_dot and m != 1:
        raise ValueError("the FMA GEMV config (use_dot=False) takes one row")
    bm = _block_m(m, cfg)
    split, k_split = _split(m, n, k, cfg, x.device)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, bm), split)
    y, part = outputs(m, n, grid, counters, x.device, out_dtype)  # [M, N], [split, M, N]
    _int8_kernel[grid](
        x, q, scale, bias if bias is not None else x, y, part, counters,
        m, n, k, x.stride(0), y.stride(0), k_split, split,
        HAS_BIAS=bias is not None, USE_DOT=cfg.use_dot,
        EVEN=n % cfg.block_n == 0 and k % k_split == 0,
        BLOCK_M=bm, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, MAX_SPLIT=MAX_SPLIT_K,
        INTERPRET=os.environ.get("TRITON_INTERPRET") == "1",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return y


def int8_matmul_reference(
    x: Tensor,  # [M, K]
    q: Tensor,  # [N, K] int8
    scale: Tensor,  # [N] fp32
    bias: Tensor | None = None,  # [N]
    out_dtype: torch.dtype | None = None,
) -> Tensor:  # [M, N] in out_dtype (default: x's dtype)
    """Torch reference: fp32 ``(x @ q^T) * scale + bias``, cast to ``out_dtype``."""
    y = (x.float() @ q.float().T) * scale
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype)


__all__ = ["counter_buffer", "int8_matmul", "int8_matmul_reference"]
