"""The one protocol every drafter implements, and what it hands to the verifier."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from torch import Tensor


@dataclass(slots=True)
class DraftProposal:
    tokens: Tensor  # [B, K] int64 on the target's device, padded past each row's length
    lengths: list[int]  # [B]: valid drafted tokens per row, 0..K

    @property
    def width(self) -> int:
        return int(self.tokens.shape[1])


@runtime_checkable
class Drafter(Protocol):
    """Proposes continuations of each sequence; never decides what is committed.

    ``contexts[b]`` is the prompt plus every token committed so far for row b. Contexts only
    grow; a drafter that caches state (KV, n-gram index) reconciles it with the context it is
    given, so the engine never tells it what was accepted or rolled back.
    """

    name: str
    k: int
    """Most tokens proposed per row and cycle."""

    def start(self, contexts: Sequence[Sequence[int]]) -> None:
        """A new batch of sequences begins (prefill whatever the drafter needs)."""
        ...

    def propose(self, contexts: Sequence[Sequence[int]], max_lens: Sequence[int]) -> DraftProposal:
        """Up to ``min(k, max_lens[b])`` tokens for each row b."""
        ...


@runtime_checkable
class RowResettable(Protocol):
    """A drafter that can forget one row: continuous batching puts a new sequence in a slot.

    Without it the scheduler restarts the drafter on every row (correct, but it re-prefills).
    """

    def reset_row(self, row: int) -> None:
        """Row ``row`` now holds another sequence; drop whatever was built from the old one."""
        ...
