"""The parts of an engine a mechanism may change while it is built: its plug points as data.

``engine/build.py`` (the composition root) makes an ``EngineParts``, which is these parts plus the
config it was built from, and hands it to every enabled mechanism's ``apply``; the mechanism edits
the parts it declared (the target's ``linear_fns``, ``phase_hooks`` and ``argmax_head``, the
drafter, the verify plan's width and tree policies). Mechanisms import this module and the
registry, never the composition root, so the registry is read by build and config, not the
other way round.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specpilot.drafters.base import Drafter
    from specpilot.drafters.tree import TreeShape
    from specpilot.engine.tree_policy import TreePolicy
    from specpilot.engine.widths import WidthPolicy
    from specpilot.kernels.offers import KernelOffers
    from specpilot.kernels.w12_tilings import MmaTilings
    from specpilot.runtime import LoadedModel


@dataclass(slots=True, kw_only=True)
class EngineParts:
    """An engine under construction, as the mechanisms see it."""

    target: LoadedModel
    """The target; its ``model`` carries the linear-weight, phase-hook and argmax plug points."""
    draft_model: LoadedModel | None
    drafter: Drafter | None
    graphs: bool | None = None
    """Run steps from CUDA graphs (None: on CUDA); ``--no-graphs`` sets False."""
    width_policy: WidthPolicy | None = None
    """Per-row verify widths (plug point ``drafter_schedule``); None = every row k + 1."""
    packed_bucket: int = 0
    """Packed ragged verify: rows rounded up to this (0 = the dense chain)."""
    tree_policy: TreePolicy | None = None
    """Static tree per row, filled from a drafter's candidates (plug point ``verify_strategy``)."""
    tree_shape: TreeShape | None = None
    """Bounds of a host drafter's trie per row (n-gram trees; plug point ``verify_strategy``)."""
    notes: list[str] = field(default_factory=list)
    """What each mechanism did, for reports."""
    kernel_tilings: MmaTilings | None = None
    """Tilings the kernel search measured on this GPU (``tune/kernel_search.py``); None: the
    kernels' cold-start tables."""
    kernel_offers: KernelOffers | None = None
    """Accepted agent kernels the kernel search chose for some W12 cells (``kernels/offers.py``)."""
