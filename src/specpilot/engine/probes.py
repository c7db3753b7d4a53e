"""Measurements an engine takes of itself without committing anything: the target's reference
continuation (simulated acceptance's oracle) and the time of one target forward (the cost
model's verify curve). Both write only scratch: K/V past the committed lengths, which the next
forward overwrites, and the argmax buffer."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from specpilot.engine.abstain import stock_head
from specpilot.timing import time_call

if TYPE_CHECKING:
    from specpilot.engine.view import EngineView


@torch.inference_mode()
def reference_continuation(engine: EngineView, n: int) -> list[list[int]]:
    """The target's next ``n`` greedy tokens per row from the committed state, by AR steps of
    the engine's own forward (with the stock LM head: a head that may abstain would halt them),
    not committed. Excluded from the engine's timed wall clock."""
    st = engine.state
    engine.runner.synchronize()
    t0 = time.perf_counter()
    snap, base = st.snapshot(), max(engine.host.lens)
    with stock_head(engine):
        for s in range(n):
            engine.run_verify(1, engine.bucket(base + s), with_hidden=False, offset=s)
            engine.run_accept(0)
    tokens = st.tokens[:, : base + n].cpu().tolist()
    st.restore(snap)
    engine.runner.synchronize()
    engine.times.excluded += time.perf_counter() - t0
    return [tokens[row][c : c + n] for row, c in enumerate(engine.host.lens)]


@torch.inference_mode()
def time_forward(engine: EngineView, width: int, iters: int = 20, repeats: int = 3) -> float:
    """Seconds per target forward of ``width`` tokens per row (a verify of ``width - 1`` drafts)
    at the current committed state, replayed like a cycle's verify (one warm-up, then the
    median of ``repeats`` runs of ``iters``; ``repeats=1`` for a smoke run)."""
    if width - 1 > engine.k_max:
        raise ValueError(f"width must be at most {engine.k_max + 1}, got {width}")
    attn_len = engine.bucket(max(engine.host.lens) - 1 + width)
    step = engine.verify_step(width, attn_len, None, None)

    def once() -> None:
        engine.runner.run(("time", width, attn_len), step, engine.state, engine.verify_graph_safe)

    return time_call(once, engine.device, iters, warmup=1, repeats=repeats)
