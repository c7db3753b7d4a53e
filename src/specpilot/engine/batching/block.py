"""Per-request drafter block length: how many tokens a row may draft this cycle.

The scheduler asks a :class:`BlockPolicy` for each row's block before drafting and reports what
the verify accepted after it. ``None`` (the stock behaviour) drafts the drafter's ``k`` on every
row. The adaptive policy (``mechanisms/adaptive_block.py``) lives with its mechanism.
"""

from __future__ import annotations

from typing import Protocol


class BlockPolicy(Protocol):
    """Chooses each row's block length from that row's own history; keeps no shared state."""

    def new_state(self, k_max: int) -> object:
        """Per-request state, created when a request starts decoding."""
        ...

    def block(self, state: object, k_max: int) -> int:
        """Tokens this row may draft this cycle, in ``0..k_max``."""
        ...

    def update(self, state: object, drafted: int, accepted: int) -> None:
        """The verify of this row's last draft of ``drafted`` tokens accepted ``accepted``."""
        ...
