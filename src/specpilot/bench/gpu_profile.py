"""Where a target forward's GPU time goes: kernel time by category from torch.profiler.

Runs the static forward eagerly (the same kernels a graph replays) a few times at a given width
and context, and sums device time per kernel category. Comparing the sum with the graph replay
time shows how much of a step is kernel work and how much is gaps between kernels.
"""

from __future__ import annotations

from typing import Any

import torch

from specpilot.engine.static_engine import StaticEngine

CATEGORIES = (
    ("gemm", ("gemm", "gemv", "cutlass", "xmma", "nvjet", "cublas", "splitk")),
    ("attention", ("fmha", "attention", "flash", "efficient", "softmax")),
    ("fused_triton", ("_rms_norm", "_rope_qkv", "_silu_mul")),
    ("argmax_reduce", ("argmax", "reduce")),
)


def _category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


@torch.inference_mode()
def profile_forward(engine: StaticEngine, width: int, reps: int = 5) -> dict[str, Any]:
    """Kernel time per forward of ``width`` tokens at ``engine``'s committed state, by category."""
    from torch.profiler import ProfilerActivity, profile

    st = engine.state
    assert st is not None and width - 1 <= engine.k_max
    attn_len = engine.bucket(max(engine.committed_lens()) + width - 1)
    fn = engine._verify_fn(width - 1, attn_len)
    cuda = engine.device.type == "cuda"
    fn()
    if cuda:
        torch.cuda.synchronize()
    activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        for _ in range(reps):
            fn()
        if cuda:
            torch.cuda.synchronize()
    by_cat: dict[str, float] = {}
    top: list[tuple[str, float, int]] = []
    for e in prof.key_averages():
        us = e.device_time_total if cuda else e.self_cpu_time_total
        t = float(us) / 1e6 / reps  # seconds per forward
        if t <= 0:
            continue
        by_cat[_category(e.key)] = by_cat.get(_category(e.key), 0.0) + t
        top.append((e.key[:90], t, int(e.count) // reps))
    top.sort(key=lambda x: -x[1])
    return {
        "width": width,
        "kernel_s_by_category": by_cat,
        "kernel_s_total": sum(by_cat.values()),
        "kernels_per_forward": sum(c for _, _, c in top),
        "top_kernels": [{"name": n, "s": t, "count": c} for n, t, c in top[:12]],
    }
