"""Put measurements and accounting together into a :class:`~specpilot.costmodel.model.Prediction`.

Where each term comes from (per cycle):

* target components (embedding … argmax) and the forward's own ``overhead``: the isolated
  component timings of ``measure`` at every verify width the run used, at the run's mean
  context, weighted by the draft-length distribution; rooflines from ``accounting``;
* ``draft``, ``accept_commit``, loop ``overhead``: the engine's own phase timers from the real
  run (``LoopCosts``), since they are host work or small kernels that do not exist in isolation;
  rooflines: the drafter's accounting (n-gram: 0, host only) and ``accept_work``.

Widths: a draft of length d needs a forward of ``w = 1 + d`` tokens, but the engine may run a
wider one (CUDA graphs round a chain up to a power of two; packed and tree plans round rows up
to their bucket). ``run_width[w]`` is the forward the engine ran (its measured terms) and
``roof_width[w]`` the forward the roofline counts (default: both ``w``), so padding shows up as
a gap, not as a cheaper ceiling.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass

from specpilot.config import ModelConfig
from specpilot.costmodel.acceptance import AcceptanceCurve
from specpilot.costmodel.accounting import accept_work, forward_work, roofline
from specpilot.costmodel.hardware import Ceilings
from specpilot.costmodel.measure import ForwardTimes
from specpilot.costmodel.model import Prediction, build_cycle, width_probs


@dataclass(frozen=True, slots=True)
class LoopCosts:
    """Seconds per cycle an engine spends outside the target forward, measured in a run."""

    draft_s: float
    accept_commit_s: float
    overhead_s: float = 0.0

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def verify_rooflines(
    cfg: ModelConfig, widths: list[int], context: int, elem_bytes: float, c: Ceilings
) -> dict[int, dict[str, float]]:
    """Width → component → roofline seconds of a causal forward of that width."""
    return {w: roofline(forward_work(cfg, w, context, elem_bytes), c) for w in widths}


def assemble(
    cfg: ModelConfig,
    elem_bytes: float,
    ceilings: Ceilings,
    curve: AcceptanceCurve,
    context: int,
    forward_times: Mapping[int, ForwardTimes],
    ar_loop: LoopCosts,
    spec_loop: LoopCosts,
    draft_roofline_s: float,
    label: str,
    measured_speedup: float | None = None,
    accept_launches: float = 10,
    notes: tuple[str, ...] = (),
    run_width: Mapping[int, int] | None = None,
    roof_width: Mapping[int, int] | None = None,
) -> Prediction:
    """The prediction for one deployment from its measured parts (see the module docstring).
    Widths missing from ``run_width`` / ``roof_width`` map to themselves; the AR step is a
    forward of width 1."""
    probs = width_probs(curve)
    run = {w: (run_width or {}).get(w, w) for w in probs}
    roof_at = {w: (roof_width or {}).get(w, w) for w in probs}
    missing = sorted((set(run.values()) | {1}) - set(forward_times))
    if missing:
        raise ValueError(f"no forward timings at widths {missing}")
    needed = sorted(set(roof_at.values()) | {1})
    rooflines = verify_rooflines(cfg, needed, context, elem_bytes, ceilings)
    ar = build_cycle(
        {1: 1.0},
        {1: rooflines[1]},
        {1: forward_times[1].as_terms()},
        draft=(0.0, ar_loop.draft_s),
        accept_commit=(
            accept_work(0, launches=accept_launches).roofline_s(ceilings),
            ar_loop.accept_commit_s,
        ),
        overhead=(0.0, ar_loop.overhead_s),
    )
    spec = build_cycle(
        probs,
        {w: rooflines[roof_at[w]] for w in probs},
        {w: forward_times[run[w]].as_terms() for w in probs},
        draft=(draft_roofline_s, spec_loop.draft_s),
        accept_commit=(
            accept_work(curve.k, launches=accept_launches).roofline_s(ceilings),
            spec_loop.accept_commit_s,
        ),
        overhead=(0.0, spec_loop.overhead_s),
    )
    return Prediction(
        label=label,
        acceptance=curve,
        ar=ar,
        spec=spec,
        measured_speedup=measured_speedup,
        notes=notes,
    )
