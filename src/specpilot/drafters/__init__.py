"""Drafters behind one protocol, registered by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from specpilot.drafters.base import Drafter, DraftProposal
from specpilot.drafters.draft_model import DraftModelDrafter
from specpilot.drafters.ngram import NgramDrafter

DRAFTERS: dict[str, Callable[..., Drafter]] = {
    NgramDrafter.name: NgramDrafter,
    DraftModelDrafter.name: DraftModelDrafter,
}
"""Name → constructor. The engine and CLI dispatch through this table only."""


def make_drafter(name: str, **knobs: Any) -> Drafter:
    try:
        factory = DRAFTERS[name]
    except KeyError:
        raise ValueError(
            f"Unknown drafter '{name}'; choose one of {', '.join(sorted(DRAFTERS))}."
        ) from None
    return factory(**knobs)


__all__ = [
    "DRAFTERS",
    "DraftModelDrafter",
    "DraftProposal",
    "Drafter",
    "NgramDrafter",
    "make_drafter",
]
