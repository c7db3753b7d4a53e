"""The one protocol every drafter implements, and the view of the running batch it is handed.

A drafter never decides what is committed; it writes a proposal into the row state (drafted
tokens and their count per row), and the engine's verify decides. Two kinds, one protocol:

* a **device** drafter (draft model, block drafter, simulated acceptance) reads the row state
  and the target's hidden states on the device and writes its drafts with graph-safe ops only
  (``graph_safe = True``): its ``propose`` is captured once per attention bucket and replayed;
* a **host** drafter (n-gram lookup, two-level correction of one) reads ``rows.contexts`` (prompt plus
  committed tokens per row) on the host, and hands its drafts over with ``rows.write_drafts``
  (``graph_safe = False``: it runs eagerly between the graph replays). It returns the draft
  lengths it wrote, so that the verify can be as narrow as the longest draft.

Contexts only grow within a row; when a row takes a new sequence (continuous batching) the
drafter hears of it through ``prefill`` and ``admitted``, and never has to be told what was
accepted: it reads the committed state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from torch import Tensor

if TYPE_CHECKING:
    from specpilot.models.transformer import Transformer


class DeviceRows(Protocol):
    """The device state of the batch a drafter reads and writes (``engine/rows.RowState``)."""

    pending: Tensor  # [B] int64: last committed token (its K/V not cached yet)
    committed_len: Tensor  # [B] int64: committed tokens, prompt included
    prev_committed: Tensor  # [B] int64: committed_len before the last commit
    tokens: Tensor  # [B, S] int64: prompt + committed tokens
    drafts: Tensor  # [B, K_max] int64: where the proposal goes
    draft_lens: Tensor  # [B] int64: drafted tokens per row
    active: Tensor  # [B] int64: 1 while a row decodes
    cycle: Tensor  # [1] int64

    @property
    def batch_size(self) -> int: ...

    @property
    def capacity(self) -> int: ...


@dataclass(frozen=True, slots=True)
class Segment:
    """A prompt segment the target just ran for rows ``first_row .. first_row + rows - 1``
    (eagerly, between cycles); what a drafter's ``prefill`` is handed."""

    first_row: int
    tokens: Tensor  # [b, T] int64 on the device
    start: Tensor  # [b] int64 on the device: slot of each row's first segment token
    attn_len: int  # attention length the target's forward over the segment used
    hidden: Tensor | None = None  # [len(hidden_layers), b, T, hidden] the target's states

    @property
    def rows(self) -> int:
        return int(self.tokens.shape[0])


class DraftRows(Protocol):
    """What the engine shows a drafter of the running batch."""

    @property
    def state(self) -> DeviceRows: ...

    @property
    def target(self) -> Transformer: ...

    @property
    def verify_hidden(self) -> Tensor | None:
        """``[n_sel, B, k+1, hidden]``: the drafter's ``hidden_layers`` of the target at the
        last verify's rows, in chain order (pending token, then the drafts), or None."""
        ...

    @property
    def contexts(self) -> Sequence[Sequence[int]]:
        """Per row: prompt + committed tokens of a decoding row (empty for any other row)."""
        ...

    @property
    def active(self) -> Sequence[bool]:
        """Per row: whether it decodes this cycle."""
        ...

    def bucket(self, need: int) -> int:
        """Attention length to use when no row reads more than ``need`` slots."""
        ...

    def committed_lens(self) -> list[int]:
        """Committed tokens per row (prompt included), as the host knows them."""
        ...

    def oracle_horizon(self) -> int:
        """Tokens of look-ahead that reach every decoding row's length limit plus a draft."""
        ...

    def reference_continuation(self, n: int) -> list[list[int]]:
        """The target's next ``n`` greedy tokens per row from the committed state (AR steps of
        the same engine, not committed; their time is excluded from the engine's timers)."""
        ...

    def write_drafts(self, drafts: Sequence[Sequence[int]]) -> list[int]:
        """Copy host drafts (row b: at most k tokens) into the state; returns their lengths."""
        ...


@runtime_checkable
class Drafter(Protocol):
    """Proposes continuations of each row; never decides what is committed."""

    name: str
    k: int
    """Most tokens proposed per row and cycle (the verify block is at most k + 1 wide)."""
    hidden_layers: tuple[int, ...]
    """Target layers whose outputs the drafter reads (empty: none)."""
    graph_safe: bool
    """Whether ``propose`` is device work only (captured in CUDA graphs)."""

    def bind(self, rows: DraftRows) -> None:
        """The batch was (re)allocated: size caches and buffers for it."""
        ...

    def prefill(self, rows: DraftRows, seg: Segment) -> None:
        """The target just ran a prompt segment of these rows (eagerly, between cycles); a
        segment at slot 0 starts a new sequence in its row."""
        ...

    def admitted(self, rows: DraftRows, which: Sequence[int]) -> None:
        """These rows finished their prompt and decode from the next cycle on."""
        ...

    def attn_len(self, rows: DraftRows, max_committed: int) -> int:
        """Attention length ``propose`` needs when no row has more than ``max_committed``."""
        ...

    def propose(self, rows: DraftRows, attn_len: int) -> list[int] | None:
        """Fill ``rows.state.drafts[:, :k]`` and ``draft_lens``. Host drafters return the
        lengths they wrote; device drafters return None (every row drafted ``k``)."""
        ...

    def observe(self, rows: DraftRows, committed: Sequence[tuple[int, int, list[int]]]) -> None:
        """After a cycle: ``(row, position of the first token, committed tokens)`` per row."""
        ...


class HostDrafter:
    """Defaults for drafters that work on host contexts and keep no device state."""

    hidden_layers: tuple[int, ...] = ()
    graph_safe = False

    def bind(self, rows: DraftRows) -> None:
        return None

    def prefill(self, rows: DraftRows, seg: Segment) -> None:
        return None

    def admitted(self, rows: DraftRows, which: Sequence[int]) -> None:
        return None

    def attn_len(self, rows: DraftRows, max_committed: int) -> int:
        return 0

    def observe(self, rows: DraftRows, committed: Sequence[tuple[int, int, list[int]]]) -> None:
        return None


@runtime_checkable
class Resyncable(Protocol):
    """A drafter that can catch up on tokens committed while it did not draft."""

    def resync(self, rows: DraftRows, which: Sequence[int], since: Sequence[int]) -> None:
        """Rows ``which`` committed tokens by AR from committed length ``since[i]`` on; bring the
        drafter's own state up to their committed lengths."""
        ...


def gateable(drafter: object) -> bool:
    """Whether the gate may turn drafting off for ``drafter`` (it must catch up afterwards)."""
    return isinstance(drafter, Resyncable) and bool(getattr(drafter, "gateable", True))
