"""Cost-model time of a linear layer whose weights stream in W12, from the kernel's measured
efficiency (not from the bare 12/16 byte ratio).

A W12 GEMV/GEMM of M rows streams ``N · Kp · 1.5`` bytes of weight planes plus the activations;
its time is those bytes over ``bandwidth × efficiency``, where ``efficiency`` is the fraction of
the measured copy bandwidth the W12 kernel reached at that M (``roofline_frac`` in
``kernels/w12_linear.py``'s ``CHOSEN`` table, written from ``bench/w12_gpu.py``). An unmeasured
table entry gives no prediction (None) rather than an optimistic one. The saving of a forward is
``layers · Σ_shapes (t_bf16 − t_W12)``; ``predicted_w12_forward_s`` subtracts it from a measured
stock forward, as the GPU bench's end-to-end check does with measured kernel times.
"""

from __future__ import annotations

from collections.abc import Iterable

GROUP = 64
"""W12 rows are padded to a multiple of 64 columns (``mechanisms/w12_format.py``)."""


def w12_efficiency(m: int) -> float | None:
    """The W12 kernel table's measured efficiency at ``m`` rows (None: not measured, or no
    Triton to read the table)."""
    try:
        from specpilot.kernels.w12_linear import choice_for
    except ImportError:
        return None
    return choice_for(m).roofline_frac


def w12_linear_s(n: int, k: int, m: int, bandwidth_Bps: float, efficiency: float) -> float:
    """Seconds of one ``[m, k] @ [n, k]^T`` reading W12 at ``efficiency`` of ``bandwidth_Bps``."""
    if not 0 < efficiency <= 1.5 or bandwidth_Bps <= 0:
        raise ValueError(
            f"need a positive bandwidth and efficiency, got {bandwidth_Bps}, {efficiency}"
        )
    kp = -(-k // GROUP) * GROUP
    return (1.5 * n * kp + 2 * m * (n + k)) / (bandwidth_Bps * efficiency)


def predicted_w12_forward_s(
    stock_forward_s: float,
    layers: int,
    shapes: Iterable[tuple[int, int]],
    m: int,
    bf16_linear_s: Iterable[float],
    bandwidth_Bps: float,
    efficiency: float | None = None,
) -> float | None:
    """A stock forward of ``m`` rows per layer shape ``(N, K)`` with the bf16 linears' measured
    seconds, minus what W12 saves per layer at the kernel's measured efficiency (default: the
    kernel table's). None when that efficiency was never measured."""
    eff = w12_efficiency(m) if efficiency is None else efficiency
    if eff is None:
        return None
    saving = sum(
        t - w12_linear_s(n, k, m, bandwidth_Bps, eff)
        for (n, k), t in zip(shapes, bf16_linear_s, strict=True)
    )
    return stock_forward_s - layers * saving


__all__ = ["predicted_w12_forward_s", "w12_efficiency", "w12_linear_s"]
