"""How a split-KV decode-attention launch is tiled (``decode_attn.py``), in plain Python: the
kernel's wrapper and its cost model (``mechanisms/decode_attn_cost.py``) share it, and the cost
model imports no Triton."""

from __future__ import annotations

from dataclasses import dataclass, replace

MAX_SPLITS = 64
"""Upper bound on key splits per (sequence, KV head): bounds the partials one program merges."""
MAX_ROWS = 64
"""Most query rows ``G*W`` per program (the decode and verify widths; a prefill chunk is wider
and keeps SDPA, which is compute-bound there anyway)."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclass(frozen=True, slots=True)
class DecodeAttnConfig:
    """Tiling of one launch (the mechanism's knobs)."""

    keys_per_split: int = 0
    """Keys per split (rounded up to ``block_n``); 0 picks enough splits to give every SM about
    two programs, but no fewer than ``4 * G * W`` keys per split (a split's fp32 partial is
    ``G*W*D*4`` bytes, written and read once, against ``L*D*4`` bytes of bf16 K and V)."""
    block_n: int = 0
    """Keys per inner step (power of two, >= 16); 0: by the launch's query rows
    (:func:`tiling_for_rows`). 32 with 4 warps keeps every bf16 width up to 64 query rows free of
    spills on sm_90 (ptxas: 168-242 registers); 64 spills at 4 warps."""
    num_warps: int = 0
    """0: by the launch's query rows (:func:`tiling_for_rows`)."""
    num_stages: int = 2

    def __post_init__(self) -> None:
        if self.block_n and (self.block_n < 16 or self.block_n & (self.block_n - 1)):
            raise ValueError(f"block_n must be 0 or a power of two >= 16, got {self.block_n}")
        if self.keys_per_split < 0:
            raise ValueError(f"keys_per_split must be >= 0, got {self.keys_per_split}")
        if self.num_warps not in (0, 1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be 0 or a power of two <= 16, got {self.num_warps}")

    def for_rows(self, rows: int) -> DecodeAttnConfig:
        """This tiling with its automatic fields (0) resolved for ``rows = G*W`` query rows."""
        if self.block_n and self.num_warps:
            return self
        bn, nw = tiling_for_rows(rows)
        return replace(self, block_n=self.block_n or bn, num_warps=self.num_warps or nw)


def tiling_for_rows(rows: int) -> tuple[int, int]:
    """``(block_n, num_warps)`` the H200 measured best at ``rows = G*W`` query rows
    (``bench/decode_attn_gpu.py``, docs/BENCHMARKS.md, sixth session, contexts 128-4096): 4 rows
    (an AR step at GQA group 4): 64 keys, 2 warps (1.3-1.8x the former 32 keys / 4 warps); 32
    rows (a width-8 verify): 64 keys, 8 warps (x1.05-1.16); 64 rows: 32 keys, 4 warps (64 / 8 was
    slower there). Rows in between take the next measured width's tiling (not measured)."""
    if rows <= 4:
        return 64, 2
    if rows <= 32:
        return 64, 8
    return 32, 4


DEFAULT_CONFIG = DecodeAttnConfig()


def block_m(rows: int) -> int:
    """Query rows ``G*W`` padded for ``tl.dot`` (at least 16)."""
    return max(16, next_power_of_2(rows))


def block_d(head_dim: int) -> int:
    return max(16, next_power_of_2(head_dim))


def split_plan(
    attn_len: int, batch: int, kv_heads: int, rows: int, cfg: DecodeAttnConfig, num_sms: int
) -> tuple[int, int]:
    """``(splits, keys_per_split)`` of a launch over ``attn_len`` keys (``rows`` = ``G*W``).
    Depends only on the launch shape, never on the device lengths: fixed per CUDA-graph key."""
    bn = cfg.for_rows(rows).block_n
    tiles = max(1, cdiv(attn_len, bn))
    if cfg.keys_per_split:
        per = cdiv(cfg.keys_per_split, bn)
    else:
        want = max(1, cdiv(2 * num_sms, batch * kv_heads))
        per = max(cdiv(tiles, want), cdiv(4 * rows, bn))
    per = max(per, cdiv(tiles, MAX_SPLITS))
    split_len = per * bn
    return cdiv(max(attn_len, 1), split_len), split_len


def valid_splits(end: int, split_len: int) -> int:
    """Splits that do work for a row whose block sees keys ``< end`` (the others exit)."""
    return max(1, cdiv(end, split_len))


__all__ = [
    "DEFAULT_CONFIG",
    "MAX_ROWS",
    "MAX_SPLITS",
    "DecodeAttnConfig",
    "block_d",
    "block_m",
    "cdiv",
    "next_power_of_2",
    "split_plan",
    "valid_splits",
]
