"""Drafters that wrap another one and rework its proposal on the host before the verify.

A mechanism that corrects, extends or cuts drafts (``mechanisms/two_level.py``,
``mechanisms/fp8_prefilter.py``) wraps the deployment's drafter: the inner drafter proposes as
usual (on the device or the host), the wrapper reads the drafts back and writes its own. Whatever
a wrapper writes is only a proposal: the exact verify still commits nothing but the target's
argmax, so a wrapper changes speed, never a committed token. Wrappers run eagerly (they decide on
the host), between the graph replays of the verify and accept steps; a wrapper that reworks the
drafts on the device instead (``mechanisms/two_level_device.py``) sets ``graph_safe`` and is
captured with the inner drafter's step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from specpilot.drafters.base import Drafter, DraftRows, Segment, gateable


class WrappedDrafter:
    """Forwards the protocol to ``inner``; subclasses implement ``propose``."""

    graph_safe = False

    def __init__(self, inner: Drafter, name: str, k: int) -> None:
        self.inner = inner
        self.name = name
        self.k = k
        self.hidden_layers = inner.hidden_layers
        follow = getattr(inner, "follow_commits", None)
        if follow is not None and k > inner.k:  # a cycle may commit more than inner.k + 1
            follow(k + 1)

    def bind(self, rows: DraftRows) -> None:
        self.inner.bind(rows)

    def prefill(self, rows: DraftRows, seg: Segment) -> None:
        self.inner.prefill(rows, seg)

    def admitted(self, rows: DraftRows, which: Sequence[int]) -> None:
        self.inner.admitted(rows, which)

    @property
    def gateable(self) -> bool:
        return gateable(self.inner)

    def resync(self, rows: DraftRows, which: Sequence[int], since: Sequence[int]) -> None:
        self.inner.resync(rows, which, since)  # type: ignore[attr-defined]

    def attn_len(self, rows: DraftRows, max_committed: int) -> int:
        return self.inner.attn_len(rows, max_committed)

    def observe(self, rows: DraftRows, committed: Sequence[tuple[int, int, list[int]]]) -> None:
        self.inner.observe(rows, committed)

    def inner_drafts(self, rows: DraftRows, attn_len: int) -> list[list[int]]:
        """The inner drafter's proposal per row, on the host (empty for rows not decoding)."""
        lens = self.inner.propose(rows, attn_len)
        k = self.inner.k
        n = lens if lens is not None else [k] * len(rows.active)
        tokens = rows.state.drafts[:, :k].tolist()
        return [t[:m] if a else [] for t, m, a in zip(tokens, n, rows.active, strict=True)]


class DraftFilter(Protocol):
    """Chooses how many of each row's drafted tokens the exact verify sees."""

    def __call__(
        self, contexts: Sequence[Sequence[int] | None], drafts: Sequence[Sequence[int]]
    ) -> list[int]:
        """Per row: drafts to keep. ``contexts[row]`` is the row's prompt plus committed
        tokens, or None for a row that is not decoding (its drafts are empty)."""
        ...


class FilteredDrafter(WrappedDrafter):
    """Each row keeps the prefix of its own drafts that ``keep`` says (clamped to what it has),
    so a filter can shorten a block and do nothing else; a prefix of a draft is a draft."""

    def __init__(self, inner: Drafter, keep: DraftFilter, label: str) -> None:
        super().__init__(inner, f"{inner.name}+{label}", inner.k)
        self.keep = keep

    def propose(self, rows: DraftRows, attn_len: int) -> list[int]:
        drafts = self.inner_drafts(rows, attn_len)
        contexts = [c if a else None for c, a in zip(rows.contexts, rows.active, strict=True)]
        keep = self.keep(contexts, drafts)
        if len(keep) != len(drafts):
            raise ValueError(f"the draft filter gave {len(keep)} rows, expected {len(drafts)}")
        return rows.write_drafts(
            [d[: max(0, min(len(d), int(n)))] for d, n in zip(drafts, keep, strict=True)]
        )
