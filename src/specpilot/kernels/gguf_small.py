"""The small fp32 ops of a CPU forward in numba: RMSNorm, rotate-half RoPE, and RoPE with the K/V
write of a one-row eager step, one call each.

On the CPU the torch path spends about as long on these ops' ~20 dispatches per layer as the
GGUF block kernels spend on the layer's matrices (SmolLM2-135M, 2 cores: ~12 ms of a ~27 ms
token). Each kernel here is one dispatch over the same arithmetic:

* ``rope``: ``x * cos + rotate_half(x) * sin``, two roundings of products and one of the sum,
  as the torch path rounds them (numba emits no fused multiply-add unless asked): bit for bit
  the torch path's output (tests/test_gguf_blocks.py);
* ``rope_qkv_write``: the same RoPE of q and k from the fused q/k/v rows, k and v copied into
  the cache at consecutive slots: bit for bit the torch path's rope, slice writes and q;
* ``rope_write_attend``: ``rope_qkv_write``, then causal attention of each new row over the
  cache (row ``i`` sees slots ``< min(start + i + 1, attn_len)``, as ``layout.block_mask``
  says): ``softmax(q·k / sqrt(D)) · v`` as SDPA's flash kernel forms it (scores scaled, the max
  subtracted, ``exp``, the weighted sum of V divided by the sum once). Rows and heads are
  independent and every row's loops run in one order whatever the width, so a verify row equals
  the AR step at its position bit for bit. Differs from SDPA by summation order and by ``exp``
  (libm's ``expf`` here, torch's vectorized approximation there): ulps, as the GEMM's order;
  near-ties counted by token forcing;
* ``rms_norm``: ``w * (x * (1 / sqrt(mean(x²) + eps)))`` with the same elementwise roundings;
  the fp32 squares are summed in float64 and rounded once, where torch sums them in fp32 in
  its vectorized order: the mean may differ by an ulp, so the output may too (the same kind of
  difference as the block kernels' summation order; near-ties counted by token forcing).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange


@njit(cache=True, error_model="numpy")
def rms_norm(x, w, eps, out):  # type: ignore[no-untyped-def]
    """out[i] = w * (x[i] * (1 / sqrt(sum(x[i]²) / N + eps))); x, out [M, N] f32, w [N] f32."""
    m, n = x.shape
    e = np.float32(eps)
    nf = np.float32(n)
    for i in range(m):
        s = 0.0  # float64: each square rounded to fp32 as torch's pow(2), summed nearly exactly
        for j in range(n):
            s += np.float32(x[i, j] * x[i, j])
        r = np.float32(1.0) / np.sqrt(np.float32(s) / nf + e)
        for j in range(n):
            out[i, j] = w[j] * (x[i, j] * r)


@njit(cache=True, error_model="numpy", inline="always")
def _rope_row(x, c, s, out):  # type: ignore[no-untyped-def]
    """out = x * c + rotate_half(x) * s for one head: x, out, c, s [D] f32 (views)."""
    d = x.shape[0]
    half = d // 2
    for j in range(half):
        out[j] = x[j] * c[j] + (-x[j + half]) * s[j]
    for j in range(half, d):
        out[j] = x[j] * c[j] + x[j - half] * s[j]


@njit(cache=True, error_model="numpy")
def rope(x, cos, sin, out):  # type: ignore[no-untyped-def]
    """out = x * cos + rotate_half(x) * sin; x, out [M, H, D] f32; cos, sin [M, 1, D] f32."""
    m, h, _ = x.shape
    for i in range(m):
        for k in range(h):
            _rope_row(x[i, k], cos[i, 0], sin[i, 0], out[i, k])


@njit(cache=True, error_model="numpy")
def rope_qkv_write(qkv, q_heads, kv_heads, cos, sin, k_cache, v_cache, start, q_out):  # type: ignore[no-untyped-def]
    """q_out[i, h] = rope(q[i, h]); k_cache[0, h, start + i] = rope(k[i, h]); v_cache likewise
    (a copy). qkv [M, (Hq + 2 Hkv) D] f32; cos, sin [M, 1, D]; caches [1, Hkv, S, D] f32."""
    m, d = qkv.shape[0], q_out.shape[2]
    k0, v0 = q_heads * d, (q_heads + kv_heads) * d
    for i in range(m):
        c, s = cos[i, 0], sin[i, 0]
        for h in range(q_heads):
            _rope_row(qkv[i, h * d : (h + 1) * d], c, s, q_out[i, h])
        for h in range(kv_heads):
            _rope_row(qkv[i, k0 + h * d : k0 + (h + 1) * d], c, s, k_cache[0, h, start + i])
            v_cache[0, h, start + i, :] = qkv[i, v0 + h * d : v0 + (h + 1) * d]


@njit(cache=True, error_model="numpy", fastmath={"reassoc", "contract"}, parallel=True)
def _attend(q, k_cache, v_cache, start, attn_len, out):  # type: ignore[no-untyped-def]
    """out[i, h*D:(h+1)*D] = softmax(q[i, h] · K / sqrt(D)) · V over the slots
    ``< min(start + i + 1, attn_len)`` of KV head ``h // (Hq / Hkv)``; q [M, Hq, D]. One
    (row, head) a task, each in one thread: the same order whatever the threads."""
    m, q_heads, d = q.shape
    group = q_heads // k_cache.shape[1]
    scale = np.float32(1.0 / np.sqrt(d))
    for task in prange(m * q_heads):
        i, h = task // q_heads, task % q_heads
        n = min(start + i + 1, attn_len)
        scores = np.empty(n, dtype=np.float32)
        acc = np.zeros(d, dtype=np.float32)
        kh, vh, qi = k_cache[0, h // group], v_cache[0, h // group], q[i, h]
        best = np.float32(-np.inf)
        for j in range(n):
            t = np.float32(0.0)
            for c in range(d):
                t += qi[c] * kh[j, c]
            scores[j] = t * scale
            best = max(best, scores[j])
        total = np.float32(0.0)
        for j in range(n):
            e = np.exp(scores[j] - best)
            total += e
            for c in range(d):
                acc[c] += e * vh[j, c]
        for c in range(d):
            out[i, h * d + c] = acc[c] / total


@njit(cache=True, error_model="numpy")
def rope_write_attend(qkv, q_heads, kv_heads, cos, sin, k_cache, v_cache, start, attn_len, out):  # type: ignore[no-untyped-def]
    """``rope_qkv_write`` (its exact arithmetic: no fast-math here), then ``_attend``.
    qkv [M, (Hq + 2 Hkv) D]; cos, sin [M, 1, D]; caches [1, Hkv, S, D]; out [M, Hq D] f32."""
    q = np.empty((qkv.shape[0], q_heads, k_cache.shape[3]), dtype=np.float32)
    rope_qkv_write(qkv, q_heads, kv_heads, cos, sin, k_cache, v_cache, start, q)
    _attend(q, k_cache, v_cache, start, attn_len, out)
