"""What the kernel search (``tune/kernel_search.py``) measures a cell with, and what it reports:
the check every candidate passes before it is timed (:func:`check`), the CUDA-graph timer
(:func:`graph_time`), the compile-time budget (:class:`CompileBudget`), one cell's row
(:class:`SearchRow`) and the search's table with its price (:class:`KernelSearch`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

import torch
from torch import Tensor

from specpilot.kernels.w12_tilings import MmaConfig, MmaTilings

KERNEL = "w12_mma"
COMPILE_PRIOR_S = 6.0
"""Seconds one new compile is assumed to take before this search has timed one."""
RUN_S = 0.4
"""Seconds one candidate's check and timing take once compiled (a few graphs of ~1 ms)."""


@dataclass(slots=True)
class SearchRow:
    """One (shape, width): what was chosen and what it measured (microseconds)."""

    shape: tuple[int, int]
    width: int
    config: MmaConfig
    us: float
    default_us: float
    cublas_us: float
    tried: int = 0
    skipped: int = 0
    device_s: float = 0.0
    reused: bool = False
    offer: str | None = None
    """The source hash of the agent kernel that won the cell (``config``: its fallback)."""

    def winner(self) -> str:
        c = self.config
        tiling = f"r{c.block_r} k{c.block_k} w{c.num_warps} s{c.num_stages} split{c.split_k}"
        tiling += f" halves{c.inner_split}" if c.inner_split > 1 else ""
        return f"agent offer {self.offer} (else {tiling})" if self.offer else tiling

    def to_dict(self) -> dict[str, Any]:
        kernel = f"offer {self.offer}" if self.offer else "tiling"
        return {**asdict(self), "kernel": kernel, "speedup_vs_default": self.default_us / self.us}

    def line(self) -> str:
        how = "reused from memory" if self.reused else f"{self.tried} tried, {self.skipped} skipped"
        return (
            f"  {self.shape[0]}x{self.shape[1]} M<={self.width}: {self.winner()}  {self.us:.1f} us, "
            f"x{self.default_us / self.us:.2f} the default, x{self.cublas_us / self.us:.2f} "
            f"cuBLAS ({how}; {self.device_s:.1f} device-s)"
        )


@dataclass(slots=True)
class KernelSearch:
    """The search's table and its price."""

    tilings: MmaTilings
    offers: Any = None
    """The cells an agent kernel won (``kernels/offers.KernelOffers``; None: none did)."""
    rows: list[SearchRow] = field(default_factory=list)
    device_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    gpu: dict[str, str] = field(default_factory=dict)

    def lines(self) -> list[str]:
        head = (
            f"kernel search ({KERNEL}) on {self.gpu.get('name', '?')} [{self.gpu.get('key', '?')}]: "
            f"{len(self.rows)} shape x width cells, {self.device_s:.1f} device-s"
        )
        return [head, *(r.line() for r in self.rows), *(f"  {n}" for n in self.notes)]

    def to_dict(self) -> dict[str, Any]:
        """run.json's ``search.kernel_search``: per cell the winner, its speed and price."""
        cells = [r.to_dict() for r in self.rows]
        return {"kernel": KERNEL, "gpu": self.gpu, "device_s": self.device_s, "cells": cells, "notes": self.notes}  # fmt: skip


class CompileBudget:
    """Seconds left for the search and the running estimate of one new compile."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.deadline = clock() + seconds
        self.compiles: list[float] = []
        self.compiled: set[tuple[Any, ...]] = set()

    def left(self) -> float:
        return self.deadline - self.clock()

    def estimate(self, key: tuple[Any, ...]) -> float:
        """Seconds a candidate with compile key ``key`` is expected to take."""
        if key in self.compiled:
            return RUN_S
        mean = statistics.mean(self.compiles) if self.compiles else COMPILE_PRIOR_S
        return mean + RUN_S

    def fits(self, key: tuple[Any, ...]) -> bool:
        return self.estimate(key) <= self.left()

    def compiled_now(self, key: tuple[Any, ...], seconds: float) -> None:
        if key not in self.compiled:
            self.compiled.add(key)
            self.compiles.append(max(0.0, seconds - RUN_S))


def compile_key(cfg: MmaConfig, m: int, base: int) -> tuple[Any, ...]:
    """What a new Triton compile depends on (the kernel's constexprs; K splits are runtime)."""
    return (cfg.block_r, cfg.block_k, cfg.num_warps, cfg.num_stages, cfg.tokens(m), base,
            cfg.stream_k > 0, cfg.inner_split)  # fmt: skip


def graph_time(calls: Sequence[Callable[[], Any]], device: torch.device, reps: int = 4) -> float:
    """Seconds per call of ``calls`` run round-robin ``reps`` times inside one CUDA graph."""
    for c in calls:
        c()
    torch.cuda.synchronize(device)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            for c in calls:
                c()
    g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        g.replay()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / 1e3 / (3 * reps * len(calls))


def check(
    cfg: MmaConfig | Callable[..., Tensor], w: Tensor, t: Any, counters: Tensor, m: int
) -> str | None:
    """None if ``cfg`` (a tiling, or an agent kernel of the ``w12-gemm`` slot's signature)
    computes the reference on ``w`` (bf16 ``[N, K]``, W12 ``t``); else why not."""
    from specpilot.kernels.w12_mma import w12_mma

    kernel = cfg if callable(cfg) else partial(w12_mma, cfg=cfg)

    k = w.shape[1]
    cols = torch.arange(min(16, k), device=w.device)
    eye = torch.zeros(len(cols), k, dtype=torch.bfloat16, device=w.device)
    eye[torch.arange(len(cols), device=w.device), cols] = 1.0
    y = kernel(eye, t, counters)
    finite = bool(w[:, cols].float().isfinite().all())
    if finite and not torch.equal(y.view(torch.int16), w[:, cols].T.contiguous().view(torch.int16)):
        return "one-hot probe: the decoded weights differ from the checkpoint's"
    x = torch.randn(m, k, device=w.device, generator=torch.Generator(w.device).manual_seed(m))
    x = x.to(torch.bfloat16)
    y = kernel(x, t, counters).double()
    z = x.double() @ w.double().T
    bound = 2.0**-8 * z.abs() + k * 2.0**-23 * (x.double().abs() @ w.double().abs().T) + 2.0**-133
    ok = z.isfinite()
    if not bool(((y - z).abs()[ok] <= bound[ok]).all()):
        return "outside the fp32-reordering bound against the fp64 product"
    return None


__all__ = [
    "COMPILE_PRIOR_S",
    "KERNEL",
    "RUN_S",
    "CompileBudget",
    "KernelSearch",
    "SearchRow",
    "check",
    "compile_key",
    "graph_time",
]
