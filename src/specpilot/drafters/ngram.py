"""Prompt-lookup (n-gram) drafting: copy what followed the last occurrence of the current suffix.

Training-free and nearly free to run; it shines when the answer repeats the prompt (edits,
extraction, summaries that quote). The index maps every n-gram of the context to the position
right after its latest occurrence and is grown incrementally, since contexts only grow.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from specpilot.drafters.base import DraftRows, HostDrafter
from specpilot.drafters.tree import TreeProposal, TreeShape, TrieBuilder, empty_trees, pack_trees

RECENT_OCCURRENCES = 8
"""Occurrences per n-gram remembered for trees (most recent first); the chain needs only one."""


@dataclass(slots=True)
class _RowIndex:
    indexed: int = 0  # grams ending at positions < indexed are in `last`
    last: dict[tuple[int, ...], int] = field(default_factory=dict)  # gram -> position after it
    tree_indexed: int = 0  # like `indexed`, for `recent` (built only when trees are asked for)
    recent: dict[tuple[int, ...], list[int]] = field(default_factory=dict)  # gram -> positions


class NgramDrafter(HostDrafter):
    """Proposes up to ``k`` tokens by matching the longest suffix n-gram (``max_n`` down to ``min_n``)."""

    name = "ngram"

    def __init__(self, k: int = 8, max_n: int = 3, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes must satisfy 1 <= min_n <= max_n, got {min_n}..{max_n}")
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        self.k, self.max_n, self.min_n = k, max_n, min_n
        self._rows: list[_RowIndex] = []

    def bind(self, rows: DraftRows) -> None:
        self._rows = [_RowIndex() for _ in range(rows.state.batch_size)]

    def admitted(self, rows: DraftRows, which: Sequence[int]) -> None:
        """These rows hold new sequences: forget their indexes."""
        for row in which:
            self._rows[row] = _RowIndex()

    def resync(self, rows: DraftRows, which: Sequence[int], since: Sequence[int]) -> None:
        """Nothing to do: the index catches up from ``rows.contexts`` at the next lookup."""
        return None

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

    def _index_recent(self, row: _RowIndex, ctx: Sequence[int]) -> None:
        end = len(ctx) - 1
        for j in range(max(row.tree_indexed, 1), end + 1):
            for n in range(self.min_n, self.max_n + 1):
                if j - n >= 0:
                    seen = row.recent.setdefault(tuple(ctx[j - n : j]), [])
                    seen.append(j)
                    if len(seen) > RECENT_OCCURRENCES:
                        del seen[0]
        row.tree_indexed = max(row.tree_indexed, end + 1)

    def lookup_tree(
        self, row: _RowIndex, ctx: Sequence[int], shape: TreeShape, limit: int
    ) -> TrieBuilder:
        """Continuations of every suffix match — longest n first, then most recent — as a trie.

        The first one inserted is what :meth:`lookup` proposes, so the tree's first path is the
        chain proposal (the tree never accepts less than the chain of the same depth).
        """
        self._index_recent(row, ctx)
        trie = TrieBuilder(shape, limit)
        for n in range(min(self.max_n, len(ctx)), self.min_n - 1, -1):
            for pos in reversed(row.recent.get(tuple(ctx[len(ctx) - n :]), [])):
                if trie.full:
                    return trie
                trie.insert(ctx[pos : pos + trie.max_depth])
        return trie

    def propose_tree(self, rows: DraftRows, shape: TreeShape) -> TreeProposal:
        """Several candidate continuations per decoding row, merged into one tree under ``shape``."""
        contexts, active = rows.contexts, rows.active
        if not any(active):
            return empty_trees(len(active))
        tries = [
            self.lookup_tree(index, ctx, shape, shape.depth).nodes if a else []
            for index, ctx, a in zip(self._rows, contexts, active, strict=True)
        ]
        return pack_trees(tries)

    def propose(self, rows: DraftRows, attn_len: int) -> list[int]:
        drafts = [
            self.lookup(index, ctx, self.k) if a else []
            for index, ctx, a in zip(self._rows, rows.contexts, rows.active, strict=True)
        ]
        return rows.write_drafts(drafts)
