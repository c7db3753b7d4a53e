"""What the engine's parts read and call of the engine: :class:`EngineView`, and the verify-plan
interface :class:`VerifyPlan` that the engine drives through it.

The engine (``engine/engine.py``) owns the rows, the buffers and the steps; its parts — the cycle
bodies (``engine/cycles.py``), the gate (``engine/gate.py``), admission of prompts
(``engine/admission.py``), the abstain protocol (``engine/abstain.py``), the probes
(``engine/probes.py``) and the verify plans (``engine/plans.py``) — are handed the engine as an
``EngineView`` and import this module, never ``engine/engine.py``: dependencies run one way, and
each part states here what it may touch. :class:`~specpilot.engine.engine.Engine` satisfies
the protocol structurally (mypy checks it wherever the engine passes itself to a part).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from specpilot.drafters.base import DraftRows

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from specpilot.drafters.base import Drafter
    from specpilot.engine.prefill_graph import PrefillGraph
    from specpilot.engine.rows import HostRows, RowState
    from specpilot.engine.runner import Runner
    from specpilot.engine.types import CycleTimes, PhaseClock, RowCommit
    from specpilot.models.forward import Forward
    from specpilot.models.kv_cache import KVCache
    from specpilot.models.layout import Layout
    from specpilot.models.transformer import Transformer


class VerifyPlan(Protocol):
    """How one speculative cycle drafts, verifies and accepts (the ``verify_plan`` plug point;
    the plans are in ``engine/plans.py``)."""

    name: str

    def block_width(self, k: int) -> int:
        """Widest block (pending token included) one row verifies, for a drafter of ``k``."""
        ...

    def bind(self, engine: EngineView) -> None:
        """Allocate the plan's buffers for the engine's batch."""
        ...

    def reset_row(self, row: int) -> None:
        """Row ``row`` takes a new sequence: forget what was learnt of the old one."""
        ...

    def cycle(self, engine: EngineView) -> tuple[int, list[int]]:
        """Draft, verify, accept. Returns the read-back width and the positions drafted per row."""
        ...

    def observe(self, row: int, drafted: int, accepted: int) -> None: ...


class EngineView(DraftRows, Protocol):
    """The engine as its parts see it: what drafters see of it (``drafters/base.DraftRows``)
    and more (``engine/engine.py`` documents each member)."""

    # ---- what it was built with
    @property
    def target(self) -> Transformer: ...
    @property
    def drafter(self) -> Drafter | None: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def fwd(self) -> Forward: ...
    @property
    def runner(self) -> Runner: ...
    @property
    def plan(self) -> VerifyPlan | None: ...
    @property
    def k(self) -> int: ...
    @property
    def k_max(self) -> int: ...
    @property
    def sync_every(self) -> int: ...
    @property
    def profile(self) -> bool: ...

    # ---- the open batch
    @property
    def batch(self) -> int: ...
    @property
    def cache(self) -> KVCache | None: ...
    @property
    def capacity(self) -> int: ...
    @property
    def state(self) -> RowState: ...
    @property
    def verify_hidden(self) -> Tensor | None: ...
    @property
    def final_hidden(self) -> Tensor: ...

    draft_caps: list[int | None]

    host: HostRows
    unsynced: dict[int, int]
    ahead: set[int]

    # ---- what the cycle records
    times: CycleTimes
    clock: PhaseClock
    abstains: int
    prefill_forwards: int
    last_verify: tuple[Callable[[], None], Callable[[], None]] | None

    # ---- the verify head
    @property
    def verify_graph_safe(self) -> bool: ...
    @property
    def abstain_flag(self) -> Tensor | None: ...

    # ---- sizes
    def context_margin(self) -> int: ...
    def bucket(self, need: int) -> int: ...
    def prefill_graph(self) -> PrefillGraph | None: ...
    def live_rows(self) -> int: ...
    def first_rows(self, n: int) -> contextlib.AbstractContextManager[None]: ...
    def room(self) -> list[int]: ...

    # ---- the steps
    def ar_window(
        self,
        limit: int | None = None,
        interrupt: Callable[[], bool] | None = None,
        lookahead: bool = False,
    ) -> list[RowCommit]: ...
    def verify_and_accept(self, verify: Callable[[], None], accept: Callable[[], None]) -> None: ...
    def run_draft(self) -> list[int] | None: ...
    def run_verify(
        self, w: int, attn_len: int, with_hidden: bool = True, offset: int = 0
    ) -> None: ...
    def verify_step(
        self, w: int, attn_len: int, hidden: Tensor | None, host_start: int | None
    ) -> Callable[[], None]: ...
    def run_accept(self, k: int) -> None: ...
    def forward_block(
        self,
        block: Tensor,  # [B, W] int64
        lay: Layout,
        argmax_out: Tensor,  # [B, >= W] int64
        hidden_out: Tensor | None,  # [n_sel, B, >= W, hidden] or None
    ) -> None: ...
    def mark(self) -> None: ...
