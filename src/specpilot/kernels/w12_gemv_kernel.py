"""The W12 v3 GEMV kernel: ``y[M, N] = x[M, K] @ W^T (+ b)`` for M <= 4 rows, FMAs on the CUDA
cores (its launch, tiling and public functions: ``kernels/w12_gemv.py``).

Built for memory-bound decode: every program streams a ``[BLOCK_N, BLOCK_K]`` slab of the two
W12 planes with 16-byte loads and never exchanges data between threads inside its K loop.

Per K step the program loads three int32 tiles of the same shape ``[BLOCK_N, BLOCK_K / 8]``:
``a`` (``sm`` words of the first half of each 64-column group), ``b`` (the second half) and ``c``
(the code words of both halves, ``w12_format``'s pairing), so that one thread holds, for each
element, the 8 weights of a word triple; it decodes them to fp32 in registers
(``w12_decode``: ~2.6 integer instructions per weight with the PTX decoder) and accumulates
``w * x`` in ``[BLOCK_N, BLOCK_K / 8]`` fp32 accumulators, one per activation row (the weights are
read once for all M rows). ``x`` is read as int64 words (4 bf16) and split in registers; each
thread's x values serve all of its weight rows. The bf16 baseline (``W12=False``) is the same
kernel reading bf16 weights as int64 words.

After the K loop each program reduces its accumulators to ``[M, BLOCK_N]`` and adds its escapes:
the first ``ESC_STEP`` escape records of its rows (positions, values, and the activations at their
columns) are loaded *before* the K loop, so their latency hides behind the stream; each escaped
weight ``w`` with placeholder ``p`` (what the dense decode produced: ``w``'s sign and mantissa,
exponent ``base``) adds ``x·w`` and subtracts ``x·p``. Further records (more than ``ESC_STEP`` in
one program's rows: rare) are read after the loop. Split-K and the epilogue are ``w12_gemm``'s.

Exactness: every decoded weight is bit for bit the stored bf16 (or the placeholder at an escape),
a bf16×bf16 product is exact in fp32, and every product enters one fp32 sum once (at escapes
plus an exactly cancelling pair ``±x·p``), so the result differs from ``F.linear`` on the decoded
weights only by the order of fp32 additions (the bound in ``w12_gemm``'s docstring).
"""

from __future__ import annotations

import triton
import triton.language as tl

from specpilot.kernels import pdl
from specpilot.kernels.gemm_common import _store_tile
from specpilot.kernels.gemv_prologue import _inv_rms, _row_step, _split_words
from specpilot.kernels.w12_decode import decode_words_f32_ops, decode_words_f32_ptx
from specpilot.kernels.w12_escapes import _apply_escapes, _escapes
from specpilot.mechanisms.w12_format import ESC_ROWS

_ESC_ROWS = tl.constexpr(ESC_ROWS)


@triton.jit
def _load_step(
    k0, k_hi, offs_n, n_ok, lo, hi, jw, w_ptr, sm_ptr, codes_ptr, row_words,
    W12: tl.constexpr, EVEN: tl.constexpr,
):  # fmt: skip
    """The three weight tiles of one K step (W12: ``sm`` words of both halves and code words;
    bf16: the int64 weight words of both halves, ``c`` unused)."""
    wofs = k0 // 4
    rows = offs_n[:, None] * row_words + wofs
    src = sm_ptr if W12 else w_ptr
    a_ptrs = src + rows + lo[None, :]
    b_ptrs = src + rows + hi[None, :]
    c_ptrs = codes_ptr + offs_n[:, None] * (row_words // 2) + k0 // 8 + jw[None, :]
    if EVEN:
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs)
        c = tl.load(c_ptrs) if W12 else a
    else:
        mask_a = n_ok[:, None] & ((wofs + lo) * 4 < k_hi)[None, :]
        mask_b = n_ok[:, None] & ((wofs + hi) * 4 < k_hi)[None, :]
        a = tl.load(a_ptrs, mask=mask_a, other=0)
        b = tl.load(b_ptrs, mask=mask_b, other=0)
        c = tl.load(c_ptrs, mask=mask_a, other=0) if W12 else a
    return a, b, c


@triton.jit(do_not_specialize=["M", "base", "split"])
def _gemv_kernel(
    x64_ptr,  # [M, KW] int64: x as words of 4 bf16, row stride stride_x64
    x16_ptr,  # the same memory as bf16, row stride 4 * stride_x64 (escape gathers)
    w_ptr,  # [N, K / 4] int64 words of bf16 weights (W12=False)
    sm_ptr,  # [N, Kp / 4] int32 words of W12 sign/mantissa bytes
    codes_ptr,  # [N, Kp / 8] int32 words of code bytes
    off_ptr,  # [ceil(N/16) + 1] int32
    rec_ptr,  # [n_esc] int32
    val_ptr,  # [n_esc] bf16
    bias_ptr,  # [N] bf16, or [M, N] with row stride stride_bm (a residual) (HAS_BIAS)
    g64_ptr,  # [K / 4] int64 words of the RMSNorm weights (PROLOGUE == 1)
    g16_ptr,  # the same memory as bf16 (escape gathers)
    y_ptr,  # [M, N] bf16, row stride stride_ym
    part_ptr,  # [split, M, N] fp32 (split > 1)
    count_ptr,  # [tiles] int32 (split > 1)
    M,
    N,
    K,
    stride_x64,
    stride_ym,
    stride_bm,  # 0 for a bias
    up_words,  # PROLOGUE == 2: int64 words from a gate_up row's start to its up half (K / 4)
    eps,  # PROLOGUE == 1
    row_words,  # weight words per row: Kp / 4 (W12) or K / 4 (bf16)
    base,
    k_split,  # columns per split, a multiple of BLOCK_K
    split,
    W12: tl.constexpr,
    PTX: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PROLOGUE: tl.constexpr,  # 0: x as given; 1: RMSNorm(x); 2: silu(gate) * up of x = gate_up
    EVEN: tl.constexpr,  # N % BLOCK_N == 0 and K % k_split == 0: no masks on the weights
    ROWS: tl.constexpr,  # power of two >= M
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ESC_STEP: tl.constexpr,
    MAX_SPLIT: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL_TRIGGER: tl.constexpr,  # let a dependent kernel launched with PDL start (kernels/pdl.py)
    PDL_WAIT: tl.constexpr,  # launched with PDL: the first weights stream before the wait
):
    pdl.trigger(PDL_TRIGGER)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_ok = offs_n < N
    m_rows = tl.arange(0, ROWS)  # [ROWS]
    k_lo = pid_k * k_split
    k_hi = tl.minimum(k_lo + k_split, K)
    BW: tl.constexpr = BLOCK_K // 8
    jw = tl.arange(0, BW)  # [BW] word slot: group jw // 8, word jw % 8 of each half
    lo = (jw // 8) * 16 + (jw % 8)  # [BW] sm (or bf16) word of the first half, from k0 / 4
    hi = lo + 8

    if PDL_WAIT:  # only immutable weights are read before the previous kernel has completed
        a0, b0, c0 = _load_step(
            k_lo, k_hi, offs_n, n_ok, lo, hi, jw, w_ptr, sm_ptr, codes_ptr, row_words, W12, EVEN
        )
        pdl.wait(PDL_WAIT)
    inv = tl.zeros((ROWS,), dtype=tl.float32)  # each row's 1 / RMS (PROLOGUE == 1)
    inv0 = 0.0
    inv1 = 0.0
    inv2 = 0.0
    inv3 = 0.0
    if PROLOGUE == 1:  # the whole row's statistics, read from L2 (by every program)
        inv = _inv_rms(x16_ptr, stride_x64 * 4, m_rows, M, K, eps, ROWS, BLOCK_K)  # [ROWS]
        inv0 = tl.sum(tl.where(m_rows == 0, inv, 0.0))
        inv1 = tl.sum(tl.where(m_rows == 1, inv, 0.0))
        inv2 = tl.sum(tl.where(m_rows == 2, inv, 0.0))
        inv3 = tl.sum(tl.where(m_rows == 3, inv, 0.0))

    if W12:  # the first chunk of escapes, fetched now so that it arrives during the K loop
        NB: tl.constexpr = BLOCK_N // _ESC_ROWS
        n_blocks = (N + _ESC_ROWS - 1) // _ESC_ROWS
        blk0 = pid_n * NB
        bidx = blk0 + tl.arange(0, NB)  # [NB]
        starts = tl.load(off_ptr + bidx, mask=bidx < n_blocks, other=2**30)  # [NB]
        e_start = tl.load(off_ptr + blk0)
        e_end = tl.load(off_ptr + tl.minimum(blk0 + NB, n_blocks))
        pw, pp, hit = _escapes(
            e_start, e_end, blk0, starts, offs_n, m_rows, M, K, k_lo, k_hi, base, x16_ptr,
            stride_x64 * 4, rec_ptr, val_ptr, g16_ptr, inv, up_words * 4, ROWS, ESC_STEP,
            PROLOGUE,
        )  # fmt: skip
    base4 = base * 0x01010101

    acc0 = tl.zeros((BLOCK_N, BW), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, BW), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, BW), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, BW), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if PDL_WAIT:
            if k0 == k_lo:
                a, b, c = a0, b0, c0
            else:
                a, b, c = _load_step(
                    k0, k_hi, offs_n, n_ok, lo, hi, jw, w_ptr, sm_ptr, codes_ptr, row_words, W12,
                    EVEN,
                )  # fmt: skip
        else:
            a, b, c = _load_step(
                k0, k_hi, offs_n, n_ok, lo, hi, jw, w_ptr, sm_ptr, codes_ptr, row_words, W12, EVEN
            )
        if W12:
            if PTX:
                w0, w1, w2, w3, w4, w5, w6, w7 = decode_words_f32_ptx(a, b, c, base4)
            else:
                w0, w1, w2, w3, w4, w5, w6, w7 = decode_words_f32_ops(a, b, c, base4)
        else:
            w0, w1, w2, w3 = _split_words(a)
            w4, w5, w6, w7 = _split_words(b)
        wofs = k0 // 4
        xa_ok = (wofs + lo) * 4 < k_hi
        xb_ok = (wofs + hi) * 4 < k_hi
        x_row = x64_ptr + wofs
        ga = xa_ok  # the norm weights' words at this step (PROLOGUE == 1), else unused
        gb = xb_ok
        if PROLOGUE == 1:
            ga = tl.load(g64_ptr + wofs + lo, mask=xa_ok, other=0)
            gb = tl.load(g64_ptr + wofs + hi, mask=xb_ok, other=0)
        acc0 = _row_step(
            acc0, w0, w1, w2, w3, w4, w5, w6, w7, x_row, lo, hi, xa_ok, xb_ok, ga, gb,
            up_words, inv0, PROLOGUE,
        )  # fmt: skip
        if ROWS > 1:
            acc1 = _row_step(
                acc1, w0, w1, w2, w3, w4, w5, w6, w7, x_row + stride_x64, lo, hi,
                xa_ok & (jw * 0 + 1 < M), xb_ok & (jw * 0 + 1 < M), ga, gb, up_words, inv1,
                PROLOGUE,
            )  # fmt: skip
        if ROWS > 2:
            acc2 = _row_step(
                acc2, w0, w1, w2, w3, w4, w5, w6, w7, x_row + 2 * stride_x64, lo, hi,
                xa_ok & (jw * 0 + 2 < M), xb_ok & (jw * 0 + 2 < M), ga, gb, up_words, inv2,
                PROLOGUE,
            )  # fmt: skip
            acc3 = _row_step(
                acc3, w0, w1, w2, w3, w4, w5, w6, w7, x_row + 3 * stride_x64, lo, hi,
                xa_ok & (jw * 0 + 3 < M), xb_ok & (jw * 0 + 3 < M), ga, gb, up_words, inv3,
                PROLOGUE,
            )  # fmt: skip

    # [ROWS, BN]: row r of the output tile is acc_r summed over its word slots
    sel = m_rows[:, None]
    acc = tl.where(sel == 0, tl.sum(acc0, axis=1)[None, :], 0.0)
    if ROWS > 1:
        acc = tl.where(sel == 1, tl.sum(acc1, axis=1)[None, :], acc)
    if ROWS > 2:
        acc = tl.where(sel == 2, tl.sum(acc2, axis=1)[None, :], acc)
        acc = tl.where(sel == 3, tl.sum(acc3, axis=1)[None, :], acc)
    if W12:
        acc = _apply_escapes(acc, pw, pp, hit)
        e0 = e_start + ESC_STEP
        while e0 < e_end:  # more escapes than one chunk in these rows: rare
            pw, pp, hit = _escapes(
                e0, e_end, blk0, starts, offs_n, m_rows, M, K, k_lo, k_hi, base, x16_ptr,
                stride_x64 * 4, rec_ptr, val_ptr, g16_ptr, inv, up_words * 4, ROWS, ESC_STEP,
                PROLOGUE,
            )  # fmt: skip
            acc = _apply_escapes(acc, pw, pp, hit)
            e0 += ESC_STEP

    _store_tile(
        acc, y_ptr, y_ptr, bias_ptr, part_ptr, count_ptr, m_rows, offs_n, m_rows < M, n_ok,
        stride_ym, stride_bm, M, N, 0, pid_n, pid_k, split, False, HAS_BIAS, MAX_SPLIT, INTERPRET,
    )  # fmt: skip
