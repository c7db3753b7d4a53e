"""Device-resident decode state shared by every captured graph, and the on-GPU accept/commit.

Every tensor here is allocated once per (batch, capacity) and never reallocated, so CUDA graphs
captured against it stay valid. Graph bodies only read and write these buffers in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from specpilot.engine.verify import greedy_verify


@dataclass(slots=True)
class DecodeState:
    """Committed-sequence state on the device. Row b's KV cache is valid for ``committed_len - 1``
    slots: the last committed token (``pending``) is fed by the next forward."""

    pending: Tensor  # [B] int64: last committed token
    committed_len: Tensor  # [B] int64: committed tokens per row, prompt included
    prev_committed: Tensor  # [B] int64: committed_len before the last commit
    tokens: Tensor  # [B, S] int64: prompt + committed tokens; scratch past committed_len
    drafts: Tensor  # [B, K_max] int64: this cycle's drafted tokens
    draft_lens: Tensor  # [B] int64: valid drafted tokens per row
    verify_argmax: Tensor  # [B, K_max + 1] int64: a_0..a_K of the last verify forward
    accepted: Tensor  # [B] int64: accepted draft tokens n of the last cycle
    active: Tensor  # [B] int64: 1 while a row decodes; a finished row is frozen (commits nothing)
    cycle: Tensor  # [1] int64: cycles committed so far

    @classmethod
    def allocate(cls, batch: int, capacity: int, k_max: int, device: torch.device) -> DecodeState:
        def z(*shape: int) -> Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=device)

        return cls(
            pending=z(batch),
            committed_len=z(batch),
            prev_committed=z(batch),
            tokens=z(batch, capacity),
            drafts=z(batch, max(k_max, 1)),
            draft_lens=z(batch),
            verify_argmax=z(batch, k_max + 1),
            accepted=z(batch),
            active=z(batch),
            cycle=z(1),
        )

    @property
    def batch_size(self) -> int:
        return int(self.pending.shape[0])

    @property
    def capacity(self) -> int:
        return int(self.tokens.shape[1])

    _SMALL = ("pending", "committed_len", "prev_committed", "accepted", "active", "cycle")

    def snapshot(self) -> dict[str, Tensor]:
        """Copies of the small state (tokens past committed_len are scratch and need none)."""
        return {name: getattr(self, name).clone() for name in self._SMALL}

    def restore(self, snap: dict[str, Tensor]) -> None:
        for name, value in snap.items():
            getattr(self, name).copy_(value)


def accept_and_commit(state: DecodeState, k: int) -> None:
    """Greedy acceptance of ``drafts[:, :k]`` against ``verify_argmax[:, :k+1]``, on the device.

    Committed tokens are ``a_0..a_n`` (the accepted drafts equal the target's argmax, and ``a_n``
    is the bonus); all ``k + 1`` argmax values are scattered after the committed prefix, of which
    only the first ``n + 1`` become committed. Frozen rows commit nothing.
    """
    argmax = state.verify_argmax[:, : k + 1]  # [B, k+1]
    outcome = greedy_verify(state.drafts[:, :k], state.draft_lens, argmax)
    commit_block(state, argmax, outcome.accepted_len * state.active)


def commit_block(state: DecodeState, block: Tensor, n: Tensor) -> None:
    """Commit ``block[b, :n[b] + 1]`` (accepted tokens, then the bonus ``block[b, n[b]]``) for
    every active row, on the device. All of ``block [B, W]`` is scattered after the committed
    prefix; only the first ``n + 1`` become committed. Frozen rows commit nothing."""
    bonus = block.gather(1, n[:, None]).squeeze(1)  # [B]
    last = state.capacity - 1
    idx = (state.committed_len[:, None] + torch.arange(block.shape[1], device=block.device)).clamp_(
        max=last
    )  # [B, W]
    state.tokens.scatter_(1, idx, block)
    state.prev_committed.copy_(state.committed_len)
    state.committed_len.add_((n + 1) * state.active)
    state.pending.copy_(torch.where(state.active.bool(), bonus, state.pending))
    state.accepted.copy_(n)
    state.cycle.add_(1)
