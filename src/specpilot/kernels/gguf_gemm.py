"""Fused dequantize + GEMM over a GGUF's blocks, in numba (LLVM bundled; no system compiler).

Two packed layouts hold every supported block type (``loading/gguf_blocks.py`` unpacks them):

* ``q4``: codes 0..15 two per byte (group of 32 weights = 16 bytes, low nibble weight j, high
  nibble weight j + 16), one fp32 scale and one fp32 min per group: ``w = fma(d, q, m)``;
* ``q8``: int8 codes, one fp32 scale per group of 16 (and a min, or none): ``w = d·q (+ m)``.

``d·q`` is exact in fp32 for every block type (at most 24 significant bits), so the fused
multiply-add rounds once, exactly as gguf's ``(d * q) + m`` does: the kernel multiplies the very
float32 weights of the stock path. The vector inner loops are ``kernels/gguf_simd.py``.

Shape of the work: the output rows are cut into chunks of ``ROWS`` (one ``prange`` task each).
Each output row's weights are decoded in registers, 32 at a time, and multiplied at once into
up to 8 rows of ``x``, two weight rows at a time below 8 (``gguf_simd.rows8``, ``pair4`` ..; a
verify of ``M`` rows decodes each weight ``ceil(M / 8)``-few times, not ``M`` times). Every row of ``x`` takes the same summation order
whatever ``M`` (``gguf_simd``'s two chains); only that order differs from the stock path.

numba's cache (``cache=True``) is keyed on this file's own stamp, not on ``gguf_simd.py``'s: a
change to the inner loops there must touch this file too, or a stale compiled ``gemm`` loads.
"""

from __future__ import annotations

from numba import njit, prange

from specpilot.kernels.gguf_simd import pair1, pair2, pair4, rows1, rows8

ROWS = 32
"""Output rows per parallel task."""


@njit(cache=True, parallel=True, error_model="numpy")
def gemm(x, q, sc, mn, out, col0):  # type: ignore[no-untyped-def]
    """out[m, col0 + n] = sum_k x[m, k] * w[n, k]; x [M, K] f32; q4: q [N, K/2] u8 with sc/mn
    [N, K/32]; q8: q [N, K] i8 with sc (mn or None) [N, K/16]; scales f32 or f16 bits (u16)."""
    m, k = x.shape
    n_rows, qrow = q.shape
    srow = sc.shape[1]
    ncol = out.shape[1]
    for c in prange((n_rows + ROWS - 1) // ROWS):
        lo, hi = c * ROWS, min(n_rows, (c + 1) * ROWS)
        r = 0
        while r < m:  # blocks of 8, 4, 2, 1 rows of x; the chunk's weights stay in cache
            b = 8 if m - r >= 8 else 4 if m - r >= 4 else 2 if m - r >= 2 else 1
            n = lo
            while n < hi:
                qo, so, oo = n * qrow, n * srow, r * ncol + col0 + n
                if b == 8:
                    rows8(x, r * k, k, q, qo, qrow, sc, mn, so, srow, out, oo, ncol)
                    n += 1
                elif n + 1 < hi:  # two weight rows at once: more FMA chains in flight
                    if b == 4:
                        pair4(x, r * k, k, q, qo, qrow, sc, mn, so, srow, out, oo, ncol)
                    elif b == 2:
                        pair2(x, r * k, k, q, qo, qrow, sc, mn, so, srow, out, oo, ncol)
                    else:
                        pair1(x, r * k, k, q, qo, qrow, sc, mn, so, srow, out, oo, ncol)
                    n += 2
                else:  # an odd last weight row: each row of x alone (the same chains)
                    for i in range(b):
                        xo = (r + i) * k
                        rows1(x, xo, k, q, qo, qrow, sc, mn, so, srow, out, oo + i * ncol, ncol)
                    n += 1
            r += b
