"""A one-row prefill from slot 0, as a step of the runner: one CUDA graph per width bucket.

An eager 8B prefill of a ~40-token chat prompt spends about 12 ms of host time (the layer
body's ~300 launches, ~80 small host→device copies, ~300 allocations) on ~5 ms of GPU work
(torch profile on the H200, docs/SERVE.md), and the time to first token waits for it. Here the
common case of a serving row, a prompt (or its first segment) fed from slot 0 into a row of its
own, runs as a fixed-shape step that the runner captures per width and replays:

* the segment's ``n`` tokens are padded with zeros to the width bucket ``w >= n`` and copied,
  with the index of the last real token and the row, in one host→device copy into ``inputs``;
* the forward runs over a one-row **scratch** cache (``[1, H_kv, w_max, D]`` per layer) from
  slot 0 with the causal mask, so every real token's output reads only the real tokens before
  it; the padding rows come after them and change nothing they read;
* the scratch K/V of slots ``[0, w)`` is copied into the row (``index_copy_`` with the row as a
  device index, so one graph serves every row); slots ``[n, w)`` of the row hold the padding's
  K/V, past its committed length ``n + 1``, where the next forward writes before any query
  reads (``models/kv_cache.py``);
* the last real token's output and its argmax land in buffers of their own (so a prefill takes
  this path only when the model's ``argmax_head`` plug, if any, is graph-safe).

On the CPU (and whenever the runner is eager) the same step runs eagerly, so the tests check the
padded, scratch-cache path against plain AR token for token. Rounding: the products run over
``w`` rows instead of ``n``, so in bf16 a GEMM may pick another kernel for the real rows, as a
batched verify does; the first token is still the target's argmax after the prompt (token forcing
checks it as it checks every other committed token).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from specpilot.engine.rows import RowState
    from specpilot.engine.runner import Runner
    from specpilot.models.forward import Forward
    from specpilot.models.kv_cache import KVCache
    from specpilot.models.transformer import Transformer

PREFILL_WIDTHS = (16, 32, 48, 64, 96, 128, 192, 256, 384, 512)
"""Width buckets of the graphed prefill (on CUDA graphs). Up to ~256 tokens an 8B forward reads
its weights once whatever the width (memory-bound on the H200), so padding to the bucket costs
little; longer segments run eagerly, where the launches are a small part of the forward."""


class PrefillGraph:
    """The buffers of the graphed prefill of one engine (allocated once, on first use)."""

    def __init__(self, target: Transformer, widths: Sequence[int]) -> None:
        if not widths or any(w < 1 for w in widths) or list(widths) != sorted(set(widths)):
            raise ValueError(f"prefill widths must be increasing and positive, got {widths}")
        dev = target.device
        self.widths = tuple(widths)
        self.w_max = self.widths[-1]
        self.scratch: KVCache = target.allocate_cache(1, self.w_max)
        self.inputs = torch.zeros(self.w_max + 2, dtype=torch.int64, device=dev)
        """[w_max + 2]: the padded tokens, then the last real token's index, then the row."""
        self._host = torch.zeros(self.w_max + 2, dtype=torch.int64)
        self.start = torch.zeros(1, dtype=torch.int64, device=dev)  # [1]: slot 0
        self.x_last = torch.zeros(1, target.cfg.hidden_size, dtype=target.dtype, device=dev)
        self.first = torch.zeros(1, dtype=torch.int64, device=dev)  # [1]

    def width(self, n: int, capacity: int) -> int | None:
        """The bucket for ``n`` tokens in a row of ``capacity`` slots (None: run eagerly)."""
        for w in self.widths:
            if w >= n:
                return w if w <= capacity else None
        return None

    def run(
        self,
        runner: Runner,
        state: RowState,
        fwd: Forward,
        cache: KVCache,
        row: int,
        ids: Sequence[int],
        w: int,
    ) -> Tensor:
        """Feed ``ids`` (``len(ids) <= w``) to ``row`` from slot 0; returns its tokens on the
        device (``[1, n]``, a view of ``inputs``). ``x_last`` and ``first`` hold the last
        token's output and its argmax once the step ran."""
        n = len(ids)
        host = self._host
        host.zero_()
        host[:n] = torch.tensor(list(ids), dtype=torch.int64)
        host[self.w_max] = n - 1
        host[self.w_max + 1] = row
        self.inputs.copy_(host)  # one host->device copy (synchronous: the buffer is reused)
        runner.run(("prefill", w), self._step(fwd, cache, w), state)
        return self.inputs[:n][None]

    def _step(self, fwd: Forward, cache: KVCache, w: int) -> Callable[[], None]:
        wm = self.w_max
        inputs, scratch, start, x_last, first = (
            self.inputs, self.scratch, self.start, self.x_last, self.first
        )  # fmt: skip

        def step() -> None:
            tokens = inputs[:w][None]  # [1, w]
            x = fwd.dense(tokens, scratch, start, w)  # [w, hidden]
            x_last.copy_(x.index_select(0, inputs[wm : wm + 1]))
            first.copy_(fwd.argmax(x_last))
            row = inputs[wm + 1 : wm + 2]  # [1]
            for dst, src in zip([*cache.k, *cache.v], [*scratch.k, *scratch.v], strict=True):
                dst[:, :, :w].index_copy_(0, row, src[:, :, :w])

        return step


class GraphedPrefill:
    """Mixed into the engine: its graphed prefill, made on first use."""

    target: Transformer
    runner: Runner
    prefill_widths: tuple[int, ...] | None
    _prefill_graph: PrefillGraph | None

    def prefill_graph(self) -> PrefillGraph | None:
        """The graphed prefill's buffers (made on first use), or None when it is off."""
        widths = self.prefill_widths
        if widths is None:
            widths = PREFILL_WIDTHS if self.runner.use_graphs else ()
        if not widths:
            return None
        pg = self._prefill_graph
        if pg is None or pg.widths != tuple(widths):
            if pg is not None:
                self.runner.reset()  # graphs captured on the old buffers
            pg = self._prefill_graph = PrefillGraph(self.target, widths)
        return pg


__all__ = ["PREFILL_WIDTHS", "GraphedPrefill", "PrefillGraph"]
