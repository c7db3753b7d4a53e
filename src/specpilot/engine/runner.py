"""How a step runs: eagerly, or replayed from a CUDA graph captured on first use per key.

The cycle (``engine/engine.py``) decides *what* runs; the runner decides *how*. A step function
reads and writes only persistent buffers (the row state, KV caches, drafter and plan buffers),
never syncs with the host and has fixed shapes for its key (e.g. ``("verify", width, attn_len)``).
A step that is not graph-safe (a host drafter, a mechanism that decides on the host) is declared
so and always runs eagerly.

Graphs: the first call of a key runs the step once eagerly to warm up (Triton JIT, cuBLAS
handles, allocator growth), restores the small row state that run advanced, captures it, then
replays. K/V the warm-up wrote lies at or past the committed length, where a replay rewrites it.
All graphs share one memory pool; they replay one at a time on one stream, and nothing a graph
leaves in pool memory is read by another.

Warm-up (``engine/warmup.py``): under :meth:`Runner.capture_only` a step is captured if its key
has no graph yet and is not replayed, so a server can capture every shape it will meet before
its first request instead of stalling every stream once per new shape.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import torch

from specpilot.engine.rows import RowState

StepFn = Callable[[], None]


def _no_wait() -> None:
    return None


class Runner:
    """Runs steps eagerly (``use_graphs=False``) or from CUDA graphs."""

    def __init__(self, device: torch.device, use_graphs: bool) -> None:
        if use_graphs and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device; run eagerly on the CPU.")
        self.device = device
        self.use_graphs = use_graphs
        self._graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}
        self._pool: Any = None  # torch's opaque pool handle
        self.captures = 0
        self._variant: Hashable = None
        self._warming: list[Hashable] | None = None

    @contextlib.contextmanager
    def variant(self, tag: Hashable) -> Iterator[None]:
        """Steps run meanwhile get graphs of their own (e.g. a verify redone with the stock
        head: same key, different work)."""
        saved = self._variant
        self._variant = tag if saved is None else (saved, tag)  # nested: both tell the graphs apart
        try:
            yield
        finally:
            self._variant = saved

    @contextlib.contextmanager
    def capture_only(self) -> Iterator[list[Hashable]]:
        """Steps run meanwhile are captured when their key has no graph yet, and neither
        replayed nor run: a step that runs eagerly does nothing, a captured one only its
        capture's warm-up run (whose small row state is restored). Yields the keys captured
        meanwhile, in order (variants included)."""
        saved, keys = self._warming, list[Hashable]()
        self._warming = keys
        try:
            yield keys
        finally:
            self._warming = saved

    def reset(self) -> None:
        """Forget every graph (the buffers they were captured on are being replaced)."""
        self._graphs.clear()
        self._pool = None  # the old pool dies with its graphs; never capture into it again

    def run(self, key: Hashable, fn: StepFn, state: RowState, graph_safe: bool = True) -> None:
        warming = self._warming
        if not (self.use_graphs and graph_safe):
            if warming is None:
                fn()
            return
        if self._variant is not None:
            key = (key, self._variant)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._capture(fn, state)
            self._graphs[key] = graph
            if warming is not None:
                warming.append(key)
        if warming is None:
            graph.replay()

    @property
    def keys(self) -> list[Hashable]:
        """The keys that have a graph (variants included), in capture order."""
        return list(self._graphs)

    def _capture(self, fn: StepFn, state: RowState) -> torch.cuda.CUDAGraph:
        snap = state.snapshot()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        state.restore(snap)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread-local: CUDA work of other threads (a test's reference engine) may go on meanwhile
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            fn()
        self.captures += 1
        return graph

    def fence(self) -> Callable[[], None]:
        """A mark after the work queued so far; calling it waits until that work is done (a
        CUDA event; nothing to wait for when eager on the CPU)."""
        if self.device.type != "cuda":
            return _no_wait
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event.synchronize

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
