"""Graph warm-up: the CUDA graphs a scheduler's steps will replay, captured before its first request.

The runner captures a step's graph on the first call of its key (``engine/runner.py``). In a
server each new key was met by a live request: each (rows, attention bucket) pair of the AR
step, each prefill width, each block width of a chain cycle costs a capture (an eager run and
the capture: tens of ms for an 8B forward) that stalls every stream once. ``warm_graphs`` runs
the engine's own step code for every key a scheduler's steps can meet, under
``Runner.capture_only``, while every row is idle, then re-opens the rows:

* AR windows: for every row count ``Engine.live_rows`` can give (without a drafter; all rows
  with one, as its gated and capped-off windows run) the AR verify at every attention bucket
  up to the rows' capacity, and the accept;
* a chain plan's cycle: every block width it may verify × every bucket (the verify with the
  drafter's hidden states when it reads them), and the accept of each width;
* every width bucket of the graphed (packed) prefill, when prefills take that path.

Lossless: nothing is replayed. A capture's warm-up run (``Runner._capture``) writes on idle rows
only what any step may write there: the small row state (restored), the K/V and tokens past
the committed lengths and the verify outputs (scratch, written again before anything reads
them, ``engine/rows.py``), and the prefill's own scratch buffers; then ``Engine.open`` puts
the row state back as a fresh scheduler's (the verify outputs zeroed too). The graphs are the ones the first use would capture (the
same closures over the same buffers), so a warmed engine commits the same tokens.

Not warmed (captured on first use, as before): a drafter's own steps (they read its state),
packed and tree verify plans, and the stock-head redo of a verify head that abstained.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specpilot.engine.admission import graphable_prefill
from specpilot.engine.plans import ChainPlan
from specpilot.engine.row_prefix import row_buckets

if TYPE_CHECKING:
    from specpilot.engine.engine import Engine
    from specpilot.engine.scheduler import Scheduler


@dataclass(frozen=True, slots=True)
class WarmReport:
    """What :func:`warm_graphs` captured."""

    keys: tuple[Hashable, ...]
    """The runner keys captured (graph variants included), in capture order."""
    seconds: float
    """Wall time of the warm-up, the device synchronized at its end."""
    left: tuple[str, ...]
    """Steps still captured on first use (what the warm-up cannot run without a request)."""

    def summary(self) -> str:
        return f"{len(self.keys)} graphs captured at startup in {self.seconds:.1f} s"


def attention_buckets(engine: Engine, top: int) -> list[int]:
    """Every attention length ``Engine.bucket`` gives for a need of 1 .. ``top`` slots."""
    step = max(engine.attn_bucket, 1)
    return sorted({engine.bucket(min(m, top)) for m in range(1, top + step, step)})


def warm_graphs(sched: Scheduler) -> WarmReport:
    """Capture the graphs of every step shape ``sched`` can run (module docstring), before any
    request; the rows are re-opened after. Nothing to do on an eager runner."""
    engine = sched.engine
    if sched.has_work:
        raise ValueError("Warm the graphs before the first request: this scheduler has work.")
    if not engine.runner.use_graphs:
        return WarmReport((), 0.0, ("every step (the runner is eager)",))
    t0 = time.perf_counter()
    top = min(engine.capacity, sched.max_context + engine.context_margin())
    buckets = attention_buckets(engine, top)
    with torch.inference_mode(), engine.runner.capture_only() as keys:
        _warm_ar(engine, buckets)
        left = _warm_plan(engine, buckets)
        _warm_prefill(engine)
    engine.runner.synchronize()
    engine.open(sched.num_slots, sched.max_context)
    with torch.inference_mode():
        engine.state.verify_argmax.zero_()  # scratch (every verify writes it first), as fresh
    return WarmReport(tuple(keys), time.perf_counter() - t0, tuple(left))


def _warm_ar(engine: Engine, buckets: list[int]) -> None:
    """AR windows (``engine/cycles.ar_window``): over the first rows without a drafter."""
    counts = row_buckets(engine.batch) if engine.drafter is None else [engine.batch]
    for n in counts:
        with engine.first_rows(n):
            for attn_len in buckets:
                engine.run_verify(1, attn_len, with_hidden=False)
            engine.run_accept(0)


def _warm_plan(engine: Engine, buckets: list[int]) -> list[str]:
    """A chain plan's verify and accept per block width; what is left to first use."""
    plan, drafter = engine.plan, engine.drafter
    if plan is None or drafter is None:
        return []
    left = []
    if isinstance(plan, ChainPlan):
        for w in plan.widths_used(engine.k, graphs=True):
            for attn_len in buckets:
                engine.run_verify(w, attn_len)
            engine.run_accept(w - 1)
    else:
        left.append(f"the {plan.name} plan's verify and accept")
    if drafter.graph_safe:
        left.append(f"the {drafter.name} drafter's own steps")
    if engine.abstain_flag is not None:
        left.append("the stock-head redo of an abstained verify")
    return left


def _warm_prefill(engine: Engine) -> None:
    """Every width of the graphed (packed) prefill (``engine/prefill_graph.py``), into row 0."""
    graph = engine.prefill_graph() if graphable_prefill(engine) else None
    if graph is None:
        return
    assert engine.cache is not None
    for w in graph.widths:
        graph.run(engine.runner, engine.state, engine.fwd, engine.cache, [0], [[0]], w)


__all__ = ["WarmReport", "attention_buckets", "warm_graphs"]
