"""A smaller model with the target's tokenizer drafts greedily, k tokens per cycle.

The drafter keeps its own KV cache. Instead of being told what was accepted, it compares the
context it is given with the tokens it fed last time and rolls its cache back to the common
prefix (free, see ``KVCache``), then feeds the new tail (usually the bonus token, or one
accepted draft plus the bonus) and drafts from there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specpilot.drafters.base import DraftProposal
from specpilot.errors import IncompatibleDrafterError
from specpilot.models.kv_cache import KVCache
from specpilot.models.transformer import Transformer


class DraftModelDrafter:
    name = "draft-model"

    def __init__(
        self, model: Transformer, k: int = 5, target_vocab_size: int | None = None
    ) -> None:
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        if target_vocab_size is not None and model.cfg.vocab_size != target_vocab_size:
            raise IncompatibleDrafterError(
                f"The drafter's vocabulary has {model.cfg.vocab_size} tokens but the target's has "
                f"{target_vocab_size}; a draft model must share the target's tokenizer."
            )
        self.model = model
        self.k = k
        self._cache: KVCache | None = None
        self._fed: list[list[int]] = []  # per row: the tokens whose KV is in the cache

    def start(self, contexts: Sequence[Sequence[int]]) -> None:
        need = max(len(c) for c in contexts) + 4 * self.k + 8
        b = len(contexts)
        cache = self._cache
        if cache is None or cache.batch_size != b or cache.max_seq_len < need:
            cache = self.model.allocate_cache(b, max(need, 256))
        cache.reset()
        self._cache = cache
        self._fed = [[] for _ in contexts]

    def ensure_capacity(self, max_context: int) -> None:
        """Grow the cache (copying nothing: the drafter re-prefills) if a context outgrows it."""
        if self._cache is not None and max_context + self.k + 2 > self._cache.max_seq_len:
            self._cache = None
            self._fed = [[] for _ in self._fed]

    @torch.inference_mode()
    def propose(self, contexts: Sequence[Sequence[int]], max_lens: Sequence[int]) -> DraftProposal:
        self.ensure_capacity(max(len(c) for c in contexts))
        if self._cache is None:
            self.start(contexts)
        cache = self._cache
        assert cache is not None
        dev = self.model.device
        b = len(contexts)
        tails: list[list[int]] = []
        for row, ctx in enumerate(contexts):
            fed = self._fed[row]
            common = 0
            limit = min(len(fed), len(ctx))
            while common < limit and fed[common] == ctx[common]:
                common += 1
            if common == len(ctx):  # the whole context was fed: re-feed its last token
                common -= 1
            cache.commit(row, common)
            self._fed[row] = list(ctx[:common])
            tails.append(list(ctx[common:]))

        width = max(len(t) for t in tails)
        chunk = torch.zeros(b, width, dtype=torch.int64)
        for row, tail in enumerate(tails):
            chunk[row, : len(tail)] = torch.tensor(tail, dtype=torch.int64)
        last = torch.tensor([len(t) - 1 for t in tails], dtype=torch.int64, device=dev)[:, None]
        logits = self.model(chunk.to(dev), cache, logits_rows=last).logits  # [B, 1, V]
        for row, tail in enumerate(tails):
            cache.commit(row, int(cache.lengths[row]) + len(tail))
            self._fed[row].extend(tail)

        steps = min(self.k, max(max_lens)) if max_lens else self.k
        drafts = torch.zeros(b, max(steps, 0), dtype=torch.int64, device=dev)
        for i in range(steps):
            nxt = logits[:, -1].argmax(dim=-1)  # [B]
            drafts[:, i] = nxt
            if i + 1 < steps:
                logits = self.model(nxt[:, None], cache).logits  # [B, 1, V]
                cache.lengths += 1
        fed_drafts = drafts[:, : max(steps - 1, 0)].tolist()
        for row in range(b):
            self._fed[row].extend(fed_drafts[row])
        lengths = [max(0, min(steps, m)) for m in max_lens]
        return DraftProposal(tokens=drafts, lengths=lengths)
