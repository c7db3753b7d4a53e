"""Stream-K for the small-M tensor-core kernels (``kernels/w12_mma.py``): a grid of ``n_prog``
programs (a few per SM) shares the ``n_it = tiles * steps`` K steps of a product equally, so
every SM streams the same number of weight bytes whatever the tile count.

Program ``p`` takes steps ``[p * n_it // n_prog, (p + 1) * n_it // n_prog)`` in tile-major order:
the tail of one tile, whole tiles, the head of another. A whole tile is stored directly; a tile
that several programs share is finished by the last of them to arrive (an ``acq_rel`` counter
per tile), which sums the partials **in program order** (deterministic: the partition depends
only on ``n_prog`` and ``n_it``) and re-arms the counter. Each program has at most two partial
slots: its first tile and its last.

Measured on the H100 (docs/figures/issue-26.md): 15-30% slower than the split-K grid on the
Llama-3-8B shapes, so the kernel search does not try it; ``MmaConfig.stream_k`` opts in.
"""

from __future__ import annotations

import triton
import triton.language as tl

from specpilot.kernels.gemm_common import _bf16_to_f32, _out_cast

MAX_SEGMENTS = 16
"""Most programs that may share one tile (the reducer's unrolled loop)."""
_MAX_SEGMENTS = tl.constexpr(MAX_SEGMENTS)


@triton.jit
def owner(it, n_it, n_prog):
    """The program whose step range holds step ``it``: the largest ``p`` with
    ``p * n_it // n_prog <= it``."""
    return ((it + 1) * n_prog - 1) // n_it


@triton.jit
def stream_store(
    acc, t, s_lo, s_hi, steps_t, n_it, pid, n_prog, y_ptr, bias_ptr, part_ptr, count_ptr, toks,
    rows, m_ok, r_ok, stride_ym, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, HAS_BIAS: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    """Store program ``pid``'s ``acc [BM, BR]`` over steps ``[s_lo, s_hi)`` of tile ``t``."""
    out_mask = m_ok[:, None] & r_ok[None, :]
    y_ptrs = y_ptr + toks[:, None] * stride_ym + rows[None, :]
    if HAS_BIAS:
        bias = _bf16_to_f32(tl.load(bias_ptr + rows, mask=r_ok, other=0.0))[None, :]
    if (s_lo == 0) & (s_hi == steps_t):  # the whole tile in this program
        if HAS_BIAS:
            acc += bias
        tl.store(y_ptrs, _out_cast(acc, y_ptr, INTERPRET), mask=out_mask)
    else:
        loc = tl.arange(0, BLOCK_M)[:, None] * BLOCK_R + tl.arange(0, BLOCK_R)[None, :]
        first_tile = (pid * n_it // n_prog) // steps_t
        slot = 2 * pid + (first_tile != t).to(tl.int32)  # 0: its first tile, 1: its last
        tl.store(part_ptr + slot * (BLOCK_M * BLOCK_R) + loc, acc)
        first = owner(t * steps_t, n_it, n_prog)
        last = owner(t * steps_t + steps_t - 1, n_it, n_prog)
        arrived = tl.atomic_add(count_ptr + t, 1, sem="acq_rel")
        if arrived == last - first:  # the last to arrive: sum in program order
            total = tl.zeros(acc.shape, dtype=tl.float32)
            for j in tl.static_range(_MAX_SEGMENTS):
                p = first + j
                if p <= last:
                    sl = 2 * p + ((p * n_it // n_prog) // steps_t != t).to(tl.int32)
                    total += tl.load(
                        part_ptr + sl * (BLOCK_M * BLOCK_R) + loc, cache_modifier=".cg"
                    )
            if HAS_BIAS:
                total += bias
            tl.store(y_ptrs, _out_cast(total, y_ptr, INTERPRET), mask=out_mask)
            tl.atomic_xchg(count_ptr + t, 0)


def programs(tiles: int, steps: int, sms: int, per_sm: int) -> int:
    """Programs for ``tiles`` tiles of ``steps`` K steps: ``per_sm`` per SM, at least one step
    each, and few enough that no tile is shared by more than ``MAX_SEGMENTS`` programs (each
    takes at least ``total // p`` steps: a tile meets at most ``ceil(steps / (total // p)) + 1``)."""
    total = tiles * steps
    p = max(1, min(per_sm * sms, total))
    while p > 1 and -(-steps // (total // p)) + 1 > MAX_SEGMENTS:
        p -= 1
    return p


__all__ = ["MAX_SEGMENTS", "owner", "programs", "stream_store"]
