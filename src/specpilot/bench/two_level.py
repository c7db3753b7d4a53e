"""Measurements the two-level benches share: the cheap model's agreement with the exact target,
one eager forward's time, and the acceptance survival that ``two_level_cost.predict`` takes.

Used by ``bench/two_level_gpu.py`` (random weights, simulated acceptance) and
``bench/two_level_smollm2.py`` (SmolLM2, real acceptance).
"""

from __future__ import annotations

import statistics
import time
from itertools import pairwise

import torch

from specpilot.bench.runner import synchronize
from specpilot.engine.stats import AcceptanceStats
from specpilot.models.transformer import Transformer


def agreement(
    target: Transformer, cheap: Transformer, seq: list[int], chunk: int, prefix: int = 0
) -> float:
    """Teacher-forced: the fraction of positions where the cheap model's greedy token equals the
    target's. Both models are fed ``seq[:prefix]`` in one forward (a prompt's prefill), then the
    rest in chunks of ``chunk`` tokens (verify widths); counted are the positions that predict a
    token of ``seq[prefix:]`` (every token after the first when ``prefix`` is 0)."""
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1, got {chunk}")
    dev = target.device
    end = len(seq) - 1  # the last token predicts nothing in seq: it is never fed
    edges = sorted({0, min(prefix, end), *range(prefix + chunk, end, chunk), end})
    first = max(prefix - 1, 0)  # the first counted position
    same = total = 0
    with torch.inference_mode():
        caches = [m.allocate_cache(1, len(seq) + 1) for m in (target, cheap)]
        for lo, hi in pairwise(edges):
            toks = torch.tensor([seq[lo:hi]], device=dev)  # [1, hi - lo]
            outs = []
            for model, cache in zip((target, cheap), caches, strict=True):
                outs.append(model.forward_argmax(toks, cache)[0])  # [hi - lo]
                cache.commit(0, hi)
            skip = max(first - lo, 0)
            same += int((outs[0][skip:] == outs[1][skip:]).sum())
            total += max(hi - lo - skip, 0)
    return same / max(total, 1)


def forward_time(model: Transformer, prefix: int, width: int, reps: int) -> float:
    """Median seconds of one eager ``forward_argmax`` of ``width`` tokens after ``prefix`` cached
    positions, its result read on the host (as the engine does), after two warm-up calls."""
    dev = model.device
    cache = model.allocate_cache(1, prefix + width + 1)
    cache.commit(0, prefix)
    toks = torch.ones(1, width, dtype=torch.int64, device=dev)  # [1, width]
    times = []
    with torch.inference_mode():
        for i in range(reps + 2):
            synchronize(dev)
            t0 = time.perf_counter()
            model.forward_argmax(toks, cache).tolist()
            synchronize(dev)
            if i >= 2:
                times.append(time.perf_counter() - t0)
    return statistics.median(times)


def survival(stats: AcceptanceStats) -> list[float]:
    """``[S_1, .., S_K]``, ``S_i`` = the fraction of verify cycles that accepted at least ``i``
    drafted tokens (a cycle that drafted fewer than ``i`` counts as below ``i``); so
    ``1 + sum(S)`` is the measured τ when no draft was cut by the length limit."""
    if stats.cycles == 0:
        return []
    hist = stats.accept_hist  # hist[n]: cycles that accepted exactly n
    return [sum(hist[i:]) / stats.cycles for i in range(1, len(hist))]


__all__ = ["agreement", "forward_time", "survival"]
