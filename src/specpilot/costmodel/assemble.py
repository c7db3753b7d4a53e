"""Put measurements and accounting together into a :class:`~specpilot.costmodel.model.Prediction`.

Where each term comes from (per cycle):

* target components (embedding … argmax) and the forward's own ``overhead``: the isolated
  component timings of ``measure`` at every verify width the run used, at the run's mean
  context, weighted by the draft-length distribution; rooflines from ``accounting``;
* ``draft``, ``accept_commit``, loop ``overhead``: the engine's own phase timers from the real
  run (``LoopCosts``), since they are host work or small kernels that do not exist in isolation;
  rooflines: the drafter's accounting (n-gram: 0, host only) and ``accept_work``.
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
) -> Prediction:
    """The prediction for one deployment from its measured parts (see the module docstring)."""
    probs = width_probs(curve)
    missing = sorted((set(probs) | {1}) - set(forward_times))
    if missing:
        raise ValueError(f"no forward timings at widths {missing}")
    widths = sorted(set(probs) | {1})
    roof = verify_rooflines(cfg, widths, context, elem_bytes, ceilings)
    meas = {w: forward_times[w].as_terms() for w in widths}
    ar = build_cycle(
        {1: 1.0},
        roof,
        meas,
        draft=(0.0, ar_loop.draft_s),
        accept_commit=(
            accept_work(0, launches=accept_launches).roofline_s(ceilings),
            ar_loop.accept_commit_s,
        ),
        overhead=(0.0, ar_loop.overhead_s),
    )
    spec = build_cycle(
        probs,
        roof,
        meas,
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
