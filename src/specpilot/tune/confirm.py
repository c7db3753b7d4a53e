"""A winner measured head to head with the best (the local executor's rule, ``TuneLoop``).

A round whose candidates all fail the interval rule may still hold a *contender*
(:func:`best_contender`): its whole spread above the best's median, but the best's own spread
reaching above it (one noisy round of the best is enough for that). It gets the same head-to-head
confirm a winner gets, and becomes the best only if it wins there.

Both go in one chunk, so they share its AR rounds, interleaved: the candidate's per-round ratio
over the best must lie above 1 by more than the noise (and ``min_gain``). Ratios over AR measured
at different times can differ by a few percent without either engine changing; this rules that
out.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from specpilot.bench.protocol import MIN_ROUNDS_FOR_VERDICT, Ratio
from specpilot.tune.evaluate import TrialResult
from specpilot.tune.executors import Executor
from specpilot.tune.outcome import Trial, TuneOutcome
from specpilot.tune.space import describe


def head_to_head(
    executor: Executor, best: TrialResult, cand: TrialResult, min_gain: float
) -> tuple[TrialResult, TrialResult, Ratio, bool]:
    """(the best and the candidate as measured together, the candidate's per-round ratio over
    the best, whether it wins)."""
    got = executor.map([best.config, cand.config])
    b, c = got[0], got[1]
    pair = Ratio([x / y for x, y in zip(c.rounds, b.rounds, strict=True) if y > 0])
    ok = b.eligible and c.eligible and pair.beats(Ratio([1.0] * len(pair.values)), min_gain)
    return b, c, pair, ok


P = TypeVar("P")


def best_contender(
    results: Sequence[tuple[P, TrialResult]], best: TrialResult, min_gain: float
) -> tuple[P, TrialResult] | None:
    """The eligible result with the highest median whose lowest round lies above the best's
    median (and whose median beats it by ``min_gain``): worth a head-to-head measurement although
    the best's spread overlaps it; None when there is none."""
    base = best.ratio.median
    ok = [
        (p, r)
        for p, r in results
        if r.eligible
        and len(r.ratio.values) >= MIN_ROUNDS_FOR_VERDICT
        and r.ratio.lo > base
        and r.ratio.median >= base * (1.0 + min_gain)
    ]
    return max(ok, key=lambda w: w[1].ratio.median, default=None)


def clock(seconds: float) -> str:
    """``mm:ss`` of the search's elapsed time (the log's timestamps)."""
    return f"{int(seconds) // 60:02d}:{int(seconds) % 60:02d}"


def confirm_winner(
    executor: Executor,
    outcome: TuneOutcome,
    cand: TrialResult,
    min_gain: float,
    round_: int,
    time_left: bool,
    interval_ok: bool,
    log: Callable[[str], None],
    elapsed: Callable[[], float],
) -> tuple[TrialResult | None, float | None]:
    """A winner confirmed head to head with ``outcome.best``: (the candidate as measured there,
    or None; the seconds that measurement took, None when none was made). Both measurements join
    ``outcome.trials``. Executors that do not share rounds across a chunk (Ray's actors) keep the
    interval rule alone. With no time left, a candidate that passed the interval rule
    (``interval_ok``) is taken on it; a contender (:func:`best_contender`) is not."""
    if not getattr(executor, "shares_rounds", False):
        return cand, None
    if not time_left:
        if interval_ok:  # it beat the best by more than both spreads: taken on that rule
            log(
                f"  [confirm] no time left to confirm {describe(cand.config)} head to head: "
                "taken on the interval rule (the held-out compare measures it head to head)"
            )
            return cand, None
        log(f"  [confirm] no time left to confirm {describe(cand.config)}: not taken")
        return None, None
    best, t0 = outcome.best, time.perf_counter()
    b, c, pair, ok = head_to_head(executor, best, cand, min_gain)
    seconds = time.perf_counter() - t0
    outcome.trials += [Trial(round_, "confirm", r, elapsed=elapsed()) for r in (b, c)]
    log(
        f"  [{clock(elapsed())}] [confirm] {describe(cand.config)} over the best "
        f"{describe(best.config)}, head to head: {pair.text()} → "
        + ("a winner" if ok else "not a winner (within the noise)")
    )
    if not ok:
        return None, seconds
    c.config = cand.config
    return c, seconds
