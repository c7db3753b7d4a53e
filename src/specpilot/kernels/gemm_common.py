"""What the small-M matmul kernels here share (``w12_gemm``, ``w12_gemv``, ``int8_gemm``,
``fused_gemv`` and the exact head's certificate kernels): the output tile of a program, the K step
over a plain bf16 or int8 weight, the split-K epilogue with its arrival counters, the bf16
conversions that are exact in the interpreter too, and the launch arithmetic (tilings, how many K
splits).

Split-K: each split writes its fp32 partial; an atomic per-tile counter (``acq_rel``) elects the
last split, which sums the partials in split order (deterministic), applies the per-column scale,
adds the bias or residual, rounds once and re-arms the counter, so a product is one launch and the
counters need no memset between calls (``counter_buffer``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from specpilot.mechanisms.w12_format import ESC_ROWS

MAX_SPLIT_K = 16
"""Upper bound on K splits (the last split sums at most this many partials, unrolled)."""
MAX_COUNTER_TILES_M = 4
"""Split-K is used only for M <= 64 (= 4 tiles of 16 rows at most): sizes the counter buffer."""


@triton.jit
def _bits_to_f32(bits):
    """bf16 bit patterns (int32, low 16 bits) -> the same values in fp32, exactly."""
    return (bits << 16).to(tl.float32, bitcast=True)


@triton.jit
def _bf16_to_f32(v):
    """bf16 -> fp32 by moving bits (exact; also right in the interpreter, whose casts are not)."""
    return _bits_to_f32(v.to(tl.int16, bitcast=True).to(tl.int32))


@triton.jit
def _x_operand(x, INTERPRET: tl.constexpr):
    if INTERPRET:
        return _bf16_to_f32(x)
    return x


@triton.jit
def _w_operand(w, INTERPRET: tl.constexpr):
    """A plain weight tile as a ``tl.dot`` operand: bf16 as it is, int8 codes as bf16 (every
    integer in [-127, 127] is exact in bf16); fp32 in the interpreter (exact too)."""
    if w.dtype == tl.int8:
        if INTERPRET:  # noqa: SIM108 (one return after full if/else: see _out_cast)
            op = w.to(tl.float32)
        else:
            op = w.to(tl.bfloat16)
    else:
        op = _x_operand(w, INTERPRET)
    return op


@triton.jit
def _w_f32(w):
    """A plain weight tile (bf16 or int8 codes) in fp32, exactly."""
    if w.dtype == tl.int8:  # noqa: SIM108 (one return after full if/else: see _out_cast)
        v = w.to(tl.float32)
    else:
        v = _bf16_to_f32(w)
    return v


@triton.jit
def _load_x(x_ptr, offs_m, m_ok, stride_xm, cols, k_hi):
    """``x [BM, C]`` at the columns ``cols [C]``, zero past M and past ``k_hi``."""
    mask = m_ok[:, None] & (cols[None, :] < k_hi)
    return tl.load(x_ptr + offs_m[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)


@triton.jit
def _load_w(ptrs, n_ok, cols, k_hi, EVEN: tl.constexpr):
    """A weight tile ``[BN, C]`` at ``ptrs`` (columns ``cols [C]``): unmasked when ``EVEN`` (the
    tiles cover N and the split bound), else zero past N and past ``k_hi``."""
    if EVEN:
        w = tl.load(ptrs)
    else:
        w = tl.load(ptrs, mask=n_ok[:, None] & (cols[None, :] < k_hi), other=0)
    return w


@triton.jit
def _dense_step(
    acc, k0, k_hi, offs_m, offs_n, m_ok, n_ok, x_ptr, stride_xm, w_ptr, K,
    USE_DOT: tl.constexpr, EVEN: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """One ``BLOCK_K`` step over a plain ``[N, K]`` weight (bf16, or int8 codes): load
    ``x [BM, BK]`` and ``w [BN, BK]``, accumulate ``x @ w^T`` in fp32 (``USE_DOT=False``, one
    row: FMAs into a ``[BN, BK]`` accumulator, reduced by the caller after the loop)."""
    ks = k0 + tl.arange(0, BLOCK_K)  # [BK]
    x = _load_x(x_ptr, offs_m, m_ok, stride_xm, ks, k_hi)  # [BM, BK]
    w = _load_w(w_ptr + offs_n[:, None] * K + ks[None, :], n_ok, ks, k_hi, EVEN)  # [BN, BK]
    if USE_DOT:
        acc = tl.dot(_x_operand(x, INTERPRET), tl.trans(_w_operand(w, INTERPRET)), acc)
    else:  # BLOCK_M == 1
        acc += _w_f32(w) * _bf16_to_f32(x)
    return acc


@triton.jit
def _f32_to_bf16(v, INTERPRET: tl.constexpr):
    """Round to nearest even (the interpreter's own cast rounds half up and drops carries)."""
    if INTERPRET:
        b = v.to(tl.int32, bitcast=True)
        r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        is_nan = v != v
        r = tl.where(is_nan, (b >> 16) | 0x40, r)  # keep NaN a (quiet) NaN
        return r.to(tl.int16).to(tl.bfloat16, bitcast=True)
    return v.to(tl.bfloat16)


@triton.jit
def _out_cast(v, y_ptr, INTERPRET: tl.constexpr):
    """An fp32 tile in the output's dtype: kept fp32 for an fp32 ``y``, else rounded to bf16.
    One return after a full if/else: Triton 3.6 also compiles the statements after a
    compile-time ``if`` whose branch returns, and then rejects the two return types."""
    if y_ptr.dtype.element_ty == tl.float32:  # noqa: SIM108 (the form Triton 3.6 compiled)
        out = v
    else:
        out = _f32_to_bf16(v, INTERPRET)
    return out


@triton.jit
def _tile(M, N, K, k_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's output tile (grid: N tiles, M tiles, K splits): program ids, row and column
    offsets ``[BM]``, ``[BN]`` with their bounds masks, and its K range ``[k_lo, k_hi)``."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    k_lo = pid_k * k_split
    k_hi = tl.minimum(k_lo + k_split, K)
    return pid_m, pid_n, pid_k, offs_m, offs_n, offs_m < M, offs_n < N, k_lo, k_hi


@triton.jit
def _store_tile(
    acc, scale_ptr, y_ptr, bias_ptr, part_ptr, count_ptr, offs_m, offs_n, m_ok, n_ok, stride_ym,
    stride_bm, M, N, pid_m, pid_n, pid_k, split,
    HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, MAX_SPLIT: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    """Write one ``[BM, BN]`` fp32 tile as bf16 (fp32 for an fp32 ``y``) (× per-column scale,
    + bias). With split-K it is stored as a partial; the last split to arrive sums every partial
    in split order (so the result is deterministic), finishes the tile and re-arms the tile's
    counter. ``stride_bm``: the bias's row stride, 0 for a ``[N]`` bias; an ``[M, N]`` addend (a
    residual, added in fp32 before the one rounding, as ``torch.addmm`` does) has its row stride
    there."""
    out_mask = m_ok[:, None] & n_ok[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    b_ptrs = bias_ptr + offs_m[:, None] * stride_bm + offs_n[None, :]
    if split == 1:
        if HAS_SCALE:
            acc = acc * tl.load(scale_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
        if HAS_BIAS:
            acc += _bf16_to_f32(tl.load(b_ptrs, mask=out_mask, other=0.0))
        tl.store(y_ptrs, _out_cast(acc, y_ptr, INTERPRET), mask=out_mask)
    else:
        tile_off = offs_m[:, None] * N + offs_n[None, :]
        tl.store(part_ptr + pid_k * M * N + tile_off, acc, mask=out_mask)
        tile = pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
        if arrived == split - 1:  # the last split of this tile: reduce in a fixed order
            total = tl.zeros(acc.shape, dtype=tl.float32)
            for s in tl.static_range(MAX_SPLIT):
                if s < split:
                    total += tl.load(
                        part_ptr + s * M * N + tile_off,
                        mask=out_mask,
                        other=0.0,
                        cache_modifier=".cg",
                    )
            if HAS_SCALE:
                total = total * tl.load(scale_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
            if HAS_BIAS:
                total += _bf16_to_f32(tl.load(b_ptrs, mask=out_mask, other=0.0))
            tl.store(y_ptrs, _out_cast(total, y_ptr, INTERPRET), mask=out_mask)
            tl.atomic_xchg(count_ptr + tile, 0)


@dataclass(frozen=True, slots=True)
class GemmConfig:
    """Tiling of one launch (the same for the bf16 and the W12 kernel)."""

    block_n: int = 64
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 0
    """Number of K splits; 0 picks enough to give every SM about two programs."""
    use_dot: bool = True
    """False: one-row FMA GEMV (only used when M == 1)."""
    w_as_a: bool = False
    """W12 only: the decoded weight tile is the dot's A operand (``acc^T += w @ x^T``), which lets
    Hopper's ``wgmma`` read it from registers; False: the B operand (``acc += x @ w^T``)."""

    def __post_init__(self) -> None:
        check_tiling(self.block_n, self.block_k, 32)


def check_tiling(block_n: int, block_k: int, min_k: int) -> None:
    """Tiles cover whole 16-row escape blocks and a power-of-two number of columns."""
    if block_n % ESC_ROWS or block_n < ESC_ROWS:
        raise ValueError(f"block_n must be a multiple of {ESC_ROWS}, got {block_n}")
    if block_k < min_k or block_k & (block_k - 1):
        raise ValueError(f"block_k must be a power of two >= {min_k}, got {block_k}")


def default_config(m: int, n: int, k: int) -> GemmConfig:
    """A reasonable tiling before any tuning (the GPU script measures alternatives)."""
    if m == 1:
        return GemmConfig(block_n=32, block_k=256, num_warps=4, use_dot=False)
    if m <= 16:
        return GemmConfig(block_n=64, block_k=256, num_warps=4)
    return GemmConfig(block_n=64, block_k=128, num_warps=4)


def _block_m(m: int, cfg: GemmConfig) -> int:
    if not cfg.use_dot:
        return 1
    return min(64, max(16, triton.next_power_of_2(m)))


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return 4


def _split(m: int, n: int, k: int, cfg: GemmConfig, device: torch.device) -> tuple[int, int]:
    """``(split, k_split)`` with ``k_split`` a multiple of ``block_k``."""
    tiles = triton.cdiv(n, cfg.block_n) * triton.cdiv(m, _block_m(m, cfg))
    if m > 16 * MAX_COUNTER_TILES_M:
        want = 1
    elif cfg.split_k:
        want = cfg.split_k
    else:
        want = max(1, (2 * _num_sms(device)) // tiles)
    return k_splits(k, cfg.block_k, want)


def k_splits(k: int, block_k: int, want: int) -> tuple[int, int]:
    """``(split, k_split)``: about ``want`` K ranges (at most ``MAX_SPLIT_K``, at least one
    ``block_k`` each), ``k_split`` a multiple of ``block_k``."""
    want = max(1, min(want, triton.cdiv(k, block_k), MAX_SPLIT_K))
    k_split = triton.cdiv(triton.cdiv(k, want), block_k) * block_k
    return triton.cdiv(k, k_split), k_split


def outputs(
    m: int, n: int, grid: tuple[int, int, int], counters: Tensor, device: torch.device,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``(y [M, N], partials [split, M, N] fp32)`` of a launch on ``grid`` (N tiles, M tiles,
    splits); for one split a never-written fp32 stand-in (``counters``) keeps one kernel
    specialization. Checks that the counters cover the grid's tiles."""
    split = grid[2]
    if split > 1 and grid[0] * grid[1] > counters.numel():
        raise ValueError("counter buffer too small for this split-K launch")
    y = torch.empty(m, n, dtype=dtype, device=device)
    if split > 1:
        return y, torch.empty(split, m, n, dtype=torch.float32, device=device)
    return y, counters.view(torch.float32)


def counter_buffer(n: int, device: torch.device) -> Tensor:  # [tiles] int32 zeros
    """Split-K arrival counters for one weight (any config with block_n >= 16, M <= 64)."""
    return torch.zeros(
        triton.cdiv(n, ESC_ROWS) * MAX_COUNTER_TILES_M, dtype=torch.int32, device=device
    )


__all__ = [
    "MAX_COUNTER_TILES_M",
    "MAX_SPLIT_K",
    "GemmConfig",
    "check_tiling",
    "counter_buffer",
    "default_config",
    "k_splits",
    "outputs",
]
