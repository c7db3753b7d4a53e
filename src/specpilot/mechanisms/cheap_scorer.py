"""Greedy tokens of a cheap model after given prefixes, with its own KV cache kept in step.

The scorer never hears what the exact target accepted. Like ``DraftModelDrafter`` it remembers the
tokens whose K/V it holds per row (``fed``), and on every call compares them with the sequence it
is asked about: the cache rolls back (free, ``KVCache.commit``) to the common prefix, and only the
new tail is fed. So whatever the engine committed or rejected, the cheap cache holds exactly the
K/V of a prefix of the sequence it scores.
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

    def _ensure(self, batch: int, longest: int) -> KVCache:
        if len(self._fed) != batch:
            self.start(batch)
        cache = self._cache
        if cache is None or cache.max_seq_len < longest + 1:
            size = min(longest + SLACK, self.model.max_positions)
            cache = self.model.allocate_cache(batch, max(size, longest + 1))
            self._cache = cache
            self._fed = [[] for _ in range(batch)]  # a fresh cache: re-prefill every row
        return cache

    @torch.inference_mode()
    def greedy_after(self, seqs: Sequence[Sequence[int]], first: Sequence[int]) -> list[list[int]]:
        """Per row b, the cheap model's greedy token after ``seqs[b][:p]`` for every
        ``p = first[b] .. len(seqs[b])`` (so ``len(seqs[b]) - first[b] + 1`` tokens; 1 ≤ first[b])."""
        b = len(seqs)
        cache = self._ensure(b, max(len(s) for s in seqs))
        dev = self.model.device
        tails: list[list[int]] = []
        skip: list[int] = []  # per row: tail rows before the first one whose argmax is wanted
        for row, (seq, p0) in enumerate(zip(seqs, first, strict=True)):
            if not 1 <= p0 <= len(seq):
                raise ValueError(f"row {row}: first={p0} outside 1..{len(seq)}")
            fed = self._fed[row]
            common, limit = 0, min(len(fed), p0 - 1)  # the token at p0 - 1 is always (re)fed
            while common < limit and fed[common] == seq[common]:
                common += 1
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
        greedy = self.model.forward_argmax(chunk.to(dev), cache, logits_rows=rows.to(dev))
        greedy_l = greedy.tolist()  # [B, R]
        for row, tail in enumerate(tails):
            cache.commit(row, int(cache.lengths[row]) + len(tail))
            self._fed[row].extend(tail)
        return [greedy_l[row][: want[row]] for row in range(b)]


__all__ = ["CheapScorer"]
