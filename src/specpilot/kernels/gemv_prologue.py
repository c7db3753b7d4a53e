"""The activation side of the decode GEMV (``kernels/w12_gemv.py``): splitting ``x`` words, and
the prologues that ``kernels/fused_gemv.py`` switches on (RMSNorm, SiLU·mul), with the same
rounding steps as the unfused kernels (``_round_bf16``: round to nearest even, by integer ops so
that the interpreter, whose bf16 cast is not RNE, computes the GPU's bits)."""

from __future__ import annotations

import triton
import triton.language as tl

from specpilot.kernels.gemm_common import _bf16_to_f32


@triton.jit
def _split_words(w):
    """int64 words of 4 bf16 -> the 4 values as fp32 (exact: bf16 bits in the high half)."""
    lo = w.to(tl.int32)
    hi = (w >> 32).to(tl.int32)
    return (
        (lo << 16).to(tl.float32, bitcast=True),
        (lo & -65536).to(tl.float32, bitcast=True),
        (hi << 16).to(tl.float32, bitcast=True),
        (hi & -65536).to(tl.float32, bitcast=True),
    )


@triton.jit
def _round_bf16(v):
    """fp32 -> the nearest bf16 (ties to even), kept in fp32: what ``.to(bf16)`` and back does,
    by integer ops (the same bits on the GPU and in the interpreter, whose cast is not RNE)."""
    b = v.to(tl.int32, bitcast=True)
    r = ((b + 0x7FFF + ((b >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    return tl.where(v != v, v, r)


@triton.jit
def _prologue(x, aux, inv_rms, PROLOGUE: tl.constexpr):
    """Activations (fp32 holding bf16 values, any shape) after the prologue, rounded as the
    unfused kernel rounds. ``PROLOGUE`` 1 (RMSNorm): ``bf16(g · bf16(x · inv_rms))``, ``aux`` the
    norm weights; 2 (SiLU·mul): ``bf16(bf16(silu(x)) · u)``, ``x`` the gate, ``aux`` the up half."""
    if PROLOGUE == 1:
        y = _round_bf16(aux * _round_bf16(x * inv_rms))
    else:
        y = _round_bf16(_round_bf16(x / (1.0 + tl.exp(-x))) * aux)
    return y


@triton.jit
def _prologue4(x0, x1, x2, x3, aux, inv_rms, PROLOGUE: tl.constexpr):
    """:func:`_prologue` of the 4 activations of one word, ``aux`` a word of 4 bf16."""
    a0, a1, a2, a3 = _split_words(aux)
    return (
        _prologue(x0, a0, inv_rms, PROLOGUE),
        _prologue(x1, a1, inv_rms, PROLOGUE),
        _prologue(x2, a2, inv_rms, PROLOGUE),
        _prologue(x3, a3, inv_rms, PROLOGUE),
    )


@triton.jit
def _inv_rms(x16_ptr, stride_x16, m_rows, M, K, eps, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """``[ROWS]`` fp32 ``rsqrt(mean(x²) + eps)`` of each row of ``x [M, K]`` bf16, as
    ``decode_triton.rms_norm`` computes it (fp32 squares summed in ``BLOCK``-wide chunks)."""
    ss = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
    cols = tl.arange(0, BLOCK)
    for c0 in range(0, K, BLOCK):
        ok = (m_rows[:, None] < M) & (c0 + cols < K)[None, :]
        x = tl.load(x16_ptr + m_rows[:, None] * stride_x16 + c0 + cols[None, :], mask=ok, other=0.0)
        xf = _bf16_to_f32(x)
        ss += xf * xf
    return tl.rsqrt(tl.sum(ss, axis=1) / K + eps)


@triton.jit
def _row_step(
    acc, w0, w1, w2, w3, w4, w5, w6, w7, x_row, lo, hi, xa_ok, xb_ok, ga, gb, up_words,
    inv_rms, PROLOGUE: tl.constexpr,
):  # fmt: skip
    """One activation row's share of a K step: load its 8 words (``x_row``: int64 pointer at
    this step), apply the prologue (``ga``, ``gb``: the norm weights' words; ``up_words``: where
    the up half starts in a gate_up row) and ``acc [BN, W] += Σ_i w_i * x_i``."""
    x0, x1, x2, x3 = _split_words(tl.load(x_row + lo, mask=xa_ok, other=0))
    x4, x5, x6, x7 = _split_words(tl.load(x_row + hi, mask=xb_ok, other=0))
    if PROLOGUE == 1:
        x0, x1, x2, x3 = _prologue4(x0, x1, x2, x3, ga, inv_rms, PROLOGUE)
        x4, x5, x6, x7 = _prologue4(x4, x5, x6, x7, gb, inv_rms, PROLOGUE)
    elif PROLOGUE == 2:
        ua = tl.load(x_row + up_words + lo, mask=xa_ok, other=0)
        ub = tl.load(x_row + up_words + hi, mask=xb_ok, other=0)
        x0, x1, x2, x3 = _prologue4(x0, x1, x2, x3, ua, inv_rms, PROLOGUE)
        x4, x5, x6, x7 = _prologue4(x4, x5, x6, x7, ub, inv_rms, PROLOGUE)
    acc += w0 * x0[None, :]
    acc += w1 * x1[None, :]
    acc += w2 * x2[None, :]
    acc += w3 * x3[None, :]
    acc += w4 * x4[None, :]
    acc += w5 * x5[None, :]
    acc += w6 * x6[None, :]
    acc += w7 * x7[None, :]
    return acc
