"""Where a target forward's GPU time goes: kernel time by category from torch.profiler.

Runs the engine's verify forward eagerly (the same kernels its CUDA graph replays: the body of
``Engine.time_forward``) a few times at a given width and the engine's committed context, and
sums device time per kernel category. Comparing the sum with the graph replay time
(``Engine.time_forward``) shows how much of a step is kernel work and how much is gaps between
kernels.
"""

from __future__ import annotations

from typing import Any

import torch

from specpilot.engine import Engine
from specpilot.models.layout import DenseLayout

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
def profile_forward(engine: Engine, width: int, reps: int = 5) -> dict[str, Any]:
    """Kernel time per forward of ``width`` tokens at ``engine``'s committed state, by category.
    The engine's rows must be open (e.g. after a prefill); only scratch is written (K/V past the
    committed length, the verify argmax)."""
    from torch.profiler import ProfilerActivity, profile

    if not 1 <= width <= engine.k_max + 1:
        raise ValueError(f"width must lie in 1..{engine.k_max + 1}, got {width}")
    st = engine.state
    attn_len = engine.bucket(max(engine.committed_lens()) - 1 + width)
    fwd = engine.fwd

    def fn() -> None:
        block = torch.cat([st.pending[:, None], st.drafts[:, : width - 1]], dim=1)  # [B, W]
        lay = DenseLayout.build(
            st.committed_len - 1, width, attn_len, fwd.groups, engine.target.dtype
        )
        engine.forward_block(block, lay, st.verify_argmax, None)

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
