"""Fused dequantize + GEMM over a GGUF's blocks, in numba (LLVM bundled; no system compiler).

Two packed layouts hold every supported block type (``loading/gguf_blocks.py`` unpacks them):

* ``q4``: codes 0..15 two per byte (group of 32 weights = 16 bytes, low nibble weight j, high
  nibble weight j + 16), one fp32 scale and one fp32 min per group: ``w = fma(d, q, m)``;
* ``q8``: int8 codes, one fp32 scale per group of 16 (and a min, or none): ``w = d·q (+ m)``.

``d·q`` is exact in fp32 for every block type (at most 24 significant bits), so the fused
multiply-add that ``fastmath={'contract'}`` allows rounds once, exactly as gguf's
``(d * q) + m`` does: the kernel multiplies the very float32 weights of the stock path. Only the
summation order differs (``reassoc``), and it is the same for every row of ``x`` whatever the
width ``M``: per output, per group a 32- (16-) term partial sum, the partials added in order.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

_FM = {"reassoc", "contract"}


@njit(cache=True, parallel=True, fastmath=_FM)
def gemm_q4(x, qs, sc, mn, out, col0):  # type: ignore[no-untyped-def]
    """out[m, col0 + n] = sum_k x[m, k] * w[n, k]; x [M, K] f32, qs [N, K/2] u8, sc/mn [N, K/32]."""
    m_rows, k = x.shape
    n_rows = qs.shape[0]
    groups = k // 32
    for n in prange(n_rows):
        w = np.empty(32, np.float32)
        acc = np.zeros(m_rows, np.float32)
        for g in range(groups):
            d = sc[n, g]
            m0 = mn[n, g]
            for j in range(16):
                b = qs[n, g * 16 + j]
                w[j] = d * np.float32(b & 15) + m0
                w[j + 16] = d * np.float32(b >> 4) + m0
            for r in range(m_rows):
                s = np.float32(0.0)
                for j in range(32):
                    s += w[j] * x[r, g * 32 + j]
                acc[r] += s
        for r in range(m_rows):
            out[r, col0 + n] = acc[r]


@njit(cache=True, parallel=True, fastmath=_FM)
def gemm_q8(x, q, sc, mn, has_min, out, col0):  # type: ignore[no-untyped-def]
    """As :func:`gemm_q4` for int8 codes ``q [N, K]``, scales (and mins) ``[N, K/16]``."""
    m_rows, k = x.shape
    n_rows = q.shape[0]
    groups = k // 16
    for n in prange(n_rows):
        w = np.empty(16, np.float32)
        acc = np.zeros(m_rows, np.float32)
        for g in range(groups):
            d = sc[n, g]
            if has_min:
                m0 = mn[n, g]
                for j in range(16):
                    w[j] = d * np.float32(q[n, g * 16 + j]) + m0
            else:
                for j in range(16):
                    w[j] = d * np.float32(q[n, g * 16 + j])
            for r in range(m_rows):
                s = np.float32(0.0)
                for j in range(16):
                    s += w[j] * x[r, g * 16 + j]
                acc[r] += s
        for r in range(m_rows):
            out[r, col0 + n] = acc[r]
