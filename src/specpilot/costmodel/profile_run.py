"""Profile a deployment of the eager engine (:class:`~specpilot.engine.SpecEngine`): run it, time
its components, and assemble the prediction next to the measured speedup."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from specpilot.config import ModelConfig
from specpilot.costmodel.acceptance import AcceptanceCurve
from specpilot.costmodel.accounting import draft_model_work, total
from specpilot.costmodel.assemble import LoopCosts, assemble
from specpilot.costmodel.hardware import Ceilings
from specpilot.costmodel.measure import (
    ForwardTimer,
    measure_forwards,
    run_engines,
    time_greedy_verify,
)
from specpilot.costmodel.model import Prediction, width_probs
from specpilot.engine import SpecEngine


@dataclass(slots=True)
class ProfileResult:
    prediction: Prediction
    extra: dict[str, Any]
    """Run, forward timings, checks: everything that goes into the JSON beside the prediction."""


def profile_engines(
    ar_engine: SpecEngine,
    spec_engine: SpecEngine,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_ids: Sequence[int],
    ceilings: Ceilings,
    draft_cfg: ModelConfig | None = None,
    repeats: int = 1,
    rounds: int = 5,
    clock: str = "wall",
) -> ProfileResult:
    """Real run (AR and speculative, decode only) with rounds of component timings interleaved
    between prompts, at every verify width 1..k+1 and the expected mean context (prompt + half
    the new tokens), then the prediction. ``draft_cfg``: the draft model's shape, for the draft
    roofline (None: a host-side drafter such as n-gram, roofline 0)."""
    model = spec_engine.target
    context = max(1, round(sum(len(p) for p in prompts) / len(prompts) + max_new_tokens / 2))
    # Verify widths 1 .. (drafted per cycle) + 1; a tree strategy feeds more than k tokens.
    width = max(spec_engine.k, int(getattr(spec_engine, "verify_width", spec_engine.k)))
    timer = ForwardTimer(model, range(1, width + 2), context, "eager", clock)
    run = run_engines(
        ar_engine,
        spec_engine,
        prompts,
        max_new_tokens,
        eos_ids,
        repeats,
        between=timer.round,
        clock=clock,
    )
    while timer.rounds < rounds:
        timer.round()
    if run.spec.cycles == 0:
        raise ValueError("the run produced no decode cycles; raise --max-new-tokens")
    curve = (
        AcceptanceCurve.from_stats(run.stats)
        if spec_engine.drafter is not None
        else AcceptanceCurve.none()
    )
    fwd = timer.results()
    missing = sorted((set(width_probs(curve)) | {1}) - set(fwd))
    if missing:  # widths the run used beyond the timer's range
        fwd.update(measure_forwards(model, missing, context, "eager", rounds, clock))
    dev = model.device
    k = curve.k
    gv_spec, gv_ar = (
        time_greedy_verify(k, dev, clock=clock),
        time_greedy_verify(0, dev, clock=clock),
    )

    def loop(r: Any, greedy_s: float) -> LoopCosts:
        phases = sum(r.phases.values())
        return LoopCosts(
            draft_s=r.per_cycle("draft"),
            accept_commit_s=greedy_s + r.per_cycle("commit"),
            overhead_s=max(r.seconds - phases, 0.0) / r.cycles if r.cycles else 0.0,
        )

    elem = model.dtype.itemsize
    draft_roof = 0.0
    if draft_cfg is not None and k > 0:
        draft_roof = total(draft_model_work(draft_cfg, k, context, elem)).roofline_s(ceilings)
    pred = assemble(
        model.cfg,
        elem,
        ceilings,
        curve,
        context,
        fwd,
        ar_loop=loop(run.ar, gv_ar),
        spec_loop=loop(run.spec, gv_spec),
        draft_roofline_s=draft_roof,
        label="measured components, real acceptance",
        measured_speedup=run.measured_speedup,
        notes=(
            "target components: isolated timings at the run's widths and mean context; "
            "draft / accept-commit: the engine's phase timers in the run",
            f"measured speedup: decode-only tok/s ratio of the same run, {run.prompts} prompts, "
            f"median of {repeats} repeat(s) per prompt; {timer.rounds} component timing rounds "
            f"interleaved with it (context {context}; the run's mean {run.mean_context:.0f}); "
            f"{clock} clock",
        ),
    )
    # Check: the verify phase as the run timed it vs what the isolated timings predict.
    probs = width_probs(curve)
    verify_pred = sum(p * fwd[w].forward_s for w, p in probs.items()) + gv_spec
    extra: dict[str, Any] = {
        "ceilings": ceilings.to_dict(),
        "run": run.to_dict(),
        "forward_times": {str(w): t.to_dict() for w, t in fwd.items()},
        "checks": {
            "verify_phase_in_run_s_per_cycle": run.spec.per_cycle("verify"),
            "verify_phase_predicted_s_per_cycle": verify_pred,
            "ar_step_in_run_s": run.ar.seconds / run.ar.cycles if run.ar.cycles else None,
            "ar_step_predicted_s": pred.ar.measured_s,
            "expected_tokens_formula": curve.expected_tokens(),
            "tau_measured": run.stats.mean_accepted_len,
        },
    }
    return ProfileResult(pred, extra)
