"""Greedy tokens of a cheap model after given prefixes, with its own KV cache kept in step.

The scorer never hears what the exact target accepted. Like ``DraftModelDrafter`` it remembers the
tokens whose K/V it holds per row (``fed``), and on every call compares them with the sequence it
is asked about: the cache rolls back (free, ``KVCache.commit``) to the common prefix, and only the
new tail is fed. So whatever the engine committed or rejected, the cheap cache holds exactly the
K/V of a prefix of the sequence it scores.

A call may pass fewer rows than the scorer holds (the continuous-batching scheduler runs only the
slots up to the highest occupied one): they are its first rows, and the others keep their K/V.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specpilot.models.kv_cache import KVCache
from specpilot.models.transformer import Transformer

SLACK = 256
"""Extra cache slots allocated past the longest sequence seen, so growth rarely re-prefills."""


class CheapScorer:
    def __init__(self, model: Transformer) -> None:
        self.model = model
        self._cache: KVCache | None = None
        self._fed: list[list[int]] = []  # per row: the tokens whose K/V is in the cache

    def start(self, batch: int) -> None:
        """A new batch begins: forget every row (the cache is reused when it fits)."""
        self._fed = [[] for _ in range(batch)]
        if self._cache is not None and self._cache.batch_size != batch:
            self._cache = None
        if self._cache is not None:
            self._cache.reset()

    @property
    def rows(self) -> int:
        """Rows the scorer holds (``start``, or grown by a wider call)."""
        return len(self._fed)

    def cached(self, row: int) -> list[int]:
        """The tokens whose K/V row ``row`` holds (a prefix of the last sequence it scored)."""
        return list(self._fed[row]) if row < len(self._fed) else []

    def _ensure(self, need: int) -> tuple[KVCache, bool]:
        """A cache of every row with at least ``need`` slots; True when it is new (empty)."""
        cache, rows = self._cache, len(self._fed)
        if cache is not None and cache.max_seq_len >= need:
            return cache, False
        size = min(need + SLACK, self.model.max_positions)
        self._cache = self.model.allocate_cache(rows, max(size, need))
        self._fed = [[] for _ in range(rows)]  # a fresh cache: re-prefill every row
        return self._cache, True

    def _common(self, row: int, seq: Sequence[int], p0: int) -> int:
        """Tokens of ``seq`` whose K/V the row holds; the token at ``p0 - 1`` is always (re)fed."""
        fed = self._fed[row]
        common, limit = 0, min(len(fed), p0 - 1)
        while common < limit and fed[common] == seq[common]:
            common += 1
        return common

    @torch.inference_mode()
    def greedy_after(self, seqs: Sequence[Sequence[int]], first: Sequence[int]) -> list[list[int]]:
        """Per row b, the cheap model's greedy token after ``seqs[b][:p]`` for every
        ``p = first[b] .. len(seqs[b])`` (so ``len(seqs[b]) - first[b] + 1`` tokens; 1 ≤ first[b])."""
        b = len(seqs)
        if len(self._fed) < b:
            self.start(b)
        for row, (seq, p0) in enumerate(zip(seqs, first, strict=True)):
            if not 1 <= p0 <= len(seq):
                raise ValueError(f"row {row}: first={p0} outside 1..{len(seq)}")
        commons = [
            self._common(row, s, p0) for row, (s, p0) in enumerate(zip(seqs, first, strict=True))
        ]
        width = max(len(s) - c for s, c in zip(seqs, commons, strict=True))
        # Every row is padded to ``width`` from its own length: the widest write ends there.
        full, fresh = self._ensure(max(commons) + width + 1)
        if fresh:
            commons = [0] * b
        cache = full if b == full.batch_size else full.slice(0, b)
        dev = self.model.device
        tails: list[list[int]] = []
        skip: list[int] = []  # per row: tail rows before the first one whose argmax is wanted
        for row, (seq, p0, common) in enumerate(zip(seqs, first, commons, strict=True)):
            cache.commit(row, common)
            self._fed[row] = list(seq[:common])
            tails.append(list(seq[common:]))
            skip.append(p0 - 1 - common)
        width = max(len(t) for t in tails)
        chunk = torch.zeros(b, width, dtype=torch.int64)
        for row, tail in enumerate(tails):
            chunk[row, : len(tail)] = torch.tensor(tail, dtype=torch.int64)
        want = [len(t) - s for t, s in zip(tails, skip, strict=True)]
        rows = torch.tensor(
            [
                [min(s + i, len(t) - 1) for i in range(max(want))]
                for t, s in zip(tails, skip, strict=False)
            ],
            dtype=torch.int64,
        )  # [B, R]: the tail rows whose greedy token is wanted (short rows repeat their last)
        start = cache.lengths.to(dev)
        # Padding past a short row's tail may run past the RoPE table; its K/V is never read.
        positions = (start[:, None] + torch.arange(width, device=dev)).clamp(
            max=self.model.max_positions - 1
        )  # [B, T]
        greedy = self.model.forward_argmax(
            chunk.to(dev), cache, positions=positions, logits_rows=rows.to(dev)
        )
        greedy_l = greedy.tolist()  # [B, R]
        for row, tail in enumerate(tails):
            cache.commit(row, int(cache.lengths[row]) + len(tail))
            self._fed[row].extend(tail)
        return [greedy_l[row][: want[row]] for row in range(b)]


def idle_safe(
    scorer: CheapScorer,
    contexts: Sequence[Sequence[int]],
    active: Sequence[bool],
    tails: Sequence[Sequence[int]],
    from_end: bool = False,
) -> tuple[list[list[int]], list[int]]:
    """Arguments of :meth:`CheapScorer.greedy_after` covering every row of a batch: a decoding
    row scores its context plus ``tails[b]`` (the greedy token after every prefix from the end of
    its context on, or with ``from_end`` only after the whole sequence); any other row re-feeds
    its last cached token, keeping its K/V."""
    seqs: list[list[int]] = []
    first: list[int] = []
    for b, (ctx, a) in enumerate(zip(contexts, active, strict=True)):
        if a:
            seq = [*ctx, *tails[b]]
            seqs.append(seq)
            first.append(len(seq) if from_end else len(ctx))
        else:
            held = scorer.cached(b) or [0]
            seqs.append(held)
            first.append(len(held))
    return seqs, first


__all__ = ["CheapScorer", "idle_safe"]
