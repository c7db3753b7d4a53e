"""The weights the GGUF kernels multiply, materialized: the same expressions as
``kernels/gguf_gemm.py`` (same fastmath flags), so that a test can compare them bit for bit
with gguf's own dequantization."""

from __future__ import annotations

import numpy as np
from numba import njit

_FM = {"reassoc", "contract"}


@njit(cache=True, fastmath=_FM)
def dequant_q4(qs, sc, mn):  # type: ignore[no-untyped-def]
    n_rows, half = qs.shape
    w = np.empty((n_rows, half * 2), np.float32)
    for n in range(n_rows):
        for g in range(half // 16):
            d = sc[n, g]
            m0 = mn[n, g]
            for j in range(16):
                b = qs[n, g * 16 + j]
                w[n, g * 32 + j] = d * np.float32(b & 15) + m0
                w[n, g * 32 + j + 16] = d * np.float32(b >> 4) + m0
    return w


@njit(cache=True, fastmath=_FM)
def dequant_q8(q, sc, mn, has_min):  # type: ignore[no-untyped-def]
    n_rows, k = q.shape
    w = np.empty((n_rows, k), np.float32)
    for n in range(n_rows):
        for i in range(k):
            d = sc[n, i // 16]
            if has_min:
                w[n, i] = d * np.float32(q[n, i]) + mn[n, i // 16]
            else:
                w[n, i] = d * np.float32(q[n, i])
    return w
