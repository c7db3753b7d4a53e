"""A winner measured head to head with the best (the local executor's rule, ``TuneLoop``).

Both go in one chunk, so they share its AR rounds, interleaved: the candidate's per-round ratio
over the best must lie above 1 by more than the noise (and ``min_gain``). Ratios over AR measured
at different times can differ by a few percent without either engine changing; this rules that
out.
"""

from __future__ import annotations

from specpilot.bench.protocol import Ratio
from specpilot.tune.evaluate import TrialResult
from specpilot.tune.executors import Executor


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
