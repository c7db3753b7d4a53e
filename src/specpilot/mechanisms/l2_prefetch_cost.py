"""Cost model of the L2 prefetch (``l2_prefetch.py``): the time it can take off a forward.

Per layer and idle point ``p`` (a small phase before matrix ``m``):

* prefetched bytes ``b = min(mb MiB, bytes(m), L2)``;
* the idle window ``w``: how long the phase leaves HBM idle, its time less the time its own
  bytes take, ``max(0, t_phase − bytes_phase / BW)``, with ``t_phase = kernels × launch_s``
  unless measured (the bench passes measured windows);
* saved ``min(b / BW, w)`` on a side stream, ``min(b / BW, w + launch_s) − launch_s`` on the
  step's stream (the prefetch kernel runs before the phase: one more kernel in series, during
  which HBM already fetches).

Per forward: the sum over layers and chosen points. For a step of time ``t``, the predicted
speedup is ``t / (t − saved)``. Assumptions (printed beside every prediction): prefetched lines
survive in L2 until the GEMV reads them (the phase itself reads little: short context), the GEMV
reads the matrix head first, and a side stream's fork and join cost nothing in a graph.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from specpilot.config import ModelConfig
from specpilot.mechanisms.l2_prefetch import NEXT_MATRIX, PHASE_SETS, MiB
from specpilot.mechanisms.saving import StepSaving

PHASE_KERNELS = {"input_norm": 1, "attention": 2, "post_attn_norm": 1, "silu_mul": 1}
"""Kernels the engine's layer body runs in each idle phase on CUDA (Triton RMSNorm; fused RoPE +
K/V write, then SDPA; SiLU·mul)."""

ASSUMPTIONS = (
    "prefetched lines stay in L2 until the GEMV reads them; the GEMV reads its matrix head "
    "first; a side stream's fork and join cost nothing inside a CUDA graph"
)


def matrix_bytes(cfg: ModelConfig, matrix: str, dtype_bytes: int = 2) -> int:
    """Bytes of one decoder matrix (``w_qkv``, ``w_o``, ``w_gate_up``, ``w_down``)."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    shapes = {
        "w_qkv": (cfg.q_size + 2 * cfg.kv_size, h),
        "w_o": (h, cfg.q_size),
        "w_gate_up": (2 * inter, h),
        "w_down": (h, inter),
    }
    n, k = shapes[matrix]
    return n * k * dtype_bytes


def phase_bytes(cfg: ModelConfig, point: str, context: int, rows: int, dtype_bytes: int) -> int:
    """HBM bytes the idle phase itself moves (the attention reads K and V of the context)."""
    if point == "attention":
        return 2 * cfg.num_kv_heads * cfg.head_dim * (context + rows) * dtype_bytes
    return 0


def saved_time(
    fetch_bytes: int, window_s: float, bandwidth_Bps: float, launch_s: float, stream: str
) -> float:
    """Seconds one prefetch of ``fetch_bytes`` before an idle window of ``window_s`` saves."""
    fetch = fetch_bytes / bandwidth_Bps
    if stream == "side":
        return min(fetch, window_s)
    return min(fetch, window_s + launch_s) - launch_s


@dataclass(frozen=True, slots=True)
class PhaseSaving:
    point: str
    matrix: str
    prefetch_bytes: int
    window_s: float
    saved_s: float
    """Per layer."""


@dataclass(frozen=True, slots=True)
class L2PrefetchPrediction(StepSaving):
    phases: tuple[PhaseSaving, ...]
    layers: int

    @property
    def saved_s(self) -> float:
        """Time taken off one forward (all layers)."""
        return self.layers * sum(p.saved_s for p in self.phases)


def predict(
    cfg: ModelConfig,
    bandwidth_Bps: float,
    launch_s: float,
    phases: str = "all",
    mb: float = 8,
    stream: str = "side",
    context: int = 512,
    rows: int = 1,
    l2_bytes: int | None = None,
    dtype_bytes: int = 2,
    windows: Mapping[str, float] | None = None,
) -> L2PrefetchPrediction:
    """The saving of ``install(model, phases, mb, stream)`` on a forward of ``rows`` rows per
    sequence at ``context`` committed tokens; ``windows``: measured idle windows by point (s)."""
    if bandwidth_Bps <= 0 or launch_s < 0:
        raise ValueError("bandwidth must be positive and launch time non-negative")
    out = []
    for point in PHASE_SETS[phases]:
        matrix = NEXT_MATRIX[point]
        b = min(int(mb * MiB), matrix_bytes(cfg, matrix, dtype_bytes))
        if l2_bytes is not None:
            b = min(b, l2_bytes)
        if windows is not None and point in windows:
            w = max(0.0, windows[point])
        else:
            busy = phase_bytes(cfg, point, context, rows, dtype_bytes) / bandwidth_Bps
            w = max(0.0, PHASE_KERNELS[point] * launch_s - busy)
        out.append(
            PhaseSaving(point, matrix, b, w, saved_time(b, w, bandwidth_Bps, launch_s, stream))
        )
    return L2PrefetchPrediction(tuple(out), cfg.num_layers)


__all__ = [
    "ASSUMPTIONS",
    "PHASE_KERNELS",
    "L2PrefetchPrediction",
    "PhaseSaving",
    "matrix_bytes",
    "phase_bytes",
    "predict",
    "saved_time",
]
