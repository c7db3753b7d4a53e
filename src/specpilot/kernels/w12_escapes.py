"""The escape side of the W12 kernels: the records of the weights whose exponent lies outside the
4-bit window, applied to the accumulators after the dense decode (``x·w`` added, ``x·p`` of the
placeholder the dense decode produced subtracted). ``_escapes``/``_apply_escapes``: the v3 GEMV's
(``kernels/w12_gemv.py``), the activations through the same prologue as its dense loop's;
``escape_dots``: ``w12_gemm``'s, as two small exact dots; ``list_chunk``/``apply_list``: the
tensor-core kernel's (``w12_mma``), from fixed-address per-tile lists, as two wgmma dots."""

from __future__ import annotations

import triton
import triton.language as tl

from specpilot.kernels.gemm_common import _bf16_to_f32, _bits_to_f32, _x_operand
from specpilot.kernels.gemv_prologue import _prologue
from specpilot.kernels.w12_decode import _bits_to_operand
from specpilot.mechanisms.w12_format import ESC_ROWS

_ESC_ROWS = tl.constexpr(ESC_ROWS)


@triton.jit
def _records(e0, e_end, blk0, starts, K, k_lo, k_hi, rec_ptr, val_ptr, ESC_STEP: tl.constexpr):
    """Records ``e0 .. e0 + E`` of a CSR range over consecutive 16-row blocks from ``blk0``
    (``starts [NB]``: each block's first record, past-the-end blocks a huge value): the escaped
    weights ``[E]`` bf16, their rows and columns, and which lie in ``[k_lo, k_hi)``."""
    idx = e0 + tl.arange(0, ESC_STEP)  # [E]
    valid = idx < e_end
    rec = tl.load(rec_ptr + idx, mask=valid, other=0)
    val = tl.load(val_ptr + idx, mask=valid, other=0.0)  # [E] bf16: the escaped weights
    blk = blk0 - 1 + tl.sum((idx[:, None] >= starts[None, :]).to(tl.int32), axis=1)  # [E]
    pos = rec >> 8
    r = pos // K
    k_e = pos - r * K
    ok = valid & (k_e >= k_lo) & (k_e < k_hi)
    return val, blk * _ESC_ROWS + r, k_e, ok


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
    val, n_e, k_e, ok = _records(e0, e_end, blk0, starts, K, k_lo, k_hi, rec_ptr, val_ptr, ESC_STEP)
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


@triton.jit
def escape_dots(
    acc, pid_n, offs_m, offs_n, m_ok, N, K, k_lo, k_hi, base, x_ptr, stride_xm, off_ptr, rec_ptr,
    val_ptr, sm_ptr, stride_sm, V3: tl.constexpr, USE_DOT: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, ESC_BLOCK_ROWS: tl.constexpr, ESC_STEP: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    """The escape side of the tiled kernels (``w12_gemm``, ``w12_mma``), once per program after
    the dense loop: ``acc [BM, BN]`` gains ``x·w`` and loses ``x·p`` for each escaped weight ``w``
    of this tile's rows with column in ``[k_lo, k_hi)`` (``p``: the placeholder the dense decode
    produced, exponent ``base``). For each 16-row escape block, its CSR range of records is read
    ``ESC_STEP`` at a time; the escaped weights and the negated placeholders go into ``[E, BN]``
    bf16 tiles (zero except at ``(e, n_e)``) that two ``tl.dot`` multiply by the gathered
    activations ``x[:, k_e]``, so each product is exact and enters the fp32 accumulator once
    (one row, ``USE_DOT=False``: FMAs of the exact fp32 difference). ``V3``: the records' weights
    come from ``val_ptr``; else (v2) from the ``sm`` byte and the record's exponent."""
    n_blocks = (N + ESC_BLOCK_ROWS - 1) // ESC_BLOCK_ROWS
    for r in tl.static_range(BLOCK_N // ESC_BLOCK_ROWS):
        blk = pid_n * (BLOCK_N // ESC_BLOCK_ROWS) + r
        start = tl.load(off_ptr + blk, mask=blk < n_blocks, other=0)
        end = tl.load(off_ptr + blk + 1, mask=blk < n_blocks, other=0)
        e0 = start
        while e0 < end:  # usually 0-2 steps; a while loop also runs in the interpreter
            idx = e0 + tl.arange(0, ESC_STEP)  # [E]
            e0 += ESC_STEP
            rec = tl.load(rec_ptr + idx, mask=idx < end, other=0)
            pos = rec >> 8
            n_e = blk * ESC_BLOCK_ROWS + pos // K  # [E]
            k_e = pos % K
            e_ok = (idx < end) & (k_e >= k_lo) & (k_e < k_hi)
            if V3:  # the escaped weights themselves
                val = tl.load(val_ptr + idx, mask=e_ok, other=0.0)
                w_bits = val.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF  # [E]
                sm_bits = w_bits & 0x807F
            else:
                sme = tl.load(sm_ptr + n_e * stride_sm + k_e, mask=e_ok, other=0)
                sm_bits = sme.to(tl.int8, bitcast=True).to(tl.int32) & 0x807F  # [E]
                w_bits = sm_bits | ((rec & 0xFF) << 7)  # [E] the escaped weights
            hit = (n_e[:, None] == offs_n[None, :]) & e_ok[:, None]  # [E, BN]
            x_mask = m_ok[:, None] & e_ok[None, :]
            xg = tl.load(
                x_ptr + offs_m[:, None] * stride_xm + k_e[None, :], mask=x_mask, other=0.0
            )  # [BM, E]
            p_bits = sm_bits | (base << 7)  # the placeholder the dense loop used
            # The placeholders' products leave the accumulator before the escaped ones enter:
            # an escape far below its placeholder (|w| < 2^-24 |p|) would otherwise be absorbed
            # by x·p still in acc (weight 9.98e-31 read back as 0.0 through a one-hot row).
            if USE_DOT:
                neg_p = tl.where(hit, (p_bits ^ 0x8000)[:, None], 0)
                acc = tl.dot(_x_operand(xg, INTERPRET), _bits_to_operand(neg_p, INTERPRET), acc)
                fix = _bits_to_operand(tl.where(hit, w_bits[:, None], 0), INTERPRET)
                acc = tl.dot(_x_operand(xg, INTERPRET), fix, acc)  # [BM, BN]
            else:  # BLOCK_M == 1; each bf16 x bf16 product is exact in fp32
                xe = tl.reshape(_bf16_to_f32(xg), (ESC_STEP,))  # [E]
                neg = -(xe * _bits_to_f32(p_bits))  # [E]
                acc += tl.reshape(
                    tl.sum(tl.where(hit, neg[:, None], 0.0), axis=0), (BLOCK_M, BLOCK_N)
                )
                add = xe * _bits_to_f32(w_bits)  # [E]
                acc += tl.reshape(
                    tl.sum(tl.where(hit, add[:, None], 0.0), axis=0), (BLOCK_M, BLOCK_N)
                )
    return acc


@triton.jit
def list_chunk(tile_ptr, val_ptr, c0, length, ESC_STEP: tl.constexpr):
    """Entries ``c0 .. c0 + E`` of a program's fixed-address escape list (``length`` entries at
    ``tile_ptr`` / ``val_ptr``; ``W12Tensor.list_records``): the index in the list ``[E]``, the
    records (``-1`` past the end) and the escaped weights. Addresses need no earlier load, so a
    kernel issues this before its dense loop and nothing waits for it until after the loop."""
    idx = c0 + tl.arange(0, ESC_STEP)  # [E]
    rec = tl.load(tile_ptr + idx, mask=idx < length, other=-1)
    val = tl.load(val_ptr + idx, mask=idx < length, other=0.0)  # [E] bf16
    return idx, rec, val


@triton.jit
def apply_list(
    acc, idx, rec, val, cap, toks, m_ok, k_lo, k_hi, base, x_ptr, stride_xm,
    BLOCK_R: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """``acc^T [BR, BM] += W_e @ xg^T - P_e @ xg^T`` for one chunk of the list (``list_chunk``):
    ``W_e``, ``P_e`` ``[BR, E]`` zero except at ``(row of e, e)``, the escaped weight and the
    placeholder the dense decode produced (exponent ``base``); only records with a column in
    ``[k_lo, k_hi)`` count. Each product is exact and enters the fp32 accumulator once; the
    placeholders' leave first (see ``escape_dots``). The dots take the weights' side as the
    64-row operand, as the dense loop's do, so the whole kernel stays on ``wgmma`` (an
    ``mma.sync`` on the transposed accumulator made ptxas serialize every ``wgmma`` of the loop,
    C7515). The gather of ``x`` (a few KB, in L2) is the one load that waits for the records."""
    k_e = rec & 0x7FFFF  # [E]
    r_loc = (idx // cap) * 64 + (rec >> 19)  # [E] row in this program's tile
    ok = (rec >= 0) & (k_e >= k_lo) & (k_e < k_hi)
    xg = tl.load(x_ptr + toks[None, :] * stride_xm + k_e[:, None], mask=m_ok[None, :] & ok[:, None],
                 other=0.0)  # fmt: skip  # [E, BM]: x^T at the escapes' columns
    w_bits = val.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF  # [E]
    p_bits = (w_bits & 0x807F) | (base << 7)
    hit = (tl.arange(0, BLOCK_R)[:, None] == r_loc[None, :]) & ok[None, :]  # [BR, E]
    xo = _x_operand(xg, INTERPRET)
    neg_p = tl.where(hit, (p_bits ^ 0x8000)[None, :], 0)
    acc = tl.dot(_bits_to_operand(neg_p, INTERPRET), xo, acc)
    return tl.dot(_bits_to_operand(tl.where(hit, w_bits[None, :], 0), INTERPRET), xo, acc)
