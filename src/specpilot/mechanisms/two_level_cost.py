"""Cost model of two-level verification (``two_level.py``): committed tokens per exact verify and
cycle time, one-level against two-level, from an acceptance profile and measured forward times.

Acceptance. The inner drafter is right for the first ``m`` positions (``P(m ≥ i)`` = the profile's
survival ``S_i``, i = 1..k). The cheap model agrees with the exact target at each position with
probability ``a`` independently, so its first disagreement is at ``j`` with
``P(j) = a^(j-1)(1 - a)``. The corrected block then commits (exact verify, bonus included)

* ``j``                      if ``j ≤ m + 1`` (the cheap model broke a right draft, or failed to
  fix the wrong one: no worse than one-level's ``m + 1`` at ``j = m + 1``);
* ``min(j, m + 2 + e)``      if ``j > m + 1`` (fixed the first wrong draft, then ``e`` extension
  tokens, accepted up to the cheap model's next disagreement);

that is ``min(j, m + 2 + e)`` in both cases.

One-level commits ``m + 1`` (= τ in expectation). Time per cycle: one-level
``t_draft + t_verify(1 + k)``; two-level ``t_draft + t_cheap_block + e · t_cheap_step +
t_verify(2 + k + e)`` (the extension loop always runs its ``e`` steps: the drafter cannot know
where the cheap model went wrong).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def committed_two_level(survival: Sequence[float], agreement: float, extension: int) -> float:
    """E[committed tokens per exact verify] with the corrected (and extended) block."""
    a = min(max(agreement, 0.0), 1.0)
    surv = [1.0, *survival, 0.0]  # S_0..S_{k+1}
    total = 0.0
    for m in range(len(survival) + 1):
        p_m = surv[m] - surv[m + 1]
        if p_m <= 0.0:
            continue
        cap = m + 2 + extension
        exp_c = 0.0
        for j in range(1, cap):  # both cases above are min(j, cap)
            exp_c += j * a ** (j - 1) * (1.0 - a)
        exp_c += cap * a ** (cap - 1)  # P(j ≥ cap)
        total += p_m * exp_c
    return total


@dataclass(frozen=True, slots=True)
class TwoLevelPrediction:
    tau_one: float
    """E[committed per exact verify], one-level (bonus included)."""
    tau_two: float
    """The same with the corrected block."""
    cycle_one_s: float
    cycle_two_s: float

    @property
    def tok_s_one(self) -> float:
        return self.tau_one / self.cycle_one_s

    @property
    def tok_s_two(self) -> float:
        return self.tau_two / self.cycle_two_s

    @property
    def speedup(self) -> float:
        """Two-level tok/s over one-level tok/s (< 1: it loses here)."""
        return self.tok_s_two / self.tok_s_one


def predict(
    survival: Sequence[float],
    agreement: float,
    extension: int,
    t_draft: float,
    t_verify_one: float,
    t_verify_two: float,
    t_cheap_block: float,
    t_cheap_step: float,
) -> TwoLevelPrediction:
    """One-level vs two-level from the profile's survival, the cheap agreement and forward times
    (seconds: the drafter, the exact verify at each block width, the cheap forwards)."""
    return TwoLevelPrediction(
        tau_one=1.0 + sum(survival),
        tau_two=committed_two_level(survival, agreement, extension),
        cycle_one_s=t_draft + t_verify_one,
        cycle_two_s=t_draft + t_cheap_block + extension * t_cheap_step + t_verify_two,
    )


CHEAP_FRACTION = 0.75
"""Time of a cheap forward (the block) over an exact verify where the verify is memory-bound and
flat in its width. The INT8 copy reads half the weight bytes of bf16, but on the H200 (8B shape,
CUDA graphs, ``bench/two_level_graph_gpu.py``, 2026-12-01) the cheap block took 3.88 ms against
5.17 ms for the exact verify: 0.75 (the INT8 GEMM at M = k + 2 and the unquantized rest: norms,
attention, the LM head). Two-level then pays only below one-level tau ~1.3, which the same run
saw: x1.04 (0.99-1.04) at tau 1.5, x0.91 at tau 2, x0.82 at tau 3."""
AGREEMENT = 0.99
"""Assumed per-token agreement of the INT8 copy with its bf16 target (the bench measures it)."""


def screen(
    survival: Sequence[float],
    extension: int = 0,
    cheap_fraction: float = CHEAP_FRACTION,
    agreement: float = AGREEMENT,
    draft_fraction: float = 0.0,
) -> str | None:
    """The tuner's verdict from an acceptance profile: None when two-level is predicted to beat
    one-level on a memory-bound verify (the exact verify costs 1 at either width, a cheap forward
    ``cheap_fraction``, the drafter ``draft_fraction``; 0 is the case least kind to two-level),
    else the reason. Roughly it pays while one-level τ < 1 / cheap_fraction (τ 2 at 0.5)."""
    c = cheap_fraction
    p = predict(survival, agreement, extension, draft_fraction, 1.0, 1.0, c, c)
    if p.speedup > 1.0:
        return None
    return (
        f"the cost model predicts {p.speedup:.2f}x one-level at one-level tau {p.tau_one:.2f} "
        f"(tau {p.tau_two:.2f} per exact verify for a cycle {p.cycle_two_s / p.cycle_one_s:.2f}x "
        f"as long, a cheap forward taken as {c:g} of a memory-bound exact verify): the drafter "
        f"is already too good for the cheap level to pay (it pays below tau ~{1 / c:.1f})"
    )


__all__ = [
    "AGREEMENT",
    "CHEAP_FRACTION",
    "TwoLevelPrediction",
    "committed_two_level",
    "predict",
    "screen",
]
