"""The two cycle bodies of the engine (``engine/engine.py``): a window of AR steps, and one
speculative cycle through the verify plan. Both end with the one device→host read-back of what the
device committed and extend the host mirror of each row; both follow the abstain protocol
(``engine/abstain.py``) when the verify head declines to answer."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from specpilot.engine.abstain import read_ar_steps, redo_with_stock_head
from specpilot.engine.accept import ABSTAINED
from specpilot.engine.types import RowCommit

if TYPE_CHECKING:
    from specpilot.engine.view import EngineView


def ar_window(
    engine: EngineView,
    limit: int | None = None,
    interrupt: Callable[[], bool] | None = None,
    lookahead: bool = False,
) -> list[RowCommit]:
    """``sync_every`` AR steps (at most ``limit``, and no more than the rows' room) queued,
    then read back once; after an abstain, the rest of the window halted and one stock step.

    ``interrupt``: asked before each step after the first; True ends the window there (a request
    waits for a row, so the scheduler admits it at the next step, not at the end of the window).
    On CUDA at most two steps are then in flight when it is asked (each step leaves a fence; the
    host waits on the one before the last), so the device stays busy and the answer is fresh.

    ``lookahead``: queue the next window's first step behind the read-back's copy, so the device
    computes it while the host streams this window's tokens (a server's window of 4 steps
    otherwise leaves the device idle for the host's work between windows). Its rows go to
    ``engine.ahead`` (their device state is one step past the host mirror); the next window
    reads that step back with its own (as its first step when every row has one, so a window
    still reads back as many tokens). Not when a request waits for a row (``interrupt``), when
    no row has room left, or with a verify head that may abstain. A row that ends meanwhile
    (stop token, length, cancel) drops the extra step with its row (``Engine.release``)."""
    h = engine.host
    rows = [b for b, a in enumerate(h.active) if a]
    steps = min(engine.sync_every, limit or engine.sync_every)
    steps = max(1, min(steps, max(h.final[b] - h.lens[b] for b in rows)))
    ahead = {b: int(b in engine.ahead) for b in rows}
    if steps > 1 and all(ahead.values()):  # the step ahead is this window's first
        steps -= 1
    base = max(h.lens[b] + ahead[b] for b in rows)
    single = ahead[rows[0]] if len(rows) == 1 else 0  # the eager one-row step's host offset
    # the steps run over rows [0, live) only; with a drafter (gated or capped-off windows) over
    # every row, as its cycles do, so the gate weighs AR and speculation on the same rows
    live = engine.live_rows() if engine.drafter is None else engine.batch
    fences: list[Callable[[], None]] = []
    ran = 0
    with engine.first_rows(live):
        for s in range(steps):
            if s > 0 and interrupt is not None:
                if s >= 2:
                    fences[s - 2]()
                if interrupt():
                    break
            engine.run_verify(1, engine.bucket(base + s), with_hidden=False, offset=s + single)
            engine.run_accept(0)
            ran += 1
            if interrupt is not None:
                fences.append(engine.runner.fence())
    steps = ran
    more = (
        lookahead
        and engine.abstain_flag is None
        and any(h.final[b] - h.lens[b] - ahead[b] - steps > 0 for b in rows)
        and not (interrupt is not None and interrupt())
    )

    def next_step() -> None:
        with engine.first_rows(live):
            engine.run_verify(
                1, engine.bucket(base + steps), with_hidden=False, offset=steps + single
            )
            engine.run_accept(0)

    new = read_ar_steps(engine, rows, steps, next_step if more else None)
    engine.ahead.clear()
    if more:
        engine.ahead.update(rows)
    if any(len(new[b]) < steps for b in rows):  # the head abstained at some step
        redo_with_stock_head(
            engine,
            lambda: engine.run_verify(1, engine.bucket(max(h.lens)), with_hidden=False),
            lambda: engine.run_accept(0),
        )
        for b, extra in read_ar_steps(engine, rows, 1).items():
            new[b] += extra
    engine.times.cycles += steps
    return [RowCommit(b, new[b], 0, 0, cycles=len(new[b])) for b in rows]


def spec_cycle(engine: EngineView) -> list[RowCommit]:
    """Draft, verify and accept through the plan, one read-back of ``[accepted, a_0..]`` per
    row (again after a verify redone with the stock head), then the commit on the host."""
    assert engine.plan is not None and engine.drafter is not None
    h, st = engine.host, engine.state
    engine.clock.start(engine.profile)
    w, drafted = engine.plan.cycle(engine)
    engine.mark()
    out = torch.cat([st.accepted[:, None], st.verify_argmax[:, :w]], dim=1).cpu().tolist()
    engine.clock.add_to(engine.times)
    if any(out[b][0] == ABSTAINED for b, a in enumerate(h.active) if a):
        assert engine.last_verify is not None
        redo_with_stock_head(engine, *engine.last_verify)
        out = torch.cat([st.accepted[:, None], st.verify_argmax[:, :w]], dim=1).cpu().tolist()
    commits, observed = [], []
    for b, a in enumerate(h.active):
        if not a:
            continue
        n = out[b][0]
        toks = out[b][1 : n + 2]
        observed.append((b, h.lens[b], toks))
        h.lens[b] += n + 1
        h.contexts[b].extend(toks)
        engine.plan.observe(b, drafted[b], n)
        commits.append(RowCommit(b, toks, drafted[b], n))
    engine.times.cycles += 1
    engine.drafter.observe(engine, observed)
    return commits


__all__ = ["ar_window", "spec_cycle"]
