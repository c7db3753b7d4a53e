"""The rows of a running batch: device-resident decode state and its host mirror.

Every tensor of :class:`RowState` is allocated once per (batch, capacity) and never reallocated,
so CUDA graphs captured against it stay valid; graph bodies only read and write it in place.

Row b's invariant, whatever the row is doing: ``tokens[b, :committed_len[b]]`` are its tokens,
and its KV cache holds valid entries for the first ``committed_len[b] - 1`` slots (the last
token, ``pending``, is fed by the next forward). Every forward over the batch writes each row's
K/V from slot ``committed_len - 1`` on, so it can only overwrite what is not valid yet:

* a **decoding** row (``active = 1``) commits the target's tokens each cycle;
* a row **in prefill** (its prompt entering segment by segment) is frozen (``active = 0``) at
  ``committed_len = prefilled + 1``, so cycles over the batch write past its prompt so far;
* an **idle** row is frozen at ``IDLE_LEN`` (a draft model re-feeds the last two tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

IDLE_LEN = 2
"""Committed length of an idle row."""


@dataclass(slots=True)
class RowState:
    """Committed-sequence state on the device (see the module docstring)."""

    pending: Tensor  # [B] int64: last committed token
    committed_len: Tensor  # [B] int64: committed tokens per row, prompt included
    prev_committed: Tensor  # [B] int64: committed_len before the last commit
    tokens: Tensor  # [B, S] int64: prompt + committed tokens; scratch past committed_len
    drafts: Tensor  # [B, K_max] int64: this cycle's drafted tokens
    draft_lens: Tensor  # [B] int64: valid drafted tokens per row
    verify_argmax: Tensor  # [B, K_max + 1] int64: a_0..a_K of the last verify forward
    accepted: Tensor  # [B] int64: accepted draft tokens n of the last cycle
    active: Tensor  # [B] int64: 1 while a row decodes; a frozen row commits nothing
    cut: Tensor  # [B] int64: most drafts each row may keep this cycle (a width policy's)
    cycle: Tensor  # [1] int64: cycles committed so far
    halted: Tensor  # [1] int64: 1 once a verify's head abstained; accepts commit nothing then

    @classmethod
    def allocate(cls, batch: int, capacity: int, k_max: int, device: torch.device) -> RowState:
        def z(*shape: int) -> Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=device)

        st = cls(
            pending=z(batch),
            committed_len=z(batch),
            prev_committed=z(batch),
            tokens=z(batch, capacity),
            drafts=z(batch, max(k_max, 1)),
            draft_lens=z(batch),
            verify_argmax=z(batch, k_max + 1),
            accepted=z(batch),
            active=z(batch),
            cut=z(batch),
            cycle=z(1),
            halted=z(1),
        )
        st.committed_len.fill_(IDLE_LEN)
        st.prev_committed.fill_(IDLE_LEN)
        st.cut.fill_(k_max)
        return st

    @property
    def batch_size(self) -> int:
        return int(self.pending.shape[0])

    @property
    def capacity(self) -> int:
        return int(self.tokens.shape[1])

    def reset(self, cut: int) -> None:
        """Every row idle (frozen at ``IDLE_LEN``), nothing drafted, no cycle, no halt;
        ``cut`` (the most drafts a row may keep) at ``cut``."""
        self.tokens.zero_()
        self.committed_len.fill_(IDLE_LEN)
        self.prev_committed.fill_(IDLE_LEN)
        for t in (
            self.pending, self.active, self.cycle, self.drafts, self.draft_lens, self.accepted,
            self.halted,
        ):  # fmt: skip
            t.zero_()
        self.cut.fill_(cut)

    _SMALL = (
        "pending", "committed_len", "prev_committed", "accepted", "active", "cycle", "halted",
    )  # fmt: skip

    def snapshot(self) -> dict[str, Tensor]:
        """Copies of the small state (tokens past committed_len are scratch and need none)."""
        return {name: getattr(self, name).clone() for name in self._SMALL}

    def restore(self, snap: dict[str, Tensor]) -> None:
        for name, value in snap.items():
            getattr(self, name).copy_(value)

    def head(self, n: int) -> RowState:
        """Rows ``0 .. n - 1`` (views: writes land in this state; ``cycle`` and ``halted`` are
        shared)."""
        shared = ("cycle", "halted")
        return RowState(
            **{
                f: getattr(self, f) if f in shared else getattr(self, f)[:n]
                for f in self.__dataclass_fields__
            }
        )

    def write_drafts(self, drafts: Sequence[Sequence[int]], buf: Tensor, k: int) -> list[int]:
        """Host drafts (row b: at most ``k`` tokens) into ``drafts``/``draft_lens`` through the
        pinned ``buf [B, k + 1]`` (one copy each, ordered on the stream); their lengths."""
        buf.zero_()
        lens = [min(len(d), k) for d in drafts]
        for b, (d, n) in enumerate(zip(drafts, lens, strict=True)):
            if n:
                buf[b, :n] = torch.tensor(list(d[:n]), dtype=torch.int64)
            buf[b, k] = n
        self.drafts[:, :k].copy_(buf[:, :k], non_blocking=True)
        self.draft_lens.copy_(buf[:, k], non_blocking=True)
        return lens


@dataclass(slots=True)
class HostRows:
    """What the host knows of every row without reading the device (mirrors of the state)."""

    lens: list[int]  # committed_len per row
    final: list[int]  # prompt + max new tokens per row (IDLE_LEN when idle)
    contexts: list[list[int]]  # prompt + committed tokens of decoding rows (drafters read it)
    active: list[bool]  # decoding rows
    filled: list[int] = field(default_factory=list)
    """Rows that started decoding since the last cycle (the drafter hears of them once)."""

    @classmethod
    def idle(cls, batch: int) -> HostRows:
        return cls(
            lens=[IDLE_LEN] * batch,
            final=[IDLE_LEN] * batch,
            contexts=[[] for _ in range(batch)],
            active=[False] * batch,
        )
