"""Per-row draft pre-filter: shorten each row's drafted block before the exact verify.

After the drafter proposes and before the target's forward, the scheduler may hand every row's
drafts to a :class:`DraftPrefilter` (e.g. ``mechanisms/fp8_prefilter.py``), which says how many of
each row's drafts to keep. The scheduler itself cuts: a row keeps the first ``keep`` of its own
drafts, clamped to ``0..len(drafts)``, so a pre-filter can shorten a block and do nothing else.
A prefix of a draft is a draft, and the verify commits only tokens equal to the target's argmax
plus the target's bonus token, so no pre-filter can change a committed token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class DraftPrefilter(Protocol):
    """Chooses how many of each row's drafted tokens the exact verify sees."""

    def __call__(
        self, contexts: Sequence[Sequence[int] | None], drafts: Sequence[Sequence[int]]
    ) -> list[int]:
        """Per slot row: drafts to keep. ``contexts[row]`` is the row's prompt plus committed
        tokens, or None for a slot that is free or in prefill (its drafts are empty)."""
        ...
