"""One way to time device work: warm up, then the median of three timed runs.

CUDA work is timed with events (no host clock over asynchronous launches); anything else with
``clock`` (``time.perf_counter`` by default).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def time_burst(
    fn: Callable[[], object],
    device: torch.device,
    iters: int,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Seconds per call of one timed burst of ``iters`` calls (CUDA: events; else ``clock``)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(iters):
            fn()
        e1.record()
        e1.synchronize()
        return e0.elapsed_time(e1) / 1e3 / iters
    t0 = clock()
    for _ in range(iters):
        fn()
    return (clock() - t0) / iters


def time_call(
    fn: Callable[[], object],
    device: torch.device,
    iters: int,
    warmup: int = 2,
    clock: Callable[[], float] = time.perf_counter,
    repeats: int = 3,
) -> float:
    """Seconds per call of ``fn``: the median of ``repeats`` bursts of ``iters`` calls, after
    ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    return statistics.median(time_burst(fn, device, iters, clock) for _ in range(repeats))


def spread(xs: list[float]) -> dict[str, float]:
    """Median and min-max of a list of samples (what the bench scripts report)."""
    return {"median": statistics.median(xs), "lo": min(xs), "hi": max(xs), "n": len(xs)}


def interleaved_rounds(
    fns: dict[str, Callable[[], object]],
    device: torch.device,
    rounds: int,
    per: int = 1,
    iters: int = 3,
) -> dict[str, list[float]]:
    """Seconds per call of each fn (``per`` calls per fn call) in ``rounds`` interleaved rounds:
    every fn is warmed up once, then each round times one burst of ``iters`` of every fn, the
    order rotated by one per round so that drift hits every fn alike."""
    names = list(fns)
    for fn in fns.values():
        fn()
    got: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        shift = r % len(names)
        for n in names[shift:] + names[:shift]:
            got[n].append(time_burst(fns[n], device, iters) / per)
    return got
