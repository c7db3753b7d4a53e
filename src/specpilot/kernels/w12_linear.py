"""Which W12 kernel serves a call of M rows, with which tiling: the table to edit after a GPU run.

Two kernels read the W12 v3 layout (``mechanisms/w12_format.py``):

* ``gemv`` (``kernels/w12_gemv.py``): CUDA-core FMAs, weights read once for up to 4 rows, no
  data exchange between threads in the K loop; best where one FMA per weight and row is cheap
  next to the stream (M = 1, perhaps 2);
* ``dot`` (``kernels/w12_gemm.py``): ``tl.dot`` tiles with the decode in the MMA operand layout
  (M padded to 16 rows), for larger M.

``CHOSEN`` maps the largest M of a bucket to its kernel and tiling, plus the fraction of the
measured copy bandwidth that choice reached on the H200 (``roofline_frac``: the cost model's
``kernel efficiency`` for W12, ``costmodel/weight_format.py``), against the eager device copy
(``costmodel.hardware.copy_bandwidth``). The GEMV rows (M <= 2) are the tiling
``bench/gemv_sweep_gpu.py`` found best over 270 tilings on the H200 (2026-12-02, docs/BENCHMARKS.md,
"Sixth session": 16 rows × 1024 columns, 4 warps, within 0-7% of each shape's own best); the
``dot`` rows are ``bench/w12_gpu.py``'s proposal of 2026-12-01, their fractions rescaled from
that script's graph-captured copy probe (2.71 TB/s) to the eager one (4.29 TB/s), not
re-measured. M above 16 is not measured (``roofline_frac=None``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import Tensor

from specpilot.kernels.gemm_common import GemmConfig
from specpilot.kernels.w12_gemm import w12_matmul
from specpilot.kernels.w12_gemv import MAX_ROWS, GemvConfig, w12_gemv
from specpilot.mechanisms.w12_format import W12Tensor

KERNELS = ("gemv", "dot")


@dataclass(frozen=True, slots=True)
class KernelChoice:
    """The kernel and tiling for one M bucket, and what it measured."""

    kernel: str
    gemv: GemvConfig | None = None
    dot: GemmConfig | None = None
    roofline_frac: float | None = None
    """Achieved (weight + activation bytes) / time over the measured copy bandwidth, summed over
    the Llama-3-8B linear shapes; None: not measured yet."""
    by_shape: tuple[tuple[tuple[int, int], GemvConfig], ...] = ()
    """GEMV tilings for particular ``(N, K)`` weight shapes, where the sweep measured one that
    beats ``gemv`` by more than its noise; other shapes take ``gemv``."""

    def gemv_for(self, n: int, k: int, pdl: bool = False) -> GemvConfig | None:
        """The GEMV tiling for an ``[N, K]`` weight (None: this bucket runs ``dot``), launched
        with programmatic dependent launch if ``pdl`` (``kernels/pdl.py``)."""
        if self.gemv is None:
            return None
        g = dict(self.by_shape).get((n, k), self.gemv)
        return replace(g, pdl=True) if pdl else g

    def __post_init__(self) -> None:
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {self.kernel!r}")
        if (self.kernel == "gemv") != (self.gemv is not None) or (self.kernel == "dot") != (
            self.dot is not None
        ):
            raise ValueError("give exactly the config of the chosen kernel")


CHOSEN: tuple[tuple[int, KernelChoice], ...] = (
    (
        1,
        KernelChoice(
            "gemv",
            gemv=GemvConfig(block_n=16, block_k=1024),
            roofline_frac=0.767,
            # the 8B down projection (K = 14336): two K splits, 28.0 vs 29.9 us (2026-12-02)
            by_shape=(((4096, 14336), GemvConfig(block_n=16, block_k=1024, split_k=2)),),
        ),
    ),
    (2, KernelChoice("gemv", gemv=GemvConfig(block_n=16, block_k=1024), roofline_frac=0.574)),
    (
        4,
        KernelChoice(
            "dot",
            dot=GemmConfig(block_n=64, block_k=256, num_warps=4, num_stages=3),
            roofline_frac=0.375,
        ),
    ),
    (
        8,
        KernelChoice(
            "dot",
            dot=GemmConfig(block_n=64, block_k=256, num_warps=4, num_stages=3),
            roofline_frac=0.374,
        ),
    ),
    (
        16,
        KernelChoice(
            "dot",
            dot=GemmConfig(block_n=64, block_k=256, num_warps=4, num_stages=3),
            roofline_frac=0.358,
        ),
    ),
    (64, KernelChoice("dot", dot=GemmConfig(block_n=64, block_k=128, num_warps=4, num_stages=3))),
)
"""(largest M of the bucket, choice), ascending; M above the last bucket uses the last."""


def choice_for(m: int, table: tuple[tuple[int, KernelChoice], ...] = CHOSEN) -> KernelChoice:
    for top, choice in table:
        if m <= top:
            if choice.kernel == "gemv" and m > MAX_ROWS:
                raise ValueError(f"the GEMV takes at most {MAX_ROWS} rows; fix the table")
            return choice
    return table[-1][1]


def w12_linear(
    x: Tensor,  # [M, K] bf16
    w: W12Tensor,  # [N, K], layout v3
    counters: Tensor,  # from gemm_common.counter_buffer(N)
    bias: Tensor | None = None,  # [N] bf16
    ptx: bool = True,
    pdl: bool = False,
) -> Tensor:  # [M, N] bf16
    """``x @ decode(w)^T (+ bias)`` with the kernel ``CHOSEN`` names for ``M`` (``pdl``: the
    GEMV with programmatic dependent launch, ``kernels/pdl.py``)."""
    c = choice_for(x.shape[0])
    g = c.gemv_for(*w.shape, pdl=pdl)
    if g is not None:
        return w12_gemv(x, w, counters, bias, cfg=g, ptx=ptx)
    return w12_matmul(x, w, counters, bias, cfg=c.dot, prmt=ptx)


__all__ = ["CHOSEN", "KernelChoice", "choice_for", "w12_linear"]
