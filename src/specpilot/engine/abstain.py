"""The abstain protocol's host side: what the engine does when its verify head declined to answer.

An LM head with an ``abstain_flag`` (``mechanisms/exact_argmax_graph.py``) may return meaningless
ids with the flag set. The verify's accept then commits nothing and halts (``engine/accept.py``:
``state.halted``, ``accepted = ABSTAINED``), so the device state is exactly as before the verify.
The host sees it in the cycle's one read-back (``accepted``; in an AR window, the committed
lengths: steps after the abstaining one were halted too), commits what was committed, and redoes
the verify and its accept once with the stock head: no plug, hence no flag, in graphs of their own
(``Runner.variant``). Then it reads that back and commits as usual. Only the abstaining cycle
costs a second verify and read-back.

**Live rows.** Only rows whose ids an accept may commit can make the verify abstain: the verify
(``Engine.forward_block``) passes its layout's live rows (``Layout.live_rows``: every row of an
active sequence; packed and tree layouts leave bucket padding out) as the head's ``valid`` mask,
built on the device inside the captured step. The ids of the other rows may be anything in
``[0, V)``, because none is committed: bucket padding never reaches the block
(``PackedLayout.to_block`` drops it); an idle or frozen row's ids do, but the chain accept takes
``n = accepted_len * active = 0`` and the tree accept ``n = 0`` with the identity path, and
``commit_block`` moves neither ``committed_len`` nor ``pending`` of a row with ``active = 0``:
its ids land only in ``tokens`` past its committed length (scratch) and in ``verify_argmax``,
which the host reads back for active rows only (``engine/cycles.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from specpilot.engine.view import EngineView


@contextlib.contextmanager
def stock_head(engine: EngineView) -> Iterator[None]:
    """Steps run meanwhile use the stock LM head (no plug, so no flag), in graphs of their own."""
    target = engine.target
    head, target.argmax_head = target.argmax_head, None
    try:
        with engine.runner.variant("stock-head"):
            yield
    finally:
        target.argmax_head = head


def redo_with_stock_head(
    engine: EngineView, verify: Callable[[], None], accept: Callable[[], None]
) -> None:
    """Clear the halt, then run ``verify`` and ``accept`` with the stock LM head."""
    engine.state.halted.zero_()
    engine.abstains += 1
    with stock_head(engine):
        verify()
        accept()


def read_ar_steps(
    engine: EngineView, rows: list[int], steps: int, after: Callable[[], None] | None = None
) -> dict[int, list[int]]:
    """One read-back of up to ``steps`` AR steps since the host mirror (one more for a row in
    ``engine.ahead``): per row the tokens the device committed (all of them unless the head
    abstained), added to the mirror. ``after``: work queued behind the read-back's copy (the
    next window's first step), which the host does not wait for."""
    h, st = engine.host, engine.state
    extra = {b: steps + (b in engine.ahead) for b in rows}
    lo = min(h.lens[b] for b in rows)
    hi = max(h.lens[b] + extra[b] for b in rows)
    gathered = torch.cat([st.committed_len[:, None], st.tokens[:, lo:hi]], dim=1)
    if after is None:
        out = gathered.cpu().tolist()
    else:
        back = gathered.to("cpu", non_blocking=True)  # pinned, before ``after`` in the stream
        copied = engine.runner.fence()
        after()
        copied()
        out = back.tolist()
    new = {}
    for b in rows:
        n = min(out[b][0] - h.lens[b], extra[b])
        new[b] = out[b][1 + h.lens[b] - lo : 1 + h.lens[b] - lo + n]
        h.lens[b] += n
        h.contexts[b].extend(new[b])
    return new
