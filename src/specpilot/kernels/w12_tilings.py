"""Tilings of the tensor-core W12 kernel (``kernels/w12_mma.py``): one config, and the table that
picks one per weight shape and M bucket.

``DEFAULT`` is the cold start, measured once on one H200 by ``bench/w12_mma_gpu.py`` (per M bucket,
over the Llama-3-8B shapes; docs/figures/issue-26.md). The table a deployment actually runs with
is the kernel search's (``tune/kernel_search.py``): measured on that GPU for that model's shapes
and widths, stored in the memory under the GPU's fingerprint and read back by the next tune and by
the engine config. No triton import here: the mechanisms read tilings on any machine.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

MAX_ROWS = 64
"""Largest M one launch takes (the split-K counters hold 4 tiles of 16 rows)."""
M_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
"""The widths a table distinguishes; M takes the smallest bucket >= M."""


@dataclass(frozen=True, slots=True)
class MmaConfig:
    """Tiling of one launch of the tensor-core W12 kernel."""

    block_r: int = 64
    """Weight rows per program (64 per warpgroup of 4 warps)."""
    block_k: int = 256
    """Columns per K step, a power of two >= 64 (four dots of ``block_k / 4``)."""
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 0
    """K splits; 0 picks enough to give every SM about two programs."""
    block_m: int = 0
    """Token tile (16, 32 or 64); 0: the smallest that holds M (at least 16)."""
    stream_k: int = 0
    """Programs per SM of a stream-K grid (``kernels/stream_k.py``: every SM streams the same
    number of K steps); 0: the split-K grid (``split_k``)."""
    inner_split: int = 1
    """Warp groups that share a row tile, each on its own half of every K step (1 or 2): two
    give the tile's 64 rows 8 warps (the MMA runs ``2 * block_r`` rows by ``2 *`` the token
    tile, whose two diagonal blocks are the halves' sums) with no fp32 partials in global
    memory, for shapes whose grids leave one warp per scheduler."""

    def __post_init__(self) -> None:
        if self.block_r % 64 or self.block_r < 64:
            raise ValueError(f"block_r must be a multiple of 64, got {self.block_r}")
        if self.block_k < 64 or self.block_k & (self.block_k - 1):
            raise ValueError(f"block_k must be a power of two >= 64, got {self.block_k}")
        if self.block_m not in (0, 16, 32, 64):
            raise ValueError(f"block_m must be 0, 16, 32 or 64, got {self.block_m}")
        if self.inner_split not in (1, 2):
            raise ValueError(f"inner_split must be 1 or 2, got {self.inner_split}")
        if self.block_k // self.inner_split < 64:
            raise ValueError("each inner split needs a K step of at least 64 columns")
        if self.num_warps * 16 > self.block_r * self.inner_split or self.num_warps % 4:
            raise ValueError("num_warps must be a multiple of 4 with 16 weight rows per warp")
        if not 0 <= self.split_k <= 16:
            raise ValueError(f"split_k must be in 0..16, got {self.split_k}")
        if not 0 <= self.stream_k <= 8:
            raise ValueError(f"stream_k must be in 0..8, got {self.stream_k}")

    def tokens(self, m: int) -> int:
        """The token tile for M rows."""
        if self.block_m:
            return self.block_m
        t = 16
        while t < min(m, MAX_ROWS):
            t *= 2
        return t


def bucket(m: int) -> int:
    for top in M_BUCKETS:
        if m <= top:
            return top
    raise ValueError(f"the W12 tensor-core kernel takes at most {MAX_ROWS} rows, got {m}")


DEFAULT: tuple[tuple[int, MmaConfig], ...] = tuple(
    (top, MmaConfig(block_r=64, block_k=256 if top <= 16 else 128, num_warps=4, num_stages=4))
    for top in M_BUCKETS
)
"""(largest M of the bucket, config): the cold start before any search on this GPU. On the H200
(bench/w12_mma_gpu.py, 2026-12-03) 64 rows x 256 columns, 4 warps, 4 stages was the best or
within 3% of it on each Llama-3-8B shape for M <= 16; 64 x 128 for M 32 and 64. On the H100
(2026-12-05, after the wgmma serialization fix) 64 x 256 with 4 stages won 15 of the 20 (shape,
M <= 16) cells; gate_up took 64 x 512 (2 stages) or 128 x 256 (8 warps) by 1-3%."""


@dataclass(frozen=True, slots=True)
class MmaTilings:
    """Per ``(N, K, M bucket)`` the config the kernel search measured best; other shapes take
    the per-bucket default."""

    by_shape: dict[tuple[int, int, int], MmaConfig] = field(default_factory=dict)
    default: tuple[tuple[int, MmaConfig], ...] = DEFAULT
    source: str = "default"
    """Where the table came from: ``default`` or ``search <fingerprint>``."""

    def config(self, m: int, n: int, k: int) -> MmaConfig:
        top = bucket(m)
        hit = self.by_shape.get((n, k, top))
        if hit is not None:
            return hit
        return next(c for t, c in self.default if t == top)

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "by_shape": [[n, k, m, asdict(c)] for (n, k, m), c in sorted(self.by_shape.items())],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MmaTilings:
        shapes = {(int(n), int(k), int(m)): MmaConfig(**c) for n, k, m, c in data["by_shape"]}
        return cls(by_shape=shapes, source=str(data.get("source", "search")))


DEFAULT_TILINGS = MmaTilings()

__all__ = [
    "DEFAULT",
    "DEFAULT_TILINGS",
    "MAX_ROWS",
    "M_BUCKETS",
    "MmaConfig",
    "MmaTilings",
    "bucket",
]
