"""A round's trials on a pool that streams results (``StreamingExecutor``: Ray's actors).

The loop hands over a round's candidates of every direction at once, one :class:`Batch` per
direction in the order it would have run them (the stock engine may lead round 1's queue). They
go to the pool as ONE queue, each trial to whichever worker is idle, so no worker waits for
another direction's slowest trial; each result is passed on as it arrives (the loop writes it to
memory then), and the loop makes the round's decisions once every trial is back, batch by batch
in order, as if the batches had run one after another. A config in two batches runs once, for
the first; the second reads it from memory, as it would have after running the first.

The budget: ``admit`` is asked before each trial starts (never for a forced batch, the stock
engine, whose trials lead the queue); once it says no, no later trial starts, those in flight
finish and are passed on, and each batch counts its trials not started.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field

from specpilot.engine.config import EngineConfig
from specpilot.tune.evaluate import TrialResult
from specpilot.tune.executors import StreamingExecutor
from specpilot.tune.space import config_hash


@dataclass(slots=True)
class Batch:
    """One direction's candidates in a round (or the stock engine, or a stacked config)."""

    round: int
    """The round its trials are recorded under (the stock engine's is 0, even in round 1's queue)."""
    explorer: str
    configs: list[EngineConfig]
    force: bool = False
    """Started whatever the budget says (the stock engine)."""
    ran: dict[str, TrialResult] = field(default_factory=dict)
    """Results of the configs this batch ran, by hash (not those another batch ran first)."""
    not_run: int = 0
    """Its configs the budget kept from starting."""


def stream_batches(
    pool: StreamingExecutor,
    batches: Sequence[Batch],
    done: Container[str],
    admit: Callable[[], bool],
    arrived: Callable[[Batch, TrialResult], None],
) -> None:
    """Run every batch's configs not in ``done`` (hashes finished earlier) as one queue: forced
    batches first, then batch order, then config order. ``arrived(batch, result)`` is told of
    each result as it comes back; afterwards each batch holds what it ran in ``ran``."""
    queue: list[EngineConfig] = []
    owner: dict[str, Batch] = {}
    for b in sorted(batches, key=lambda b: not b.force):  # stable: forced ones lead
        for c in b.configs:
            h = config_hash(c)
            if h not in done and h not in owner:
                owner[h] = b
                queue.append(c)
    forced = sum(owner[config_hash(c)].force for c in queue)
    by_hash = {config_hash(c): c for c in queue}
    asked = 0

    def admit_next() -> bool:
        # The pool asks once before each config first starts, in queue order (the protocol).
        nonlocal asked
        asked += 1
        return asked <= forced or admit()

    def on_result(r: TrialResult) -> None:
        h = config_hash(r.config)
        r.config = by_hash.get(h, r.config)  # the loop's own object, not the pool's copy
        owner[h].ran[h] = r
        arrived(owner[h], r)

    pool.stream(queue, admit=admit_next, on_result=on_result)
    for h, b in owner.items():
        if h not in b.ran:
            b.not_run += 1
