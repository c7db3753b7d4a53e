"""Run graph-safe step functions eagerly or as CUDA graphs, captured on first use per key.

A step function reads and writes only persistent buffers (``DecodeState``, KV caches, drafter
buffers), never syncs with the host and has fixed shapes for its key (e.g. ``("verify", k,
attn_len)``). The first call of a key runs it once eagerly to warm up (Triton JIT, cuBLAS
handles), restores the small decode state that run advanced, captures it, then replays. KV
written by the warm-up lies at or past the committed length, where a replay rewrites it.
All graphs share one memory pool; they are replayed one at a time on one stream, and nothing a
graph leaves in pool memory is read by another.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch

from specpilot.engine.device_state import DecodeState

StepFn = Callable[[], None]


class GraphRunner:
    def __init__(self, device: torch.device, use_graphs: bool) -> None:
        if use_graphs and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device; use use_graphs=False on the CPU.")
        self.device = device
        self.use_graphs = use_graphs
        self._graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}
        self._pool: Any = None  # torch's opaque pool handle
        self.captures = 0

    def reset(self) -> None:
        """Forget every graph (the buffers they were captured on are being replaced)."""
        self._graphs.clear()
        self._pool = None  # the old pool dies with its graphs; never capture into it again

    def run(self, key: Hashable, fn: StepFn, state: DecodeState) -> None:
        if not self.use_graphs:
            fn()
            return
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._capture(fn, state)
            self._graphs[key] = graph
        graph.replay()

    def _capture(self, fn: StepFn, state: DecodeState) -> torch.cuda.CUDAGraph:
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
        with torch.cuda.graph(graph, pool=self._pool):
            fn()
        self.captures += 1
        return graph
