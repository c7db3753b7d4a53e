"""The protocol of drafters that run inside the static (CUDA-graph) engine.

Unlike :class:`~specpilot.drafters.base.Drafter`, which gets host lists of tokens, a static drafter
reads the engine's device state (``engine.state``: committed tokens and lengths, and the
target's hidden states of the last verify when it asks for them) and writes its proposal into
``engine.state.drafts`` / ``draft_lens`` with graph-safe ops only: ``draft`` is captured once per
attention bucket and replayed every cycle.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from torch import Tensor

if TYPE_CHECKING:
    from specpilot.engine.static_engine import StaticEngine


@runtime_checkable
class StaticDrafter(Protocol):
    name: str
    k: int
    """Tokens drafted per cycle (the verify forward has width k + 1)."""
    hidden_layers: tuple[int, ...]
    """Target layers whose outputs the drafter reads (empty: none)."""

    def bind(self, engine: StaticEngine) -> None:
        """Allocate caches and buffers for the engine's batch size and capacity."""
        ...

    def prefill(
        self,
        engine: StaticEngine,
        prompts: Tensor,  # [B, P] int64 padded prompts on the device
        prompt_lens: Tensor,  # [B] int64 on the device
        hidden: Tensor | None,  # [len(hidden_layers), B, P, hidden] target states, or None
    ) -> None:
        """Start a batch (runs eagerly, not captured)."""
        ...

    def attn_len(self, engine: StaticEngine, max_committed: int) -> int:
        """Attention bucket ``draft`` needs when no row has more than ``max_committed`` tokens."""
        ...

    def draft(self, engine: StaticEngine, attn_len: int) -> None:
        """Fill ``engine.state.drafts[:, :k]`` and ``draft_lens``; graph-safe."""
        ...

    def after_cycle(
        self, engine: StaticEngine, committed: Sequence[tuple[int, int, list[int]]]
    ) -> None:
        """Host hook after a cycle: ``(row, position of first token, committed tokens)``."""
        ...


@runtime_checkable
class RowRefillable(Protocol):
    """A static drafter that can restart one row of a running batch (continuous batching on the
    static engine, ``engine/static_rows.py``) without touching the other rows' state."""

    def prefill_row(
        self,
        engine: StaticEngine,
        row: int,
        prompt: Tensor,  # [1, P] int64 on the device
        hidden: Tensor | None,  # [len(hidden_layers), 1, P, hidden] target states, or None
    ) -> None:
        """Start row ``row`` on a new prompt (runs eagerly, between cycles)."""
        ...

    def rows_filled(self, engine: StaticEngine, rows: Sequence[int]) -> None:
        """Once after the rows refilled since the last cycle, before the next cycle (one oracle
        run for all of them, say)."""
        ...


def can_refill_rows(drafter: StaticDrafter) -> bool:
    """Whether ``drafter`` (and the drafter a simulated-acceptance wrapper wraps) can restart one
    row of a running batch."""
    inner = getattr(drafter, "inner", drafter)
    return isinstance(drafter, RowRefillable) and isinstance(inner, RowRefillable)
