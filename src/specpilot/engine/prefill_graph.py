"""Prefills from slot 0, as a step of the runner: several rows' prompts packed into one forward,
one CUDA graph per width bucket.

An eager 8B prefill of a ~40-token chat prompt spends about 12 ms of host time (the layer
body's ~300 launches, ~80 small host→device copies, ~300 allocations) on ~5 ms of GPU work
(torch profile on the H200, docs/SERVE.md), and the time to first token waits for it; a wave of
requests that arrive together paid it again for every step that admitted some of them, and the
eager batched forward padded every row to the longest prompt. Here the common case of a serving
row, a prompt (or its first segment) fed from slot 0 into a row of its own, runs as a
fixed-shape step that the runner captures per width and replays, for one row or many at once:

* the segments of ``s`` rows are packed end to end (``n = sum(n_i)`` tokens, no padding between
  them), padded with zeros to the width bucket ``w >= n``, and copied with each token's sequence,
  position and destination (row, slot) and each sequence's last token in one host→device copy
  into ``inputs``;
* the forward runs over a one-row **scratch** cache (``[1, H_kv, w_max, D]`` per layer) with a
  block-diagonal causal mask: a token sees the tokens of its own sequence up to itself, at RoPE
  positions from 0, so every real token's output is the one its row alone would give; the
  padding (a sequence of its own, after the real tokens) changes nothing they read;
* the scratch K/V of each real token is put at its (row, slot) in the cache (``index_put_`` with
  device indices, so one graph serves every set of rows); the padding's K/V goes to the last slot
  of the pack's first row, which the engine's slot margin keeps invisible to every real query (as packed verify
  does, ``models/layout.py``);
* each sequence's last real output and its argmax land in buffers of their own (so a prefill
  takes this path only when the model's ``argmax_head`` plug, if any, is graph-safe).

Up to ``w_max`` tokens (the token budget) go in one forward, so a wave of 32 chat prompts is one
or two forwards instead of an eager forward per admitting step (``engine/admission.py`` packs).
On the CPU (and whenever the runner is eager) the same step runs eagerly, so the tests check the
packed, scratch-cache path against plain AR token for token. Rounding: the products run over
``w`` rows instead of ``n_i``, so in bf16 a GEMM may pick another kernel for the real rows, as a
batched verify does; every first token is still the target's argmax after its prompt (token
forcing checks it as it checks every other committed token).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from specpilot.models.layout import DenseLayout, additive

if TYPE_CHECKING:
    from specpilot.engine.rows import RowState
    from specpilot.engine.runner import Runner
    from specpilot.models.forward import Forward
    from specpilot.models.kv_cache import KVCache
    from specpilot.models.transformer import Transformer

PREFILL_WIDTHS: tuple[int, ...] = (16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 640, 768)
PREFILL_WIDTHS = (*PREFILL_WIDTHS, 1024, 1280, 1536, 2048, 2560, 3072, 4096)
"""Width buckets of the graphed prefill (on CUDA graphs); the last is the token budget of one
packed forward. Up to ~256 tokens an 8B forward reads its weights once whatever the width
(memory-bound on the H200), so padding a prompt to its bucket costs little; past that the forward
is compute-bound and the buckets are ~1.25x apart, so a pack's padding costs at most ~25%.
Longer segments run eagerly, where the launches are a small part of the forward."""

_TOKENS, _SEQ, _POS, _ROW, _SLOT, _LAST = range(6)
"""Rows of ``PrefillGraph.inputs``: per packed token its id, sequence (padding: ``w_max``),
RoPE position, destination row and slot; then per sequence the index of its last token."""


class PrefillGraph:
    """The buffers of the graphed prefill of one engine (allocated once, on first use)."""

    def __init__(self, target: Transformer, widths: Sequence[int], seqs: int) -> None:
        if not widths or any(w < 1 for w in widths) or list(widths) != sorted(set(widths)):
            raise ValueError(f"prefill widths must be increasing and positive, got {widths}")
        dev = target.device
        self.widths = tuple(widths)
        self.w_max = self.widths[-1]
        self.seqs = seqs
        """Most sequences one forward packs (the engine's rows)."""
        self.scratch: KVCache = target.allocate_cache(1, self.w_max)
        self.inputs = torch.zeros(6, self.w_max, dtype=torch.int64, device=dev)
        """[6, w_max]: rows ``_TOKENS .. _LAST`` (above)."""
        self._host = torch.zeros(6, self.w_max, dtype=torch.int64)
        self.x_last = torch.zeros(seqs, target.cfg.hidden_size, dtype=target.dtype, device=dev)
        """[seqs, H]: the last real token's output of each packed sequence."""
        self.first = torch.zeros(seqs, dtype=torch.int64, device=dev)  # [seqs]: its argmax

    def width(self, n: int) -> int | None:
        """The bucket for ``n`` packed tokens (None: more than the budget, run eagerly)."""
        for w in self.widths:
            if w >= n:
                return w
        return None

    def run(
        self,
        runner: Runner,
        state: RowState,
        fwd: Forward,
        cache: KVCache,
        rows: Sequence[int],
        segments: Sequence[Sequence[int]],
        w: int,
    ) -> list[Tensor]:
        """Feed ``segments[i]`` to ``rows[i]`` from slot 0, all in one forward of width ``w``
        (``sum(len) <= w``, at most ``seqs`` rows); returns each row's tokens on the device
        (``[n_i]``, views of ``inputs``). ``x_last[i]`` and ``first[i]`` hold sequence i's last
        output and its argmax once the step ran."""
        lens = [len(s) for s in segments]
        n, s = sum(lens), len(lens)
        if not (1 <= s <= self.seqs and n <= w and w in self.widths) or min(lens) < 1:
            raise ValueError(f"cannot pack {lens} into width {w} ({self.seqs} sequences)")
        ids: list[int] = []
        seq: list[int] = []
        pos: list[int] = []
        dst: list[int] = []
        for i, (row, segment) in enumerate(zip(rows, segments, strict=True)):
            ids += segment
            seq += [i] * len(segment)
            pos += range(len(segment))
            dst += [row] * len(segment)
        host = self._host
        host.zero_()
        host[_TOKENS, :n] = torch.tensor(ids, dtype=torch.int64)
        host[_SEQ, :n] = torch.tensor(seq, dtype=torch.int64)
        host[_SEQ, n:] = self.w_max  # the padding: a sequence of its own
        host[_POS, :n] = host[_SLOT, :n] = torch.tensor(pos, dtype=torch.int64)
        host[_ROW, :n] = torch.tensor(dst, dtype=torch.int64)
        host[_ROW, n:] = rows[0]
        host[_SLOT, n:] = cache.max_seq_len - 1  # the first row's last slot: never read
        ends = torch.tensor(lens, dtype=torch.int64).cumsum(0)
        host[_LAST, :s] = ends - 1
        self.inputs.copy_(host)  # one host->device copy (synchronous: the buffer is reused)
        runner.run(("prefill", w), self._step(fwd, cache, w), state)
        return [self.inputs[_TOKENS, e - k : e] for e, k in zip(ends.tolist(), lens, strict=True)]

    def _step(self, fwd: Forward, cache: KVCache, w: int) -> Callable[[], None]:
        inputs, scratch, x_last, first = self.inputs, self.scratch, self.x_last, self.first
        s = min(self.seqs, w)  # a sequence has at least one token
        dtype = fwd.model.dtype

        def step() -> None:
            seq, pos = inputs[_SEQ, :w], inputs[_POS, :w]  # [w], [w]
            # token i sees token j of its own sequence at or before it: block-diagonal causal
            visible = (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])  # [w, w]
            mask = additive(visible[None], fwd.groups, dtype)  # [1, 1, G*w, w]
            slots = torch.arange(w, device=seq.device)  # [w]: scratch slots
            lay = DenseLayout(1, w, w, pos, mask, slots=slots)
            x = fwd.run_layers(fwd.embed(inputs[_TOKENS, :w]), scratch, lay)  # [w, hidden]
            x_last[:s].copy_(x.index_select(0, inputs[_LAST, :s]))
            first[:s].copy_(fwd.argmax(x_last[:s]))
            where = (inputs[_ROW, :w], inputs[_SLOT, :w])  # [w], [w]
            for dst, src in zip([*cache.k, *cache.v], [*scratch.k, *scratch.v], strict=True):
                # [B, S, H_kv, D] at (row, slot) <- [w, H_kv, D]
                dst.permute(0, 2, 1, 3).index_put_(where, src[0, :, :w].transpose(0, 1))

        return step


class GraphedPrefill:
    """Mixed into the engine: its graphed prefill, made on first use."""

    target: Transformer
    runner: Runner
    batch: int
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
        if pg is None or pg.widths != tuple(widths) or pg.seqs != self.batch:
            if pg is not None:
                self.runner.reset()  # graphs captured on the old buffers
            pg = self._prefill_graph = PrefillGraph(self.target, widths, self.batch)
        return pg


__all__ = ["PREFILL_WIDTHS", "GraphedPrefill", "PrefillGraph"]
