"""Cost model of the fused decode GEMVs (``fused_gemv.py``): the time they take off a forward.

Per layer and fused matrix ``m`` (M <= max_m rows):

* kernels removed, each with its measured time and the launch gap after it inside the graph:
  ``w_qkv`` and ``w_gate_up`` one RMSNorm each; ``w_down`` the SiLU·mul; ``w_o`` and ``w_down``
  the cuBLAS split-K reduce kernel (``reduce_on_o_down``: assumed on the two narrow matrices,
  GPU_PATH counts 64 in 32 layers), since the GEMV reduces its splits in the kernel;
* the GEMV's own change: ``bytes / BW · (1 / eff_cublas − 1 / eff_fused)`` with ``eff`` the
  fraction of copy bandwidth each kernel reaches on that matrix (measured by
  ``bench/fused_gemv_gpu.py``; without a measurement ``eff_fused = eff_cublas``);
* the norm prologue's extra reads: every program reads its rows whole (``M·K`` bf16) from L2,
  ``programs · M · K · 2 / L2 bandwidth`` (an upper bound: the reads overlap the weight stream).

Per forward: the sum over layers. For a step of time ``t`` the predicted speedup is
``t / (t − saved)``. ``H200_KERNELS`` holds the per-kernel times of docs/GPU_PATH.md ("Where the
AR step goes": ``bench/gpu_suite.py`` on the H200, Llama-3-8B shape, 2026-11-29).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from specpilot.config import ModelConfig
from specpilot.mechanisms.fused_gemv import MATRIX_SETS
from specpilot.mechanisms.l2_prefetch_cost import matrix_bytes
from specpilot.mechanisms.saving import StepSaving

ASSUMPTIONS = (
    "each removed kernel saves its measured time plus one launch gap; cuBLAS's split-K reduce "
    "kernels sit on o and down; the norm prologue's row reads come from L2 and at worst add "
    "to the GEMV; the GEMV's efficiency is the measured one (equal to cuBLAS's when unmeasured)"
)


@dataclass(frozen=True, slots=True)
class KernelCosts:
    """Measured per-kernel times (s) of the small kernels the fusion removes."""

    rms_norm_s: float
    silu_mul_s: float
    reduce_s: float
    """One cuBLAS split-K reduce kernel."""
    gap_s: float
    """Launch gap between two kernels inside a CUDA graph."""
    reduce_on_o_down: bool = True
    """cuBLAS runs a split-K reduce kernel after o and after down (GPU_PATH: 64 in 32 layers)."""


H200_KERNELS = KernelCosts(
    rms_norm_s=0.114e-3 / 65,
    silu_mul_s=0.047e-3 / 32,
    reduce_s=0.120e-3 / 64,
    gap_s=0.268e-3 / 464,
)
"""docs/GPU_PATH.md, "Where the AR step goes" (H200, Llama-3-8B shape, 2026-11-29): 65 RMSNorm
0.114 ms, 32 SiLU·mul 0.047 ms, 64 split-K reduce kernels 0.120 ms, 0.268 ms of gaps between 464
kernels, per AR step."""


def removed_kernels(matrix: str, costs: KernelCosts) -> tuple[tuple[str, float], ...]:
    """(kind, seconds) of each kernel that fusing ``matrix`` removes from one layer."""
    reduce = (("splitk_reduce", costs.reduce_s),) if costs.reduce_on_o_down else ()
    return {
        "w_qkv": (("rms_norm", costs.rms_norm_s),),
        "w_o": reduce,
        "w_gate_up": (("rms_norm", costs.rms_norm_s),),
        "w_down": (("silu_mul", costs.silu_mul_s), *reduce),
    }[matrix]


@dataclass(frozen=True, slots=True)
class MatrixSaving:
    matrix: str
    kernels_removed: int
    kernels_s: float
    """Time of the removed kernels and their gaps (per layer)."""
    gemv_delta_s: float
    """The fused GEMV's time less cuBLAS's on the same matrix (negative: faster)."""
    prologue_s: float
    saved_s: float
    """Per layer: ``kernels_s − gemv_delta_s − prologue_s``."""


@dataclass(frozen=True, slots=True)
class FusedGemvPrediction(StepSaving):
    matrices: tuple[MatrixSaving, ...]
    layers: int

    @property
    def saved_s(self) -> float:
        """Time taken off one forward (all layers)."""
        return self.layers * sum(m.saved_s for m in self.matrices)

    @property
    def kernels_removed(self) -> int:
        """Kernels removed per forward."""
        return self.layers * sum(m.kernels_removed for m in self.matrices)


def gemv_alone_eff(
    cfg: ModelConfig,
    matrix: str,
    measured_s: float,
    bandwidth_Bps: float,
    costs: KernelCosts = H200_KERNELS,
    dtype_bytes: int = 2,
) -> float:
    """cuBLAS's fraction of copy bandwidth on ``matrix`` from a timing of what the engine runs
    now (``measured_s``: the GEMV *with* the kernels fusing removes, and their gaps): those
    kernels' time comes off first, or ``predict`` would count them twice (the first H200 run of
    ``bench/fused_gemv_gpu.py`` did: it predicted x1.019 where the kernel timings said x0.948)."""
    kernels_s = sum(s + costs.gap_s for _, s in removed_kernels(matrix, costs))
    gemv_s = measured_s - kernels_s
    if gemv_s <= 0:
        raise ValueError(f"{matrix}: {measured_s:.3g} s is not more than its removed kernels")
    return matrix_bytes(cfg, matrix, dtype_bytes) / bandwidth_Bps / gemv_s


def predict(
    cfg: ModelConfig,
    bandwidth_Bps: float,
    matrices: str = "all",
    rows: int = 1,
    costs: KernelCosts = H200_KERNELS,
    cublas_eff: float | Mapping[str, float] = 0.897,
    fused_eff: Mapping[str, float] | None = None,
    programs: int = 264,
    l2_Bps: float = 10e12,
    dtype_bytes: int = 2,
) -> FusedGemvPrediction:
    """The saving of ``install(model, matrices)`` on a forward of ``rows`` rows (<= max_m).
    ``cublas_eff``: cuBLAS's fraction of copy bandwidth on the GEMVs (0.897 on the H200 8B AR
    step, GPU_PATH), or by matrix (measured); ``fused_eff``: the fused GEMV's, by matrix (measured), else the same;
    ``programs``: programs per fused launch (about 2 per SM); ``l2_Bps``: L2 read bandwidth."""
    if bandwidth_Bps <= 0 or l2_Bps <= 0:
        raise ValueError("bandwidths must be positive")
    out = []
    for m in MATRIX_SETS[matrices]:
        gone = removed_kernels(m, costs)
        kernels_s = sum(s + costs.gap_s for _, s in gone)
        cub = cublas_eff if isinstance(cublas_eff, float) else cublas_eff[m]
        eff = cub if fused_eff is None else fused_eff.get(m, cub)
        if not (0 < cub <= 2 and 0 < eff <= 2):
            raise ValueError(f"efficiencies must be in (0, 2], got {cub} and {eff} for {m}")
        stream = matrix_bytes(cfg, m, dtype_bytes) / bandwidth_Bps
        delta = stream / eff - stream / cub
        prologue = 0.0
        if m in ("w_qkv", "w_gate_up"):
            prologue = programs * rows * cfg.hidden_size * dtype_bytes / l2_Bps
        out.append(
            MatrixSaving(m, len(gone), kernels_s, delta, prologue, kernels_s - delta - prologue)
        )
    return FusedGemvPrediction(tuple(out), cfg.num_layers)


__all__ = [
    "ASSUMPTIONS",
    "H200_KERNELS",
    "FusedGemvPrediction",
    "KernelCosts",
    "MatrixSaving",
    "gemv_alone_eff",
    "predict",
    "removed_kernels",
]
