"""Verify strategies: the ``verify_strategy`` plug point of the decode loop.

A strategy owns one cycle's propose → verify → accept → KV-commit for every row of the batch:
``propose`` asks the drafter for what this strategy verifies (a chain of tokens, a tree, ...), and
``verify`` runs the target once, decides what is accepted, commits the KV cache of the active rows
and returns the committed tokens. The loop then appends them (cutting at EOS or the length limit)
and keeps the statistics, so stop handling and streaming are the same for every strategy.

:class:`ChainStrategy` is the default: the classic chain of k drafted tokens, verified by
``verify_fn`` (``greedy_verify``). The tree strategy lives in ``mechanisms/tree_verify.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from specpilot.drafters.base import Drafter, DraftProposal
from specpilot.engine.verify import VerifyOutcome, greedy_verify
from specpilot.models.kv_cache import KVCache
from specpilot.models.transformer import Transformer

VerifyFn = Callable[[Tensor, Tensor, Tensor], VerifyOutcome]


@dataclass(slots=True)
class CycleOutcome:
    """What one verify forward decided, per row (inactive rows: empty and zeros)."""

    committed: list[list[int]]  # [B]: accepted drafted tokens then the bonus token
    draft_lens: list[int]  # [B]: positions drafted (chain: tokens; tree: depth of the tree)
    accepted_lens: list[int]  # [B]: accepted drafted tokens (committed = accepted + 1)


class VerifyStrategy(Protocol):
    """How a cycle proposes and verifies. Implementations keep no per-request state."""

    name: str

    def width(self, drafter: Drafter | None) -> int:
        """Most drafted tokens per row in one verify forward (sizes the KV cache)."""
        ...

    def propose(
        self, drafter: Drafter | None, contexts: Sequence[Sequence[int]], max_lens: Sequence[int]
    ) -> Any:
        """The proposal this strategy verifies; a row drafts at most ``max_lens[b]`` positions."""
        ...

    def verify(
        self,
        target: Transformer,
        cache: KVCache,
        pending: Tensor,  # [B] int64 (host): last committed token, KV not yet cached
        proposal: Any,
        active: Sequence[bool],
    ) -> CycleOutcome:
        """One target forward; commit the KV of the active rows; the committed tokens."""
        ...


class ChainStrategy:
    """Chain verification: the target runs on ``[pending, d_1..d_K]`` and ``verify_fn`` accepts."""

    name = "chain"

    def __init__(self, verify_fn: VerifyFn = greedy_verify) -> None:
        self.verify_fn = verify_fn

    def width(self, drafter: Drafter | None) -> int:
        return 0 if drafter is None else drafter.k

    def propose(
        self, drafter: Drafter | None, contexts: Sequence[Sequence[int]], max_lens: Sequence[int]
    ) -> DraftProposal:
        if drafter is None or max(max_lens) <= 0:
            b = len(contexts)
            return DraftProposal(tokens=torch.zeros(b, 0, dtype=torch.int64), lengths=[0] * b)
        return drafter.propose(contexts, max_lens)

    def verify(
        self,
        target: Transformer,
        cache: KVCache,
        pending: Tensor,
        proposal: DraftProposal,
        active: Sequence[bool],
    ) -> CycleOutcome:
        dev = target.device
        drafts_dev = proposal.tokens.to(dev)  # [B, K]
        verify_in = torch.cat([pending[:, None].to(dev), drafts_dev], dim=1)  # [B, 1+K]
        argmax = target.forward_argmax(verify_in, cache)  # [B, 1+K]
        lengths = torch.tensor(proposal.lengths, dtype=torch.int64, device=dev)
        outcome = self.verify_fn(drafts_dev, lengths, argmax)
        accepted = outcome.accepted_len.tolist()
        bonus = outcome.bonus.tolist()
        drafts = proposal.tokens.tolist()
        committed: list[list[int]] = []
        for row, is_active in enumerate(active):
            if not is_active:
                committed.append([])
                continue
            n = accepted[row]
            committed.append([*drafts[row][:n], bonus[row]])
            # KV of the pending token and the n accepted drafts is now valid.
            cache.commit(row, int(cache.lengths[row]) + n + 1)
        return CycleOutcome(
            committed=committed,
            draft_lens=[n if a else 0 for n, a in zip(proposal.lengths, active, strict=True)],
            accepted_lens=[n if a else 0 for n, a in zip(accepted, active, strict=True)],
        )
