"""Drafters behind one protocol (``drafters/base.py``), registered by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from specpilot.drafters.base import Drafter, DraftRows
from specpilot.drafters.block_drafter import BlockDrafter
from specpilot.drafters.dflash import DFlashDrafter, load_dflash, load_dflash2
from specpilot.drafters.draft_model import DraftModelDrafter
from specpilot.drafters.eagle3 import Eagle3Drafter, load_eagle3
from specpilot.drafters.ngram import NgramDrafter

DRAFTERS: dict[str, Callable[..., Drafter]] = {
    NgramDrafter.name: NgramDrafter,
    DraftModelDrafter.name: DraftModelDrafter,
    BlockDrafter.name: BlockDrafter,
    "dflash": load_dflash,
    "dflash2": load_dflash2,
    "eagle3": load_eagle3,
}
"""Name → constructor. The composition root and the CLI dispatch through this table only."""

CHECKPOINT_DRAFTERS = frozenset({"dflash", "dflash2", "eagle3"})
"""Drafters built from their own checkpoint directory (``--draft-model DIR``), called as
``factory(target=Transformer, path=DIR, k=k)``, rather than from a loaded draft model."""


def make_drafter(name: str, **knobs: Any) -> Drafter:
    try:
        factory = DRAFTERS[name]
    except KeyError:
        raise ValueError(
            f"Unknown drafter '{name}'; choose one of {', '.join(sorted(DRAFTERS))}."
        ) from None
    return factory(**knobs)


__all__ = [
    "CHECKPOINT_DRAFTERS",
    "DRAFTERS",
    "BlockDrafter",
    "DFlashDrafter",
    "DraftModelDrafter",
    "DraftRows",
    "Drafter",
    "Eagle3Drafter",
    "NgramDrafter",
    "make_drafter",
]
