"""``y[M, N] = x[M, K] @ W^T (+ b)`` on the tensor cores for M <= 64, W in W12 layout ``v4``.

The weights are the MMA's A operand (``acc^T [BLOCK_R, BLOCK_M] += W [BLOCK_R, BK] @ x^T``: swap AB,
so the weight rows fill wgmma's 64-row side and the tokens its 8-64-wide side), decoded from
registers straight into the A fragments: Triton's MMAv3 path keeps a dot's A operand in registers
when everything between its loads and the dot is elementwise (here one pure ``inline_asm``), so
the bytes go global -> shared (``cp.async``, ``num_stages`` deep) -> registers in the fragment
layout -> decode -> ``wgmma`` with A from registers, with no decoded tile in shared memory.

Layout v4 (``mechanisms/w12_format.py``) makes the decode elementwise: one 32-bit ``sm`` word and
one 16-bit code word describe weights ``(w, w + 16, w + 32, w + 48)`` of a 64-column group, each
word carrying its own signs (quarter pairs (0, 1), (2, 3)), so a ``[BR, BK / 4]`` int32 tile and a
same-shaped int16 tile decode into four ``[BR, BK / 4]`` bf16 operands, one per quarter, whatever
layout the compiler picks, and four dots take the matching columns of x. Per two words (eight
weights, four output registers of bf16 pairs):

    e01 = (codes & 0x0F0F0F0F) + base4; e23 = ((codes >> 4) & 0x0F0F0F0F) + base4
    per word and quarter pair: rotate_right(prmt(word, e, sel), 1)  # [b, E, b', E'] -> 2 bf16
    per quarter: prmt(a, b, 0x5410 | 0x7632)                        # regroup the two words

17 integer instructions per 8 weights (~2.1), against 1.6 in the GEMV but with no FMA per row:
the tensor core does the products for every token at once. An escape (code 0) decodes to the
placeholder (exponent ``base``); each program loads its tile's fixed-address escape list
(``W12Tensor.list_records``) before the loop and, after it, removes the placeholders' products
and adds the escaped weights' by two small wgmma dots (``w12_escapes.apply_list``). ``base`` is a
compile-time constant (a runtime scalar would route the tile through shared memory), so each
distinct ``base`` is one compile.

ptxas serializes every wgmma of a kernel (C7515: each HGMMA waited for before the next) if a
non-wgmma instruction may define an accumulator register between a wgmma and its wait; two
things did that here and are avoided: the escape dots as ``mma.sync`` on the transposed
accumulator, and the zeroed accumulator on the path that skips an empty K loop (hence
``tl.assume``). On the H100 this alone took the Llama-3-8B shapes from 0.89-1.12x to 1.05-1.14x
cuBLAS at M = 16, same tiling (docs/figures/issue-26.md).

Two warp groups per row tile (``MmaConfig.inner_split`` 2, ``HALVES``): the MMA takes the tile's
rows twice, the second copy on the second half of every K step's columns, against x's tokens
twice, the second copy read at that half, so ``acc [2 * BR, 2 * BM]`` holds the two halves' sums
in its diagonal blocks (``_join_halves`` adds them after the loop). Each weight is still loaded
and decoded once; the tile gets 8 warps at the shared memory of 4, for grids with fewer programs
than SMs (one warp per scheduler otherwise), without the fp32 partials of a K split.

Exactness: the decoded operand is bit for bit the bf16 weight (the placeholder at escapes), a
bf16 product is exact in fp32, every product enters one fp32 sum once: the result differs from
``F.linear`` on the decoded weights only in the order of the fp32 additions (``w12_gemm``'s
argument and bound). Split-K partials are reduced in a fixed order (``gemm_common._store_tile``).

The interpreter (CPU tests) cannot run inline PTX: there the same bits come from plain integer ops,
with exact fp32 operands.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from specpilot.kernels.gemm_common import (
    MAX_COUNTER_TILES_M,
    MAX_SPLIT_K,
    _num_sms,
    _store_tile,
    _x_operand,
    k_splits,
    outputs,
)
from specpilot.kernels.stream_k import programs, stream_store
from specpilot.kernels.w12_decode import _bits_to_operand
from specpilot.kernels.w12_escapes import apply_list, list_chunk
from specpilot.kernels.w12_tilings import MAX_ROWS, MmaConfig
from specpilot.mechanisms.w12_format import GROUP, QUARTER, W12Tensor

_Q = tl.constexpr(QUARTER)
_GROUP = tl.constexpr(GROUP)

_DECODE_V4 = tl.constexpr("""{
    .reg .b32 e01, e23, a01, b01, a23, b23;
    and.b32 e01, $6, 0x0F0F0F0F;
    add.u32 e01, e01, $7;
    shr.u32 e23, $6, 4;
    and.b32 e23, e23, 0x0F0F0F0F;
    add.u32 e23, e23, $7;
    prmt.b32 a01, $4, e01, 0x5140;
    shf.r.wrap.b32 a01, a01, a01, 1;
    prmt.b32 b01, $5, e01, 0x7160;
    shf.r.wrap.b32 b01, b01, b01, 1;
    prmt.b32 a23, $4, e23, 0x5342;
    shf.r.wrap.b32 a23, a23, a23, 1;
    prmt.b32 b23, $5, e23, 0x7362;
    shf.r.wrap.b32 b23, b23, b23, 1;
    prmt.b32 $0, a01, b01, 0x5410;
    prmt.b32 $1, a01, b01, 0x7632;
    prmt.b32 $2, a23, b23, 0x5410;
    prmt.b32 $3, a23, b23, 0x7632;
    }""")
"""Two ``sm`` words ``$4``, ``$5`` (two elements, decoded independently), their code half-words
packed in ``$6``, ``base * 0x01010101`` in ``$7`` -> quarters 0..3 (``$0``..``$3``), each the
bf16 pair (word ``$4``'s, word ``$5``'s): per word ``[b_q, E_q, b_q^1, E_q^1]`` rotated right by
one bit is the bf16 pair of quarters ``q``, ``q ^ 1``, then a byte permute regroups by quarter."""


@triton.jit
def _decode_ptx(s, c, base4):
    """``s [BR, W]`` int32 ``sm`` words, ``c [BR, W]`` int16 code words, ``base4`` int32 (a
    constant tile) -> the four quarters' bf16 tiles (GPU only)."""
    return tl.inline_asm_elementwise(
        _DECODE_V4, "=r,=r,=r,=r,r,r,r,r,r", [s, c, base4],
        dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16), is_pure=True, pack=2,
    )  # fmt: skip


@triton.jit
def _quarter_ops(s, c, BASE: tl.constexpr, Q: tl.constexpr, INTERPRET: tl.constexpr):
    """Quarter ``Q`` of words ``s`` (its sign in quarter ``Q ^ 1``'s byte) with code words ``c``
    (quarters 0, 2, 1, 3 by nibble) by plain integer ops: the same bits as ``_decode_ptx``."""
    b = (s >> (8 * Q)) & 0xFF
    pb = (s >> (8 * (Q ^ 1))) & 0xFF
    code = (c.to(tl.int32) >> (4 * (Q >> 1) + 8 * (Q & 1))) & 0xF
    bits = ((pb & 1) << 15) | ((code + BASE) << 7) | (b >> 1)
    return _bits_to_operand(bits, INTERPRET)


@triton.jit
def _x_quarter(x_ptrs, kt, m_ok, K, Q: tl.constexpr, EVEN: tl.constexpr):
    """x^T's rows for quarter ``Q`` of the step's words: ``[W, BM*H]`` bf16, zero past M and K
    (``kt [W, BM*H]``: the column of quarter 0)."""
    if EVEN:
        return tl.load(x_ptrs + Q * _Q, mask=m_ok[None, :], other=0.0)
    return tl.load(x_ptrs + Q * _Q, mask=m_ok[None, :] & (kt + Q * _Q < K), other=0.0)


@triton.jit
def _k_step(
    acc, k0, k_hi, rows, toks, r_ok, m_ok, x_ptr, stride_xm, sm_ptr, cb_ptr, K, row_words,
    BASE: tl.constexpr, EVEN: tl.constexpr, PTX: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr, HALVES: tl.constexpr, BLOCK_M: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """One ``BLOCK_K`` step: load the words and x's four quarters, decode, four dots. With
    ``HALVES`` 2 the MMA's rows are the tile's rows twice (``rows [BR * H]``), the second copy on
    the step's second half of columns, and its tokens are the tile's twice (``toks [BM * H]``),
    the second copy reading x at that half: ``acc [BR * H, BM * H]``, whose diagonal blocks are
    the two halves' partial sums (``_join_halves``)."""
    BK: tl.constexpr = BLOCK_K // HALVES  # columns per half
    W: tl.constexpr = BK // 4
    j = tl.arange(0, W)  # [W] word index in the half step
    r_half = (tl.arange(0, BLOCK_R * HALVES) // BLOCK_R) * BK  # [BR*H] the MMA row's column offset
    t_half = (tl.arange(0, BLOCK_M * HALVES) // BLOCK_M) * BK  # [BM*H] the token's column offset
    kq = (j // _Q) * _GROUP + (j % _Q)  # [W] column of quarter 0 of word j, from the half's start
    w_off = rows[:, None] * row_words + ((k0 + r_half) // 4)[:, None] + j[None, :]  # [BR*H, W]
    if EVEN:
        s = tl.load(sm_ptr + w_off)
        c = tl.load(cb_ptr + w_off)
    else:  # a word is in range iff its group starts below k_hi (a multiple of 64)
        w_mask = r_ok[:, None] & ((k0 + r_half)[:, None] + 4 * j[None, :] < k_hi)
        s = tl.load(sm_ptr + w_off, mask=w_mask, other=0)
        c = tl.load(cb_ptr + w_off, mask=w_mask, other=0)
    x_row = x_ptr + toks[None, :] * stride_xm + (k0 + t_half)[None, :]  # [1, BM*H]
    if PTX:  # one dot over the step: the quarters joined into [BR*H, BK] (column q * W + j)
        base4 = tl.full((BLOCK_R * HALVES, W), BASE * 0x01010101, tl.int32)
        w0, w1, w2, w3 = _decode_ptx(s, c, base4)
        wj = tl.join(tl.join(w0, w1), tl.join(w2, w3))  # [BR*H, W, 2, 2]: [r, j, i, h] quarter 2h+i
        w_all = tl.reshape(tl.permute(wj, (0, 3, 2, 1)), (BLOCK_R * HALVES, BK))
        cols = tl.arange(0, BK)  # [BK] column q * W + j of w_all <-> x^T's row
        jw = cols % W
        ks = (jw // _Q) * _GROUP + (cols // W) * _Q + (jw % _Q)
        ks = tl.max_contiguous(tl.multiple_of(ks, 16), 16)  # runs of 16 columns
        x_ptrs = x_row + ks[:, None]  # [BK, BM*H]: x^T
        if EVEN:
            x_all = tl.load(x_ptrs, mask=m_ok[None, :], other=0.0)
        else:
            x_all = tl.load(x_ptrs, mask=m_ok[None, :] & ((k0 + t_half)[None, :] + ks[:, None] < K),
                            other=0.0)  # fmt: skip
        acc = tl.dot(w_all, x_all, acc)  # [BR*H, BM*H]
    else:
        x_ptrs = x_row + kq[:, None]  # [W, BM*H]: x^T, quarter 0
        kt = (k0 + t_half)[None, :] + kq[:, None]  # [W, BM*H] column of quarter 0
        x0 = _x_quarter(x_ptrs, kt, m_ok, K, 0, EVEN)
        x1 = _x_quarter(x_ptrs, kt, m_ok, K, 1, EVEN)
        x2 = _x_quarter(x_ptrs, kt, m_ok, K, 2, EVEN)
        x3 = _x_quarter(x_ptrs, kt, m_ok, K, 3, EVEN)
        acc = tl.dot(_quarter_ops(s, c, BASE, 0, INTERPRET), _x_operand(x0, INTERPRET), acc)
        acc = tl.dot(_quarter_ops(s, c, BASE, 1, INTERPRET), _x_operand(x1, INTERPRET), acc)
        acc = tl.dot(_quarter_ops(s, c, BASE, 2, INTERPRET), _x_operand(x2, INTERPRET), acc)
        acc = tl.dot(_quarter_ops(s, c, BASE, 3, INTERPRET), _x_operand(x3, INTERPRET), acc)
    return acc


@triton.jit
def _join_halves(acc, BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr):
    """``acc [2 * BR, 2 * BM]`` of a two-half step -> ``[BR, BM]``: the first half's rows with the
    first half's tokens plus the second's with the second's (the other two blocks are cross
    terms, dropped); one fp32 addition per output, in a fixed order."""
    a = tl.permute(tl.reshape(acc, (2, BLOCK_R, 2, BLOCK_M)), (1, 3, 0, 2))  # [BR, BM, h, g]
    g0, g1 = tl.split(a)  # [BR, BM, h] with the first / second half's tokens
    h0g0, _ = tl.split(g0)
    _, h1g1 = tl.split(g1)
    return h0g0 + h1g1


@triton.jit
def _segment(
    pid_n, pid_m, k_lo, k_hi, M, N, K, x_ptr, stride_xm, sm_ptr, cb_ptr, lrec_ptr, lval_ptr,
    cap, row_words, BASE: tl.constexpr, EVEN: tl.constexpr, PTX: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, HALVES: tl.constexpr, BLOCK_M: tl.constexpr,
    ESC_STEP: tl.constexpr, ESCAPES: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """Tile ``(pid_n, pid_m)`` over the columns ``[k_lo, k_hi)``: ``acc [BM, BR]`` fp32 with the
    escapes of those columns applied, its token and row offsets and masks."""
    rows = pid_n * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
    toks = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    r_ok = rows < N
    m_ok = toks < M
    # the MMA's rows and tokens: the tile's, once per half (_k_step)
    rows_h = pid_n * BLOCK_R + tl.arange(0, BLOCK_R * HALVES) % BLOCK_R  # [BR*H]
    toks_h = pid_m * BLOCK_M + tl.arange(0, BLOCK_M * HALVES) % BLOCK_M  # [BM*H]
    r_ok_h = rows_h < N
    m_ok_h = toks_h < M
    acc = tl.zeros((BLOCK_R * HALVES, BLOCK_M * HALVES), dtype=tl.float32)  # y^T tile(s)
    length = (BLOCK_R // 64) * cap  # this tile's list: consecutive 64-row lists
    t_rec = lrec_ptr + pid_n * length
    t_val = lval_ptr + pid_n * length
    if ESCAPES:  # the list's first chunk: fixed addresses, issued before the dense loop
        idx, rec, val = list_chunk(t_rec, t_val, 0, length, ESC_STEP)
    if INTERPRET:  # the interpreter cannot take a runtime range() bound (numpy >= 2)
        k0 = k_lo
        while k0 < k_hi:
            acc = _k_step(
                acc, k0, k_hi, rows_h, toks_h, r_ok_h, m_ok_h, x_ptr, stride_xm, sm_ptr, cb_ptr,
                K, row_words, BASE, EVEN, PTX, BLOCK_R, BLOCK_K, HALVES, BLOCK_M, INTERPRET,
            )  # fmt: skip
            k0 += BLOCK_K
    else:  # a for loop, so that Triton software-pipelines the loads (num_stages)
        # Never empty (the launch gives every split and segment a step). Without the promise the
        # loop-skipping path zeroes the accumulator between the last wgmma and its wait, and
        # ptxas then serializes every wgmma of the kernel (C7515).
        tl.assume(k_lo < k_hi)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            acc = _k_step(
                acc, k0, k_hi, rows_h, toks_h, r_ok_h, m_ok_h, x_ptr, stride_xm, sm_ptr, cb_ptr,
                K, row_words, BASE, EVEN, PTX, BLOCK_R, BLOCK_K, HALVES, BLOCK_M, INTERPRET,
            )  # fmt: skip
    if HALVES == 2:
        acc = _join_halves(acc, BLOCK_R, BLOCK_M)  # [BR, BM]
    if ESCAPES:  # remove the placeholders' products, then add the escaped weights'
        acc = apply_list(acc, idx, rec, val, cap, toks, m_ok, k_lo, k_hi, BASE, x_ptr, stride_xm,
                         BLOCK_R, INTERPRET)  # fmt: skip
        c0 = ESC_STEP
        while c0 < length:  # a tile with more escapes than one chunk (rare)
            idx, rec, val = list_chunk(t_rec, t_val, c0, length, ESC_STEP)
            acc = apply_list(acc, idx, rec, val, cap, toks, m_ok, k_lo, k_hi, BASE, x_ptr,
                             stride_xm, BLOCK_R, INTERPRET)  # fmt: skip
            c0 += ESC_STEP
    return tl.trans(acc), rows, toks, r_ok, m_ok  # [BM, BR]


@triton.jit(do_not_specialize=["M", "split"])  # one compile serves every M <= BLOCK_M
def _mma_kernel(
    x_ptr,  # [M, K] bf16, row stride stride_xm
    sm_ptr,  # [N, Kp / 4] int32: v4 sign/mantissa words
    cb_ptr,  # [N, Kp / 4] int16: v4 code words
    lrec_ptr,  # [ceil(N/64), cap] int32: the escape lists
    lval_ptr,  # [ceil(N/64), cap] bf16
    bias_ptr,  # [N] bf16 (HAS_BIAS)
    y_ptr,  # [M, N] bf16, row stride stride_ym
    part_ptr,  # split-K: [split, M, N] fp32; stream-K: [2 * programs, BM, BR] fp32
    count_ptr,  # [tiles] int32, zero between calls (split > 1, stream-K)
    M, N, K, stride_xm, stride_ym,
    row_words,  # Kp / 4
    k_split,  # padded columns per split, a multiple of BLOCK_K
    split,
    cap,  # entries per 64-row escape list
    BASE: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN: tl.constexpr, PTX: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, HALVES: tl.constexpr, BLOCK_M: tl.constexpr,
    ESC_STEP: tl.constexpr, ESCAPES: tl.constexpr, MAX_SPLIT: tl.constexpr,
    STREAM: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    if STREAM:  # kernels/stream_k.py: program p takes steps [p, p + 1) * n_it // n_prog
        pid = tl.program_id(0)
        n_prog = tl.num_programs(0)
        steps_t = tl.cdiv(row_words * 4, BLOCK_K)  # K steps per tile
        n_tiles = tl.cdiv(N, BLOCK_R)
        n_it = n_tiles * tl.cdiv(M, BLOCK_M) * steps_t
        it_lo = pid * n_it // n_prog
        it_hi = (pid + 1) * n_it // n_prog
        for t in range(it_lo // steps_t, (it_hi + steps_t - 1) // steps_t):
            s_lo = tl.maximum(it_lo - t * steps_t, 0)
            s_hi = tl.minimum(it_hi - t * steps_t, steps_t)
            k_hi = tl.minimum(s_hi * BLOCK_K, row_words * 4)
            acc, rows, toks, r_ok, m_ok = _segment(
                t % n_tiles, t // n_tiles, s_lo * BLOCK_K, k_hi, M, N, K, x_ptr, stride_xm, sm_ptr,
                cb_ptr, lrec_ptr, lval_ptr, cap, row_words, BASE, EVEN, PTX, BLOCK_R, BLOCK_K,
                HALVES, BLOCK_M, ESC_STEP, ESCAPES, INTERPRET,
            )  # fmt: skip
            stream_store(
                acc, t, s_lo, s_hi, steps_t, n_it, pid, n_prog, y_ptr, bias_ptr, part_ptr,
                count_ptr, toks, rows, m_ok, r_ok, stride_ym, BLOCK_M, BLOCK_R, HAS_BIAS,
                INTERPRET,
            )  # fmt: skip
    else:
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_k = tl.program_id(2)
        k_lo = pid_k * k_split
        k_hi = tl.minimum(k_lo + k_split, row_words * 4)
        acc, rows, toks, r_ok, m_ok = _segment(
            pid_n, pid_m, k_lo, k_hi, M, N, K, x_ptr, stride_xm, sm_ptr, cb_ptr, lrec_ptr,
            lval_ptr, cap, row_words, BASE, EVEN, PTX, BLOCK_R, BLOCK_K, HALVES, BLOCK_M,
            ESC_STEP, ESCAPES, INTERPRET,
        )  # fmt: skip
        _store_tile(
            acc, y_ptr, y_ptr, bias_ptr, part_ptr, count_ptr, toks, rows, m_ok, r_ok, stride_ym,
            0, M, N, pid_m, pid_n, pid_k, split, False, HAS_BIAS, MAX_SPLIT, INTERPRET,
        )  # fmt: skip


def launch_shape(m: int, n: int, k_padded: int, cfg: MmaConfig, device: torch.device):
    """``(grid, block_m, split, k_split)`` of one launch (stream-K: ``(n_prog,)``, split 1)."""
    bm = cfg.tokens(m)
    tiles = triton.cdiv(n, cfg.block_r) * triton.cdiv(m, bm)
    if cfg.stream_k:
        steps = triton.cdiv(k_padded, cfg.block_k)
        return (programs(tiles, steps, _num_sms(device), cfg.stream_k), 1, 1), bm, 1, k_padded
    want = cfg.split_k or max(1, (2 * _num_sms(device)) // tiles)
    split, k_split = k_splits(k_padded, cfg.block_k, want)
    return (triton.cdiv(n, cfg.block_r), triton.cdiv(m, bm), split), bm, split, k_split


def w12_mma(
    x: Tensor,  # [M, K] bf16
    w: W12Tensor,  # [N, K], layout v4
    counters: Tensor,  # from gemm_common.counter_buffer(N)
    bias: Tensor | None = None,  # [N] bf16
    cfg: MmaConfig | None = None,
    ptx: bool = True,
    escapes: bool = True,
) -> Tensor:  # [M, N] bf16
    """``x @ decode(w)^T (+ bias)`` with the weights decoded into the tensor cores' operand
    registers (``ptx``: inline PTX on the GPU; ``False`` or the interpreter: plain integer ops).
    A program loads the first ``4 * block_r`` entries of its tile's escape list
    (``W12Tensor.list_records``: fixed addresses, no dependent load) before its dense loop and
    applies them after it, the rest (tiles with more escapes) after the loop. ``cfg.stream_k``:
    the stream-K grid (``kernels/stream_k.py``), else split-K. ``escapes=False`` leaves the escape
    correction out: a wrong result, only for timing what the dense loop costs (the GPU script's
    diagnostic)."""
    m, k = x.shape
    n = w.shape[0]
    cfg = cfg or MmaConfig()
    if w.layout != "v4" or w.list_records is None or w.list_values is None:
        raise ValueError(f"w12_mma reads W12 layout v4 with escape lists, got {w.layout!r}")
    if k != w.k:
        raise ValueError(f"x has K = {k}, the weight has K = {w.k}")
    if x.dtype != torch.bfloat16 or x.stride(1) != 1:
        raise ValueError("x must be bf16 with unit stride along K")
    if m > MAX_ROWS or triton.cdiv(m, cfg.tokens(m)) > MAX_COUNTER_TILES_M:
        raise ValueError(f"w12_mma takes at most {MAX_ROWS} rows, got {m}")
    kp = w.padded_k
    grid, bm, split, k_split = launch_shape(m, n, kp, cfg, x.device)
    if cfg.stream_k:
        y = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)  # [M, N]
        part = torch.empty(2 * grid[0], bm, cfg.block_r, dtype=torch.float32, device=x.device)
    else:
        y, part = outputs(m, n, grid, counters, x.device)  # [M, N], [split, M, N]
    cap = int(w.list_records.shape[1])
    length = cfg.block_r // 64 * cap
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    even = n % cfg.block_r == 0 and kp == k and kp % cfg.block_k == 0  # every step whole
    _mma_kernel[grid](
        x, w.sm.view(torch.int32), w.codes.view(torch.int16), w.list_records, w.list_values,
        bias if bias is not None else x, y, part, counters,
        m, n, k, x.stride(0), y.stride(0), kp // 4, k_split, split, cap,
        BASE=w.base, HAS_BIAS=bias is not None, EVEN=even, PTX=ptx and not interpret,
        BLOCK_R=cfg.block_r, BLOCK_K=cfg.block_k, HALVES=cfg.inner_split, BLOCK_M=bm,
        ESC_STEP=min(length, 4 * cfg.block_r), ESCAPES=escapes and w.num_escapes > 0,
        MAX_SPLIT=MAX_SPLIT_K, STREAM=cfg.stream_k > 0, INTERPRET=interpret,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return y


__all__ = ["MAX_ROWS", "MmaConfig", "launch_shape", "w12_mma"]
