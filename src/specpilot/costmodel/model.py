"""The speedup algebra: cycle costs, predicted / ceiling / measured speedup, and ranked gaps.

A cycle (one AR step, or one speculative draft → verify → accept/commit) is a list of terms, one
per cost-model component, each with a roofline time and (when measured) a measured time, both in
seconds **per cycle**. A speculative verify's width varies with the draft length ``d`` (n-gram
lookup drafts fewer than k tokens when it has no long match), so its terms are the expectation
over the draft-length distribution: ``Σ_d P(d) · t_c(1 + d)``.

With E = expected committed tokens per cycle (bonus included, see ``acceptance``):

    predicted speedup = E · t_AR / t_cycle            (measured terms)
    ceiling speedup   = E · t_AR,roof / t_cycle,roof  (every term at its roofline)
    prediction error  = predicted / measured − 1      (measured from a real run)

and a component's gap is the time it loses per generated token,
``(t_c,measured − t_c,roofline) / E``, ranked largest first.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from specpilot.costmodel.acceptance import AcceptanceCurve
from specpilot.costmodel.accounting import TARGET_COMPONENTS
from specpilot.costmodel.gaps import MechanismRef, mechanisms_for

CYCLE_ORDER = ("draft", *TARGET_COMPONENTS, "accept_commit", "overhead")
"""Components of a cycle in the order they run (``overhead``: what no component accounts for)."""


@dataclass(frozen=True, slots=True)
class Term:
    component: str
    roofline_s: float
    """Seconds per cycle at the ceilings."""
    measured_s: float | None
    """Seconds per cycle measured (or estimated on paper); None when unknown."""

    @property
    def gap_s(self) -> float:
        return 0.0 if self.measured_s is None else max(self.measured_s - self.roofline_s, 0.0)


@dataclass(frozen=True, slots=True)
class Cycle:
    terms: tuple[Term, ...]

    @property
    def roofline_s(self) -> float:
        return sum(t.roofline_s for t in self.terms)

    @property
    def measured_s(self) -> float | None:
        vals = [t.measured_s for t in self.terms]
        return None if any(v is None for v in vals) else sum(v for v in vals if v is not None)

    def term(self, component: str) -> Term | None:
        return next((t for t in self.terms if t.component == component), None)

    def to_dict(self) -> dict[str, object]:
        return {
            "roofline_s": self.roofline_s,
            "measured_s": self.measured_s,
            "terms": {
                t.component: {"roofline_s": t.roofline_s, "measured_s": t.measured_s}
                for t in self.terms
            },
        }


def build_cycle(
    width_probs: Mapping[int, float],
    verify_roofline: Mapping[int, Mapping[str, float]],
    verify_measured: Mapping[int, Mapping[str, float]] | None,
    draft: tuple[float, float | None],
    accept_commit: tuple[float, float | None],
    overhead: tuple[float, float | None] = (0.0, 0.0),
) -> Cycle:
    """A cycle's terms from per-width forward costs and the width distribution.

    ``verify_*[w][c]``: seconds of component ``c`` in one forward of width ``w`` (a measured map
    may hold ``overhead``: the forward's time beyond its components, added to the cycle's
    ``overhead``). ``draft``, ``accept_commit`` and ``overhead`` are (roofline, measured) per
    cycle; a measured value of None marks the whole term unknown.
    """
    total_p = sum(width_probs.values())
    if abs(total_p - 1.0) > 1e-6:
        raise ValueError(f"width probabilities sum to {total_p}, not 1")

    def expect(table: Mapping[int, Mapping[str, float]], comp: str) -> float:
        return sum(p * table[w].get(comp, 0.0) for w, p in width_probs.items() if p > 0)

    terms = [Term("draft", *draft)]
    for comp in TARGET_COMPONENTS:
        meas = None if verify_measured is None else expect(verify_measured, comp)
        terms.append(Term(comp, expect(verify_roofline, comp), meas))
    terms.append(Term("accept_commit", *accept_commit))
    fwd_over = 0.0 if verify_measured is None else expect(verify_measured, "overhead")
    over_meas = None if overhead[1] is None else overhead[1] + fwd_over
    terms.append(Term("overhead", overhead[0], over_meas))
    return Cycle(tuple(terms))


def width_probs(curve: AcceptanceCurve) -> dict[int, float]:
    """Verify width w = 1 + draft length → probability."""
    return {1 + d: p for d, p in enumerate(curve.draft_len_probs()) if p > 0}


@dataclass(frozen=True, slots=True)
class Gap:
    component: str
    lost_s_per_token: float
    """(measured − roofline) per cycle ÷ E: seconds lost per generated token."""
    share: float
    """Fraction of all lost time."""
    mechanisms: tuple[MechanismRef, ...]


@dataclass(frozen=True, slots=True)
class Prediction:
    label: str
    """What the figures are: e.g. ``measured components, real acceptance`` or ``prediction
    (on paper)``; every report prints it."""
    acceptance: AcceptanceCurve
    ar: Cycle
    spec: Cycle
    measured_speedup: float | None = None
    """From a real end-to-end run in the same process (decode only), when there was one."""
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def expected_tokens(self) -> float:
        return self.acceptance.expected_tokens()

    @property
    def predicted_speedup(self) -> float | None:
        t_ar, t_cyc = self.ar.measured_s, self.spec.measured_s
        if t_ar is None or not t_cyc:
            return None
        return self.expected_tokens * t_ar / t_cyc

    @property
    def ceiling_speedup(self) -> float:
        return self.expected_tokens * self.ar.roofline_s / self.spec.roofline_s

    @property
    def prediction_error(self) -> float | None:
        p, m = self.predicted_speedup, self.measured_speedup
        return None if p is None or not m else p / m - 1.0

    def tok_s(self) -> dict[str, float | None]:
        """Decode tokens per second: AR and speculative, predicted and at the ceiling."""
        e, ar_m, sp_m = self.expected_tokens, self.ar.measured_s, self.spec.measured_s
        return {
            "ar_predicted": 1 / ar_m if ar_m else None,
            "ar_ceiling": 1 / self.ar.roofline_s,
            "spec_predicted": e / sp_m if sp_m else None,
            "spec_ceiling": e / self.spec.roofline_s,
        }

    def gaps(self) -> list[Gap]:
        """Components of the speculative cycle ranked by time lost per generated token."""
        e = self.expected_tokens
        lost = {t.component: t.gap_s / e for t in self.spec.terms}
        total = sum(lost.values())
        ranked = sorted(lost.items(), key=lambda kv: -kv[1])
        return [
            Gap(c, s, s / total if total else 0.0, mechanisms_for(c)) for c, s in ranked if s > 0
        ]

    def to_dict(self) -> dict[str, object]:
        return {
            "label": self.label,
            "expected_tokens_per_cycle_incl_bonus": self.expected_tokens,
            "acceptance": self.acceptance.to_dict(),
            "ar_step": self.ar.to_dict(),
            "spec_cycle": self.spec.to_dict(),
            "predicted_speedup": self.predicted_speedup,
            "ceiling_speedup": self.ceiling_speedup,
            "measured_speedup": self.measured_speedup,
            "prediction_error": self.prediction_error,
            "tok_s": self.tok_s(),
            "gaps": [
                {
                    "component": g.component,
                    "lost_s_per_token": g.lost_s_per_token,
                    "share": g.share,
                    "mechanisms": [
                        {"name": m.name, "status": m.status, "detail": m.detail}
                        for m in g.mechanisms
                    ],
                }
                for g in self.gaps()
            ],
            "notes": list(self.notes),
        }
