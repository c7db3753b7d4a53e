"""``y[M, N] = x[M, K] @ W^T (+ b)`` for small M (decode and verify), reading W in W12.

One Triton kernel serves two weight formats so that the bf16 one is the fair baseline for the
cost of decoding: ``W12=False`` streams a bf16 ``[N, K]`` matrix, ``W12=True`` streams the W12
byte plane (sign | mantissa), the nibble plane (exponent codes, paired across half-groups) and
the escape records, and rebuilds each bf16 weight in registers. Everything else (tiles, loop,
split-K, epilogue) is shared.

Per program: a ``[BLOCK_M, BLOCK_N]`` output tile over one K range of ``k_split`` columns.

* **Dense loop** over ``BLOCK_K`` columns, i.e. ``BLOCK_K / 64`` code groups: per group, load one
  ``[BLOCK_N, 32]`` tile of code bytes and, for each half (columns ``j`` and ``j + 32``), the
  ``[BLOCK_N, 32]`` sign/mantissa bytes and ``x [BLOCK_M, 32]``; decode
  ``bits = (sign_ext(sm) & 0x807F) | ((base + code) << 7)`` — on the GPU four weights at a time
  with byte permutes in inline PTX (``_decode_prmt``), in the interpreter with plain integer ops
  (``_decode_ops``, the same bits) — and accumulate in fp32: ``tl.dot`` on the tensor cores, or,
  for one row (``USE_DOT=False``), FMAs into a ``[BLOCK_N, 32]`` fp32 accumulator reduced once at
  the end. The low/high nibble of a code byte belongs to the first/second half, so no tile is
  interleaved or shuffled. An escape (code 0) decodes to the placeholder: its own sign and
  mantissa with exponent ``base``, below every window exponent.
* **Escapes**, once per program after the loop: for each 16-row escape block of the tile, the
  CSR range of its records is read 32 at a time; each record gives (n, k, exponent), the
  sign/mantissa byte is re-read from ``sm``, and the escaped weights and the negated placeholders
  are put in ``[32, BLOCK_N]`` bf16 tiles (zero except at ``(e, n_e)``) that two more ``tl.dot``
  multiply by the gathered activation columns ``x[:, k_e]``. So the placeholders' products leave
  the fp32 accumulator, then the escaped terms ``x[m, k_e] * w[n_e, k_e]`` enter it (in that
  order: an escape below 2^-24 of its placeholder would be absorbed by x·p otherwise). Nothing serializes: no prefix sums, no per-weight branch, ~1-3 chunks per program.
* **Split-K** (when there are too few output tiles to fill the GPU): each split writes its fp32
  partial; an atomic per-tile counter (``acq_rel``) elects the last split, which sums the partials
  in split order (deterministic), adds the bias, rounds to bf16 once and resets the counter, so
  the whole product is one launch and the counters need no memset.

Exactness: the decoded tile is bit for bit the bf16 weight (or the placeholder at escapes),
a bf16×bf16 product is exact in fp32, and every product ``x[m, k] * w[n, k]`` enters one fp32 sum
exactly once (plus, at escapes, an exactly cancelling pair ``±x·p`` with
``|p| < 2^-14 · max|w|`` for the weights in the window). The result therefore differs from
``F.linear`` on the decoded weights only by the order of the fp32 additions (cuBLAS also picks
its order per shape), i.e. by at most ``γ_K · Σ_k |x_k w_k|`` before the final bf16 rounding
(γ_K ≈ K · 2^-24); tests check ``|y - y_exact| ≤ 2^-8 |y_exact| + K · 2^-23 · Σ|x||w|`` against
an fp64 product.
Non-finite activations give non-finite outputs in both, though Inf against NaN may differ.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from specpilot.kernels.gemm_common import (
    MAX_SPLIT_K,
    GemmConfig,
    _bf16_to_f32,
    _block_m,
    _dense_step,
    _load_w,
    _load_x,
    _split,
    _store_tile,
    _tile,
    _x_operand,
    counter_buffer,
    default_config,
    outputs,
)
from specpilot.kernels.w12_decode import (
    _bits_to_operand,
    _decode_ops,
    _decode_prmt,
    decode_tile_bits_ops,
    decode_tiles_bf16_ptx,
)
from specpilot.kernels.w12_escapes import escape_dots
from specpilot.mechanisms.w12_format import ESC_ROWS, ESCAPE, GROUP, W12Tensor, decode

ESC_CHUNK = 32
"""Escape records handled per inner step (the K size of the correction ``tl.dot``)."""


@triton.jit
def _w12_half(
    acc, kc, k_hi, offs_m, offs_n, m_ok, n_ok, x_ptr, stride_xm, sm_ptr, cb, stride_sm, base_col,
    HIGH: tl.constexpr, USE_DOT: tl.constexpr, EVEN: tl.constexpr, PRMT: tl.constexpr,
    W_AS_A: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """Half a code group: the 32 columns ``kc`` whose codes are the low (or ``HIGH``) nibbles of
    ``cb [BN, 32]``; decode them and accumulate ``x[:, kc] @ w[:, kc]^T``."""
    x = _load_x(x_ptr, offs_m, m_ok, stride_xm, kc, k_hi)  # [BM, 32]
    sm = _load_w(sm_ptr + offs_n[:, None] * stride_sm + kc[None, :], n_ok, kc, k_hi, EVEN)
    if PRMT:  # GPU only: the interpreter cannot run inline PTX
        w = _decode_prmt(sm, cb, base_col * 0x800080, HIGH)  # [BN, 32] bf16
    else:
        bits = _decode_ops(sm, cb, base_col, HIGH)  # [BN, 32]
        if USE_DOT:
            w = _bits_to_operand(bits, INTERPRET)
        else:
            w = bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
    if PRMT and not USE_DOT:  # one row on the GPU: the hardware bf16 -> fp32 conversion (exact)
        acc += w.to(tl.float32) * x.to(tl.float32)
    else:
        acc = _dot_acc(acc, x, w, USE_DOT, W_AS_A, INTERPRET)
    return acc


@triton.jit
def _dot_acc(acc, x, w, USE_DOT: tl.constexpr, W_AS_A: tl.constexpr, INTERPRET: tl.constexpr):
    """``acc += x @ w^T`` for a decoded bf16 tile ``w [BN, C]`` and ``x [BM, C]`` (``W_AS_A``:
    ``acc^T += w @ x^T``; no dot: the one-row FMA path)."""
    if USE_DOT and W_AS_A:
        acc = tl.dot(w, tl.trans(_x_operand(x, INTERPRET)), acc)
    elif USE_DOT:
        acc = tl.dot(_x_operand(x, INTERPRET), tl.trans(w), acc)
    else:
        acc += _bf16_to_f32(w) * _bf16_to_f32(x)
    return acc


@triton.jit
def _v3_group(
    acc, kg, k_hi, offs_m, offs_n, m_ok, n_ok, x_ptr, stride_xm, sm_ptr, cb, stride_sm, base_col,
    USE_DOT: tl.constexpr, EVEN: tl.constexpr, PRMT: tl.constexpr, W_AS_A: tl.constexpr,
    GROUP: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """One 64-column group in layout v3: decode both halves from ``cb [BN, 32]`` and the two
    ``sm`` half tiles together (``w12_decode``), accumulate both."""
    HALF: tl.constexpr = GROUP // 2
    kc = kg + tl.arange(0, HALF)  # [32] columns of the first half
    sm_ptrs = sm_ptr + offs_n[:, None] * stride_sm + kc[None, :]
    w_mask = n_ok[:, None] & (kc[None, :] < k_hi)
    if EVEN:
        lo = tl.load(sm_ptrs)
        hi = tl.load(sm_ptrs + HALF)
    else:  # columns past K are zero bytes of the padded rows: only rows and the split bound
        lo = tl.load(sm_ptrs, mask=w_mask, other=0)
        hi = tl.load(sm_ptrs + HALF, mask=n_ok[:, None] & (kc[None, :] + HALF < k_hi), other=0)
    x_lo = _load_x(x_ptr, offs_m, m_ok, stride_xm, kc, k_hi)  # [BM, 32]
    x_hi = tl.load(
        x_ptr + offs_m[:, None] * stride_xm + kc[None, :] + HALF,
        mask=m_ok[:, None] & (kc[None, :] + HALF < k_hi),
        other=0.0,
    )
    if PRMT:  # GPU only: the interpreter cannot run inline PTX
        base4 = base_col * 0x01010101  # [BN, 1]
        w_lo, w_hi = decode_tiles_bf16_ptx(lo, hi, cb, base4)
    else:  # plain ops: the partner columns' bytes (k ^ 1) carry each weight's sign
        pk = (kc ^ 1)[None, :]
        p_lo = tl.load(sm_ptr + offs_n[:, None] * stride_sm + pk, mask=n_ok[:, None], other=0)
        p_hi = tl.load(sm_ptr + offs_n[:, None] * stride_sm + pk + HALF, mask=n_ok[:, None],
                       other=0)  # fmt: skip
        b_lo = decode_tile_bits_ops(lo, p_lo, cb, base_col, False)
        b_hi = decode_tile_bits_ops(hi, p_hi, cb, base_col, True)
        w_lo = _bits_to_operand(b_lo, INTERPRET)
        w_hi = _bits_to_operand(b_hi, INTERPRET)
        if not USE_DOT:
            w_lo = b_lo.to(tl.int16).to(tl.bfloat16, bitcast=True)
            w_hi = b_hi.to(tl.int16).to(tl.bfloat16, bitcast=True)
    acc = _dot_acc(acc, x_lo, w_lo, USE_DOT, W_AS_A, INTERPRET)
    return _dot_acc(acc, x_hi, w_hi, USE_DOT, W_AS_A, INTERPRET)


@triton.jit
def _k_step(
    acc, k0, k_hi, offs_m, offs_n, m_ok, n_ok, x_ptr, stride_xm, w_ptr, sm_ptr, codes_ptr,
    K, stride_sm, codes_k, base_col, W12: tl.constexpr, V3: tl.constexpr, USE_DOT: tl.constexpr,
    EVEN: tl.constexpr, PRMT: tl.constexpr, W_AS_A: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """One ``BLOCK_K`` step of the dense loop: load x and the weight tile, decode, accumulate."""
    if W12:  # BLOCK_K // GROUP code groups, each two halves of GROUP // 2 columns
        HALF: tl.constexpr = GROUP // 2
        for g in tl.static_range(BLOCK_K // GROUP):
            kg = k0 + g * GROUP
            kc = kg + tl.arange(0, HALF)  # [32] columns of the low-nibble half
            cb_ptrs = (
                codes_ptr + offs_n[:, None] * codes_k + (kg // 2 + tl.arange(0, HALF))[None, :]
            )
            cb = _load_w(cb_ptrs, n_ok, kc, k_hi, EVEN)  # [BN, 32] uint8
            if V3:
                acc = _v3_group(
                    acc, kg, k_hi, offs_m, offs_n, m_ok, n_ok, x_ptr, stride_xm, sm_ptr, cb,
                    stride_sm, base_col, USE_DOT, EVEN, PRMT, W_AS_A, GROUP, INTERPRET,
                )  # fmt: skip
            else:
                acc = _w12_half(
                    acc, kc, k_hi, offs_m, offs_n, m_ok, n_ok, x_ptr, stride_xm, sm_ptr, cb,
                    stride_sm, base_col, False, USE_DOT, EVEN, PRMT, W_AS_A, INTERPRET,
                )  # fmt: skip
                acc = _w12_half(
                    acc, kc + HALF, k_hi, offs_m, offs_n, m_ok, n_ok, x_ptr, stride_xm, sm_ptr,
                    cb, stride_sm, base_col, True, USE_DOT, EVEN, PRMT, W_AS_A, INTERPRET,
                )  # fmt: skip
    else:
        acc = _dense_step(
            acc, k0, k_hi, offs_m, offs_n, m_ok, n_ok, x_ptr, stride_xm, w_ptr, K,
            USE_DOT, EVEN, BLOCK_K, INTERPRET,
        )  # fmt: skip
    return acc


@triton.jit(do_not_specialize=["M", "base", "split"])  # one compile serves every M <= BLOCK_M
def _linear_kernel(
    x_ptr,  # [M, K] bf16, row stride stride_xm
    w_ptr,  # [N, K] bf16 (W12=False)
    sm_ptr,  # [N, K] uint8 (W12=True)
    codes_ptr,  # [N, codes_k] uint8, codes_k = ceil(K/64) * 32
    base_ptr,  # [1] int32: the W12 base (loaded, see below)
    off_ptr,  # [ceil(N/16) + 1] int32
    rec_ptr,  # [n_esc] int32
    val_ptr,  # [n_esc] bf16: the escaped weights (V3)
    bias_ptr,  # [N] bf16 (HAS_BIAS)
    y_ptr,  # [M, N] bf16, row stride stride_ym
    part_ptr,  # [split, M, N] fp32 (split > 1)
    count_ptr,  # [tiles] int32, zero between calls (split > 1)
    M,
    N,
    K,
    stride_xm,
    stride_ym,
    stride_sm,  # sm row stride: Kp
    codes_k,
    base,
    k_split,  # columns per split, a multiple of BLOCK_K
    split,  # number of splits (grid dim 2)
    W12: tl.constexpr,
    V3: tl.constexpr,  # W12 byte layout v3 (w12_decode), else v2
    PRMT: tl.constexpr,  # W12 decode with inline PTX byte permutes (GPU), else plain Triton ops
    W_AS_A: tl.constexpr,  # W12 tile as the dot's A operand (accumulate y^T), else as B
    HAS_BIAS: tl.constexpr,
    USE_DOT: tl.constexpr,
    EVEN: tl.constexpr,  # N % BLOCK_N == 0 and K % k_split == 0: no N/K masks in the loop
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
    ESC_BLOCK_ROWS: tl.constexpr,
    ESC_STEP: tl.constexpr,
    MAX_SPLIT: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    pid_m, pid_n, pid_k, offs_m, offs_n, m_ok, n_ok, k_lo, k_hi = _tile(
        M, N, K, k_split, BLOCK_M, BLOCK_N
    )
    if W12:  # a loaded tensor, not a splat of the scalar argument: Triton then moves the decode
        # into the MMA operand layout (after the shared-memory load) instead of decoding in a
        # blocked layout and converting through shared memory with barriers
        base_col = tl.load(base_ptr + offs_n * 0)[:, None]  # [BN, 1] int32, all equal to base
    else:
        base_col = tl.zeros((BLOCK_N, 1), dtype=tl.int32)

    if USE_DOT and W12 and W_AS_A:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    elif USE_DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    elif W12:  # BLOCK_M == 1: per-lane partial sums, reduced once after the loop
        acc = tl.zeros((BLOCK_N, GROUP // 2), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    if INTERPRET:  # the CPU interpreter cannot take a runtime range() bound (numpy >= 2)
        k0 = k_lo
        while k0 < k_hi:
            acc = _k_step(
                acc, k0, k_hi, offs_m, offs_n, m_ok, n_ok, x_ptr, stride_xm, w_ptr, sm_ptr,
                codes_ptr, K, stride_sm, codes_k, base_col, W12, V3, USE_DOT, EVEN, PRMT, W_AS_A,
                BLOCK_K, GROUP, INTERPRET,
            )  # fmt: skip
            k0 += BLOCK_K
    else:  # a for loop, so that Triton software-pipelines the loads (num_stages)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            acc = _k_step(
                acc, k0, k_hi, offs_m, offs_n, m_ok, n_ok, x_ptr, stride_xm, w_ptr, sm_ptr,
                codes_ptr, K, stride_sm, codes_k, base_col, W12, V3, USE_DOT, EVEN, PRMT, W_AS_A,
                BLOCK_K, GROUP, INTERPRET,
            )  # fmt: skip
    if not USE_DOT:
        acc = tl.reshape(tl.sum(acc, axis=1), (BLOCK_M, BLOCK_N))
    elif W12 and W_AS_A:
        acc = tl.trans(acc)  # [BM, BN]

    if W12:  # remove the placeholders' products, then add the escaped weights'
        acc = escape_dots(
            acc, pid_n, offs_m, offs_n, m_ok, N, K, k_lo, k_hi, base, x_ptr, stride_xm,
            off_ptr, rec_ptr, val_ptr, sm_ptr, stride_sm, V3, USE_DOT, BLOCK_M, BLOCK_N,
            ESC_BLOCK_ROWS, ESC_STEP, INTERPRET,
        )  # fmt: skip

    _store_tile(
        acc, y_ptr, y_ptr, bias_ptr, part_ptr, count_ptr, offs_m, offs_n, m_ok, n_ok, stride_ym,
        0, M, N, pid_m, pid_n, pid_k, split, False, HAS_BIAS, MAX_SPLIT, INTERPRET,
    )  # fmt: skip


def _launch(
    x: Tensor,  # [M, K] bf16
    n: int,
    w_bf16: Tensor | None,  # [N, K] bf16
    w12: W12Tensor | None,
    bias: Tensor | None,  # [N]
    counters: Tensor,  # [tiles] int32
    cfg: GemmConfig,
    prmt: bool,
) -> Tensor:  # [M, N] bf16
    m, k = x.shape
    if x.dtype != torch.bfloat16 or x.stride(1) != 1:
        raise ValueError("x must be bf16 with unit stride along K")
    if not cfg.use_dot and m != 1:
        raise ValueError("the FMA GEMV config (use_dot=False) takes one row")
    bm = _block_m(m, cfg)
    split, k_split = _split(m, n, k, cfg, x.device)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, bm), split)
    y, part = outputs(m, n, grid, counters, x.device)  # [M, N], [split, M, N]
    even = n % cfg.block_n == 0 and k % k_split == 0
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if w12 is not None:
        if cfg.block_k % GROUP:
            raise ValueError(f"W12 needs block_k a multiple of {GROUP}, got {cfg.block_k}")
        sm, codes, offs, recs, base = w12.sm, w12.codes, w12.esc_offsets, w12.esc_records, w12.base
        base_t, vals = w12.base_t, w12.esc_values
        w_arg: Tensor = sm
        if recs.numel() == 0:
            recs, vals = offs, x  # never read (every CSR range is empty) but valid pointers
    else:
        assert w_bf16 is not None
        w_arg, sm, codes, offs, recs, vals, base = w_bf16, x, x, x, x, x, 0
        base_t = counters
    _linear_kernel[grid](
        x, w_arg, sm, codes, base_t, offs, recs, vals,
        bias if bias is not None else x, y, part, counters,
        m, n, k, x.stride(0), y.stride(0), sm.stride(0), codes.shape[-1], base, k_split, split,
        W12=w12 is not None, V3=w12 is not None and w12.layout == "v3",
        PRMT=prmt and not interpret, W_AS_A=cfg.w_as_a, HAS_BIAS=bias is not None,
        USE_DOT=cfg.use_dot, EVEN=even, BLOCK_M=bm, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP=GROUP, ESC_BLOCK_ROWS=ESC_ROWS, ESC_STEP=ESC_CHUNK, MAX_SPLIT=MAX_SPLIT_K,
        INTERPRET=interpret,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return y


def w12_matmul(
    x: Tensor,  # [M, K] bf16
    w: W12Tensor,  # [N, K]
    counters: Tensor,  # from counter_buffer(N)
    bias: Tensor | None = None,  # [N] bf16
    cfg: GemmConfig | None = None,
    prmt: bool = True,
) -> Tensor:  # [M, N] bf16
    """``x @ decode(w)^T (+ bias)`` with the weights decoded in registers (``prmt``: with byte
    permutes in inline PTX on the GPU; ``False`` or the interpreter: plain Triton integer ops)."""
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has K = {x.shape[-1]}, the weight has K = {k}")
    cfg = cfg or default_config(x.shape[0], n, k)
    return _launch(x, n, None, w, bias, counters, cfg, prmt)


def bf16_matmul(
    x: Tensor,  # [M, K] bf16
    w: Tensor,  # [N, K] bf16 contiguous
    counters: Tensor,
    bias: Tensor | None = None,
    cfg: GemmConfig | None = None,
) -> Tensor:  # [M, N] bf16
    """The same kernel reading plain bf16 weights: the baseline for the cost of decoding."""
    n, k = w.shape
    if not w.is_contiguous():
        raise ValueError("w must be contiguous [N, K]")
    cfg = cfg or default_config(x.shape[0], n, k)
    return _launch(x, n, w, None, bias, counters, cfg, False)


def w12_matmul_reference(x: Tensor, w: W12Tensor, bias: Tensor | None = None) -> Tensor:
    """Torch reference: decode to bf16, then ``F.linear``."""
    return F.linear(x, decode(w), bias)


__all__ = [
    "ESCAPE",
    "GemmConfig",
    "bf16_matmul",
    "counter_buffer",
    "default_config",
    "w12_matmul",
    "w12_matmul_reference",
]
