"""The escape side of the W12 v3 GEMV (``kernels/w12_gemv.py``): the records of the weights
whose exponent lies outside the 4-bit window, loaded in chunks and applied to the accumulators
after the dense decode (``x·w`` added, ``x·p`` of the placeholder the dense decode produced
subtracted), their activations through the same prologue as the dense loop's."""

from __future__ import annotations

import triton
import triton.language as tl

from specpilot.kernels.gemm_common import _bf16_to_f32
from specpilot.kernels.gemv_prologue import _prologue
from specpilot.mechanisms.w12_format import ESC_ROWS

_ESC_ROWS = tl.constexpr(ESC_ROWS)


@triton.jit
def _escapes(
    e0, e_end, blk0, starts, offs_n, m_rows, M, K, k_lo, k_hi, base, x16_ptr, stride_x16,
    rec_ptr, val_ptr, g16_ptr, inv, up_cols, ROWS: tl.constexpr, ESC_STEP: tl.constexpr,
    PROLOGUE: tl.constexpr,
):  # fmt: skip
    """Load one chunk of this program's escape records starting at ``e0``: the products to add,
    ``x·w`` and ``x·p`` as ``[ROWS, E]`` fp32 with their output columns ``hit [E, BN]``. The
    gathered activations go through the prologue as the dense loop's do (``g16_ptr``: the norm
    weights, ``inv [ROWS]``: 1 / RMS; ``up_cols``: the up half's offset in a gate_up row)."""
    idx = e0 + tl.arange(0, ESC_STEP)  # [E]
    valid = idx < e_end
    rec = tl.load(rec_ptr + idx, mask=valid, other=0)
    val = tl.load(val_ptr + idx, mask=valid, other=0.0)  # [E] bf16: the escaped weights
    blk = blk0 - 1 + tl.sum((idx[:, None] >= starts[None, :]).to(tl.int32), axis=1)  # [E]
    pos = rec >> 8
    r = pos // K
    k_e = pos - r * K
    n_e = blk * _ESC_ROWS + r
    ok = valid & (k_e >= k_lo) & (k_e < k_hi)
    x_mask = (m_rows[:, None] < M) & ok[None, :]
    xe = tl.load(x16_ptr + m_rows[:, None] * stride_x16 + k_e[None, :], mask=x_mask, other=0.0)
    xe = _bf16_to_f32(xe)  # [ROWS, E]
    if PROLOGUE == 1:
        ge = _bf16_to_f32(tl.load(g16_ptr + k_e, mask=ok, other=0.0))  # [E]
        xe = _prologue(xe, ge[None, :], inv[:, None], PROLOGUE)
    elif PROLOGUE == 2:
        up = tl.load(x16_ptr + m_rows[:, None] * stride_x16 + up_cols + k_e[None, :], mask=x_mask, other=0.0)  # fmt: skip
        xe = _prologue(xe, _bf16_to_f32(up), inv[:, None], PROLOGUE)
    v_bits = val.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    w_e = (v_bits << 16).to(tl.float32, bitcast=True)  # [E]
    p_e = (((v_bits & 0x807F) | (base << 7)) << 16).to(tl.float32, bitcast=True)
    hit = (n_e[:, None] == offs_n[None, :]) & ok[:, None]  # [E, BN]
    return xe * w_e[None, :], xe * p_e[None, :], hit


@triton.jit
def _apply_escapes(acc, pw, pp, hit):
    """``acc [ROWS, BN] += Σ_e hit·(x·w) - Σ_e hit·(x·p)``."""
    h = hit[None, :, :]
    acc += tl.sum(tl.where(h, pw[:, :, None], 0.0), axis=1)
    acc -= tl.sum(tl.where(h, pp[:, :, None], 0.0), axis=1)
    return acc
