"""Prompt-lookup (n-gram) drafting: copy what followed the last occurrence of the current suffix.

Training-free and nearly free to run; it shines when the answer repeats the prompt (edits,
extraction, summaries that quote). The index maps every n-gram of the context to the position
right after its latest occurrence and is grown incrementally, since contexts only grow.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specpilot.drafters.base import DraftProposal


@dataclass(slots=True)
class _RowIndex:
    indexed: int = 0  # grams ending at positions < indexed are in `last`
    last: dict[tuple[int, ...], int] = field(default_factory=dict)  # gram -> position after it


class NgramDrafter:
    """Proposes up to ``k`` tokens by matching the longest suffix n-gram (``max_n`` down to ``min_n``)."""

    name = "ngram"

    def __init__(
        self, k: int = 8, max_n: int = 3, min_n: int = 1, device: torch.device | str = "cpu"
    ) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes must satisfy 1 <= min_n <= max_n, got {min_n}..{max_n}")
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        self.k, self.max_n, self.min_n = k, max_n, min_n
        self.device = torch.device(device)
        self._rows: list[_RowIndex] = []

    def start(self, contexts: Sequence[Sequence[int]]) -> None:
        self._rows = [_RowIndex() for _ in contexts]

    def _index(self, row: _RowIndex, ctx: Sequence[int]) -> None:
        # Index grams that end strictly before the last token, so the suffix never finds itself.
        end = len(ctx) - 1
        for j in range(max(row.indexed, 1), end + 1):
            for n in range(self.min_n, self.max_n + 1):
                if j - n >= 0:
                    row.last[tuple(ctx[j - n : j])] = j
        row.indexed = max(row.indexed, end + 1)

    def lookup(self, row: _RowIndex, ctx: Sequence[int], limit: int) -> list[int]:
        self._index(row, ctx)
        for n in range(min(self.max_n, len(ctx)), self.min_n - 1, -1):
            pos = row.last.get(tuple(ctx[len(ctx) - n :]))
            if pos is not None:
                return list(ctx[pos : pos + limit])
        return []

    def propose(self, contexts: Sequence[Sequence[int]], max_lens: Sequence[int]) -> DraftProposal:
        drafts = [
            self.lookup(row, ctx, min(self.k, m))
            for row, ctx, m in zip(self._rows, contexts, max_lens, strict=True)
        ]
        width = max((len(d) for d in drafts), default=0)
        tokens = torch.zeros(len(drafts), width, dtype=torch.int64)
        for b, d in enumerate(drafts):
            tokens[b, : len(d)] = torch.tensor(d, dtype=torch.int64)
        return DraftProposal(tokens=tokens.to(self.device), lengths=[len(d) for d in drafts])
