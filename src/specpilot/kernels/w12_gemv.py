"""W12 v3 GEMV: ``y[M, N] = x[M, K] @ W^T (+ b)`` for M <= 4 rows, FMAs on the CUDA cores.

The launch side: the tiling (:class:`GemvConfig`, checked against the register budget), the
split-K, the argument checks and the fused prologues' inputs, and the public functions
(:func:`w12_gemv`, and :func:`bf16_gemv` reading plain bf16 weights: its fair baseline). The
kernel, how it streams the two W12 planes, adds its escapes, and why its result is exact up to
the order of fp32 additions: ``kernels/w12_gemv_kernel.py``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
from torch import Tensor

from specpilot.kernels import pdl
from specpilot.kernels.gemm_common import (
    MAX_SPLIT_K,
    _num_sms,
    check_tiling,
    k_splits,
)
from specpilot.kernels.w12_gemv_kernel import _gemv_kernel
from specpilot.mechanisms.w12_format import GROUP, W12Tensor

MAX_ROWS = 4
"""Most activation rows one GEMV launch takes (each row costs one FMA per weight)."""
PROLOGUE_NONE, PROLOGUE_NORM, PROLOGUE_SILU = 0, 1, 2
"""What the bf16 GEMV does to ``x`` as it reads it (``kernels/fused_gemv.py``)."""


@dataclass(frozen=True, slots=True)
class GemvConfig:
    """Tiling of one GEMV launch (the same for the bf16 and the W12 kernel)."""

    block_n: int = 16
    """Weight rows per program, a multiple of 16 (the escape blocks)."""
    block_k: int = 1024
    """Columns per K step, a multiple of 64; each thread holds ``block_k / 8 / 32`` words."""
    num_warps: int = 4
    num_stages: int = 1
    split_k: int = 0
    """Number of K splits; 0: enough to give every SM about two programs."""
    pdl: bool = False
    """Launch with programmatic dependent launch (``kernels/pdl.py``: sm_90+, else ignored): the
    first K step's weights stream while the previous kernel drains."""

    def __post_init__(self) -> None:
        check_tiling(self.block_n, self.block_k, GROUP)
        if not fits_registers(self.block_n, self.block_k, self.num_warps):
            raise ValueError(
                f"a {self.block_n} x {self.block_k} GEMV tile with {self.num_warps} warps holds "
                f"{self.block_n * self.block_k // (32 * self.num_warps)} weights per thread "
                f"(at most {MAX_TILE_PER_THREAD}): it would spill to local memory"
            )


MAX_TILE_PER_THREAD = 256
"""Weights of one K step per thread above which the GEMV spills heavily: sm_90 builds (ptxas,
triton 3.6) of 512 per thread (64 x 1024 or 32 x 1024 over 4 warps, 32 x 1024 over 2) keep
4.3-6.1 KB of stack per thread and ran 12x slower than their neighbours on the H200 (issue 26's
fused-gemv 'anomaly', 0.08x AR); 256 per thread keep 0.2-0.6 KB, 128 none."""


def fits_registers(block_n: int, block_k: int, num_warps: int) -> bool:
    """Whether a GEMV tiling stays within ``MAX_TILE_PER_THREAD`` weights per thread."""
    return block_n * block_k <= MAX_TILE_PER_THREAD * 32 * num_warps


ESC_STEP = 16
"""Escape records a program reads per chunk (the first chunk before its K loop)."""


def _split(n: int, k: int, cfg: GemvConfig, device: torch.device) -> tuple[int, int]:
    """``(split, k_split)`` with ``k_split`` a multiple of ``block_k``."""
    tiles = triton.cdiv(n, cfg.block_n)
    return k_splits(k, cfg.block_k, cfg.split_k or max(1, (2 * _num_sms(device)) // tiles))


def _x_words(x: Tensor) -> Tensor:  # [M, K] bf16 -> [M, ceil(K/4) * 4] bf16, int64-viewable
    """``x`` itself when its rows can be read as int64 words, else a zero-padded copy."""
    k = x.shape[1]
    if k % 4 == 0 and x.stride(1) == 1 and x.stride(0) % 4 == 0 and x.data_ptr() % 16 == 0:
        return x
    out = x.new_zeros(x.shape[0], k + (-k) % 4)
    out[:, :k] = x
    return out


def _launch(
    x: Tensor,  # [M, K] bf16
    n: int,
    w_bf16: Tensor | None,  # [N, K] bf16, K % 4 == 0
    w12: W12Tensor | None,
    bias: Tensor | None,
    counters: Tensor,
    cfg: GemvConfig,
    ptx: bool,
    prologue: int = PROLOGUE_NONE,
    norm_weight: Tensor | None = None,  # [K] bf16 (PROLOGUE_NORM)
    eps: float = 0.0,
    residual: Tensor | None = None,  # [M, N] bf16, added before the one rounding
) -> Tensor:  # [M, N] bf16
    """``prologue``: ``PROLOGUE_NORM`` normalises ``x`` in the kernel; ``PROLOGUE_SILU`` reads
    ``x`` as ``gate_up [M, 2K]`` and multiplies by ``silu(gate) * up`` (either weight format)."""
    m, k = x.shape
    if prologue == PROLOGUE_SILU:
        k //= 2
    if x.dtype != torch.bfloat16:
        raise ValueError("x must be bf16")
    if prologue != PROLOGUE_NONE and k % 4:
        raise ValueError("a fused prologue needs K % 4 == 0")
    stride_bm = 0
    if residual is not None:
        if bias is not None or residual.shape != (m, n) or residual.stride(1) != 1:
            raise ValueError("the residual is an [M, N] tensor with unit column stride, no bias")
        bias, stride_bm = residual, residual.stride(0)
    g64 = None
    if prologue == PROLOGUE_NORM:
        if norm_weight is None or norm_weight.shape != (k,) or not norm_weight.is_contiguous():
            raise ValueError("the RMSNorm prologue needs a contiguous [K] norm weight")
        g64 = norm_weight.view(torch.int64)
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"the GEMV takes 1..{MAX_ROWS} rows, got {m}")
    split, k_split = _split(n, k, cfg, x.device)
    grid = (triton.cdiv(n, cfg.block_n), 1, split)
    if split > 1 and grid[0] > counters.numel():
        raise ValueError("counter buffer too small for this split-K launch")
    xw = _x_words(x)
    x64 = xw.view(torch.int64)
    y = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    part = (
        torch.empty(split, m, n, dtype=torch.float32, device=x.device)
        if split > 1
        else counters.view(torch.float32)
    )
    even = n % cfg.block_n == 0 and k % k_split == 0
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    can_pdl = pdl.supported(x.device)
    wait = cfg.pdl and can_pdl
    if w12 is not None:
        if w12.layout != "v3":
            raise ValueError("the W12 GEMV reads layout v3")
        sm32 = w12.sm.view(torch.int32)  # [N, Kp / 4]
        codes32 = w12.codes.view(torch.int32)  # [N, Kp / 8]
        recs, vals = w12.esc_records, w12.esc_values
        if recs.numel() == 0:  # never read (every CSR range is empty) but valid pointers
            recs, vals = w12.esc_offsets, x
        w_arg, row_words, base = sm32, int(sm32.shape[1]), w12.base
        offs = w12.esc_offsets
    else:
        assert w_bf16 is not None
        if k % 4 or not w_bf16.is_contiguous():
            raise ValueError("the bf16 GEMV needs a contiguous [N, K] weight with K % 4 == 0")
        w_arg = w_bf16.view(torch.int64)
        sm32, codes32, offs, recs, vals = x64, x64, counters, counters, x
        row_words, base = k // 4, 0
    _gemv_kernel[grid](
        x64, xw, w_arg, sm32, codes32, offs, recs, vals,
        bias if bias is not None else x, g64 if g64 is not None else x64,
        norm_weight if norm_weight is not None else x, y, part, counters,
        m, n, k, x64.stride(0), y.stride(0), stride_bm, k // 4, eps, row_words, base, k_split,
        split, W12=w12 is not None, PTX=ptx and not interpret, HAS_BIAS=bias is not None,
        PROLOGUE=prologue, EVEN=even,
        ROWS=triton.next_power_of_2(m), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        ESC_STEP=ESC_STEP, MAX_SPLIT=MAX_SPLIT_K, INTERPRET=interpret,
        PDL_TRIGGER=can_pdl, PDL_WAIT=wait, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({"launch_pdl": True} if wait else {}),
    )  # fmt: skip
    return y


def w12_gemv(
    x: Tensor,  # [M, K] bf16, M <= 4
    w: W12Tensor,  # [N, K], layout v3
    counters: Tensor,  # from gemm_common.counter_buffer(N)
    bias: Tensor | None = None,  # [N] bf16
    cfg: GemvConfig | None = None,
    ptx: bool = True,
) -> Tensor:  # [M, N] bf16
    """``x @ decode(w)^T (+ bias)`` on the CUDA cores (``ptx``: the inline-PTX decoder)."""
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has K = {x.shape[-1]}, the weight has K = {k}")
    return _launch(x, n, None, w, bias, counters, cfg or GemvConfig(), ptx)


def bf16_gemv(
    x: Tensor,  # [M, K] bf16, M <= 4
    w: Tensor,  # [N, K] bf16 contiguous, K % 4 == 0
    counters: Tensor,
    bias: Tensor | None = None,
    cfg: GemvConfig | None = None,
) -> Tensor:  # [M, N] bf16
    """The same GEMV reading plain bf16 weights: its fair baseline."""
    n = w.shape[0]
    return _launch(x, n, w, None, bias, counters, cfg or GemvConfig(), False)


__all__ = [
    "MAX_ROWS",
    "PROLOGUE_NONE",
    "PROLOGUE_NORM",
    "PROLOGUE_SILU",
    "GemvConfig",
    "bf16_gemv",
    "w12_gemv",
]
