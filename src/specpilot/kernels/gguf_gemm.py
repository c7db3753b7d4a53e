"""Fused dequantize + GEMM over a GGUF's blocks, in numba (LLVM bundled; no system compiler).

Two packed layouts hold every supported block type (``loading/gguf_blocks.py`` unpacks them):

* ``q4``: codes 0..15 two per byte (group of 32 weights = 16 bytes, low nibble weight j, high
  nibble weight j + 16), one fp32 scale and one fp32 min per group: ``w = fma(d, q, m)``;
* ``q8``: int8 codes, one fp32 scale per group of 16 (and a min, or none): ``w = d·q (+ m)``.

``d·q`` is exact in fp32 for every block type (at most 24 significant bits), so the fused
multiply-add that ``fastmath={'contract'}`` allows rounds once, exactly as gguf's
``(d * q) + m`` does: the kernel multiplies the very float32 weights of the stock path.

Shape of the work: the output rows are cut into chunks of ``ROWS`` (one ``prange`` task each,
one K-float row buffer per task, allocated once). Per output row the task decodes the row's
weights into the buffer (L1-resident: K ≤ a few thousand floats) and takes one contiguous dot
product per row of ``x``, so the decode is paid once for all ``M`` rows of the verify. Only the
summation order differs from the stock path (``reassoc`` lets LLVM vectorize the dot), and it is
the same for every row of ``x`` whatever the width ``M``: the same loop runs for each.

The group length (16 bytes, 16 codes) is read from the arrays' shapes, not written as a
literal: with a constant trip count LLVM unrolls the decode into scalar converts before its loop
vectorizer sees it (measured 1.8x slower on AVX-512); with a run-time one it vectorizes it.
The codes go through ``int32`` (numba would widen ``uint8 & 15`` to int64, whose conversion to
float does not vectorize either).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

_FM = {"reassoc", "contract"}
ROWS = 32
"""Output rows per parallel task (one decode buffer per task)."""


@njit(cache=True, fastmath=_FM, error_model="numpy", inline="always")
def _dots(w, x, out, col):  # type: ignore[no-untyped-def]
    """out[r, col] = sum_j w[j] * x[r, j] for every row r of x [M, K]; w [K] f32."""
    for r in range(x.shape[0]):
        xr = x[r]
        s = np.float32(0.0)
        for j in range(w.shape[0]):
            s += w[j] * xr[j]
        out[r, col] = s


@njit(cache=True, parallel=True, fastmath=_FM, error_model="numpy")
def gemm_q4(x, qs, sc, mn, out, col0):  # type: ignore[no-untyped-def]
    """out[m, col0 + n] = sum_k x[m, k] * w[n, k]; x [M, K] f32, qs [N, K/2] u8, sc/mn [N, K/32]."""
    k = x.shape[1]
    n_rows = qs.shape[0]
    groups = sc.shape[1]
    h = qs.shape[1] // groups  # 16 bytes a group, read from the shape: see the module docstring
    f15, f4 = np.int32(15), np.int32(4)
    for c in prange((n_rows + ROWS - 1) // ROWS):
        w = np.empty(k, np.float32)  # [K] the row being decoded
        for n in range(c * ROWS, min(n_rows, (c + 1) * ROWS)):
            qrow, srow, mrow = qs[n], sc[n], mn[n]
            for g in range(groups):
                d, m0 = srow[g], mrow[g]
                qg = qrow[g * h : (g + 1) * h]
                lo = w[2 * g * h : (2 * g + 1) * h]
                hi = w[(2 * g + 1) * h : (2 * g + 2) * h]
                for j in range(h):
                    lo[j] = d * np.float32(np.int32(np.int32(qg[j]) & f15)) + m0
                for j in range(h):
                    hi[j] = d * np.float32(np.int32(np.int32(qg[j]) >> f4)) + m0
            _dots(w, x, out, col0 + n)


@njit(cache=True, parallel=True, fastmath=_FM, error_model="numpy")
def gemm_q8(x, q, sc, mn, has_min, out, col0):  # type: ignore[no-untyped-def]
    """As :func:`gemm_q4` for int8 codes ``q [N, K]``, scales (and mins) ``[N, K/16]``."""
    k = x.shape[1]
    n_rows = q.shape[0]
    groups = sc.shape[1]
    h = k // groups  # 16 codes a group, read from the shape: see the module docstring
    for c in prange((n_rows + ROWS - 1) // ROWS):
        w = np.empty(k, np.float32)  # [K] the row being decoded
        for n in range(c * ROWS, min(n_rows, (c + 1) * ROWS)):
            qrow, srow, mrow = q[n], sc[n], mn[n]
            for g in range(groups):
                d = srow[g]
                m0 = mrow[g] if has_min else np.float32(0.0)
                wg = w[g * h : (g + 1) * h]
                qg = qrow[g * h : (g + 1) * h]
                if has_min:
                    for j in range(h):
                        wg[j] = d * np.float32(np.int32(qg[j])) + m0
                else:
                    for j in range(h):
                        wg[j] = d * np.float32(np.int32(qg[j]))
            _dots(w, x, out, col0 + n)
