"""Profile a deployment on the one engine: run it (stock AR and speculative, through
``generate``), time its forward's components as the engine runs them, and assemble the
prediction next to the measured speedup.

Where each measured term comes from (per cycle, see docs/COSTMODEL.md):

* target components and the forward's own overhead: the engine's :class:`Forward` pieces timed
  in isolation (CUDA-graph replays when the engine replays graphs) at the widths the engine
  runs, at the run's mean context, in rounds interleaved with the run;
* draft, accept_commit and the loop overhead of the speculative cycle: the engine's phase
  timers (``Engine(profile=True)``: ``times.draft``, ``times.accept``, ``times.other``);
* the AR step: its forward and its device accept timed in isolation; its loop overhead is what
  the run's AR step time leaves beyond those (an AR window has no phase timers: it queues
  ``sync_every`` steps before one read-back).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from specpilot.config import ModelConfig
from specpilot.costmodel.acceptance import AcceptanceCurve
from specpilot.costmodel.accounting import block_drafter_work, draft_model_work, total
from specpilot.costmodel.assemble import LoopCosts, assemble
from specpilot.costmodel.hardware import Ceilings
from specpilot.costmodel.measure import ForwardTimer, measure_forwards, time_device_accept
from specpilot.costmodel.model import Prediction, width_probs
from specpilot.costmodel.run import run_engines
from specpilot.costmodel.shapes import BlockDrafterSpec
from specpilot.drafters.base import Drafter
from specpilot.drafters.block_drafter import BlockDrafter
from specpilot.drafters.draft_model import DraftModelDrafter
from specpilot.drafters.simulated import SIM_LABEL, SimulatedAcceptance
from specpilot.engine import Engine, generate
from specpilot.engine.plans import ChainPlan, PackedPlan, TreePlan
from specpilot.models.layout import bucket_rows


@dataclass(slots=True)
class ProfileResult:
    prediction: Prediction
    extra: dict[str, Any]
    """Run, forward timings, checks: everything that goes into the JSON beside the prediction."""


# ---------------------------------------------------------------------- the drafter
def _unwrapped(drafter: Drafter | None) -> list[object]:
    """The drafter and every drafter it wraps (``inner``), outermost first."""
    out: list[object] = []
    d: object | None = drafter
    while d is not None and len(out) < 16:
        out.append(d)
        d = getattr(d, "inner", None)
    return out


def is_simulated(drafter: Drafter | None) -> bool:
    """Whether the drafter's acceptance is simulated (wrapped in ``SimulatedAcceptance``)."""
    return any(isinstance(d, SimulatedAcceptance) for d in _unwrapped(drafter))


def drafter_roofline_s(
    engine: Engine,
    context: int,
    ceilings: Ceilings,
    draft_cfg: ModelConfig | None = None,
) -> float:
    """Roofline seconds of one draft: a draft model's k forwards, a block drafter's context
    projection and block forward, 0 for host drafters (n-gram) and unknown kinds.
    ``draft_cfg`` overrides the draft model's shape."""
    k, elem = engine.k, engine.target.dtype.itemsize
    if k == 0:
        return 0.0
    if draft_cfg is not None:
        return total(draft_model_work(draft_cfg, k, context, elem)).roofline_s(ceilings)
    for d in _unwrapped(engine.drafter):
        if isinstance(d, DraftModelDrafter):
            work = draft_model_work(d.model.cfg, k, context, elem)
            return total(work).roofline_s(ceilings)
        if isinstance(d, BlockDrafter):
            spec = BlockDrafterSpec(d.cfg.num_layers, d.block, len(d.hidden_layers))
            work = block_drafter_work(engine.target.cfg, spec, context, elem)
            return total(work).roofline_s(ceilings)
    return 0.0


# ---------------------------------------------------------------------- widths
def _pow2(w: int, cap: int) -> int:
    """``ChainPlan``'s graph width: the smallest power of two >= ``w``, capped at ``cap``."""
    p = 1
    while p < w:
        p *= 2
    return min(p, cap)


def width_maps(
    engine: Engine, widths: Sequence[int], rows_per_cycle: float
) -> tuple[dict[int, int], dict[int, int], str]:
    """(forward width run, forward width of the roofline) per useful width ``1 + d``, and a note.

    Chain: the engine runs ``1 + d`` (a power of two under CUDA graphs); packed: ``1 + d``
    rounded up to the bucket; tree: its packed rows (``rows_per_cycle``, the run's mean), which
    is the tree's root and nodes for one fixed tree, for both the run and the roofline (the
    curve's d is then the tree's depth)."""
    k, plan = engine.k, engine.plan
    if isinstance(plan, TreePlan):
        m = max(1, round(rows_per_cycle))
        note = f"tree verify: a dense forward of the run's mean {rows_per_cycle:.1f} packed rows"
        return {w: m for w in widths}, {w: m for w in widths}, note
    if isinstance(plan, PackedPlan):
        run = {w: min(bucket_rows(w, plan.bucket), k + 1) for w in widths}
        note = f"packed verify: rows rounded up to the bucket of {plan.bucket}, timed dense"
        return run, {w: w for w in widths}, note
    if isinstance(plan, ChainPlan) and engine.runner.use_graphs:
        run = {w: _pow2(w, k + 1) for w in widths}
        return run, {w: w for w in widths}, "chain verify on CUDA graphs: widths rounded to 2^n"
    return {w: w for w in widths}, {w: w for w in widths}, "chain verify of 1 + d tokens"


def timed_widths(engine: Engine) -> list[int]:
    """The forward widths to time alongside the run (1, for the AR step, included): every width
    the engine can run at batch 1 for a host drafter, whose drafts vary in length; the full
    width for a device drafter, which drafts k tokens every cycle but the last few (widths the
    run used beyond these are timed after it)."""
    k, plan, drafter = engine.k, engine.plan, engine.drafter
    if drafter is None:
        return [1]
    if isinstance(plan, TreePlan):
        return sorted({1, plan.block_width(k)})
    run, _, _ = width_maps(engine, range(1, k + 2), 0.0)
    if drafter.graph_safe:
        return sorted({1, run[k + 1]})
    return sorted({1, *run.values()})


# ---------------------------------------------------------------------- the profile
def profile_engines(
    ar_engine: Engine,
    spec_engine: Engine,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_ids: Sequence[int],
    ceilings: Ceilings,
    draft_cfg: ModelConfig | None = None,
    repeats: int = 1,
    rounds: int = 5,
    clock: str = "wall",
    simulated: bool | None = None,
    warmup: bool = True,
) -> ProfileResult:
    """Real run (AR and speculative, decode only, one prompt at a time) with rounds of
    component timings interleaved between prompts, at every verify width the engine can run and
    the expected mean context (prompt + half the new tokens), then the prediction.

    The speculative engine's phase timers are switched on for the run (``profile``; restored
    after). ``draft_cfg``: the draft model's shape for the draft roofline (default: read from
    the drafter; host drafters such as n-gram have roofline 0). ``simulated``: the drafter's
    acceptance is simulated (default: detected); every label then says so. ``warmup``: decode
    the longest prompt once with each engine first, so that graph captures (one per verify
    width and attention bucket), Triton compiles and allocator growth stay out of the run."""
    if not prompts:
        raise ValueError("profile needs at least one prompt")
    if warmup:
        longest = max(prompts, key=len)
        for engine in (ar_engine, spec_engine):
            generate(engine, [longest], max_new_tokens, eos_ids)
    model = spec_engine.target
    sim = is_simulated(spec_engine.drafter) if simulated is None else simulated
    context = max(1, round(sum(len(p) for p in prompts) / len(prompts) + max_new_tokens / 2))
    timer = ForwardTimer.for_engine(spec_engine, timed_widths(spec_engine), context, clock)
    was_profiling = spec_engine.profile
    spec_engine.profile = True
    try:
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
    finally:
        spec_engine.profile = was_profiling
    while timer.rounds < rounds:
        timer.round()
    if run.spec.cycles == 0 or run.ar.cycles == 0:
        raise ValueError("the run produced no decode cycles; raise --max-new-tokens")
    speculative = spec_engine.drafter is not None
    source = "simulated" if sim else "measured"
    curve = AcceptanceCurve.from_stats(run.stats, source) if speculative else AcceptanceCurve.none()
    probs = width_probs(curve)
    rows_per_cycle = run.spec.rows_verified / run.spec.cycles
    run_w, roof_w, width_note = width_maps(spec_engine, sorted(probs), rows_per_cycle)
    fwd = timer.results()
    missing = sorted((set(run_w.values()) | {1}) - set(fwd))
    if missing:  # widths the run used beyond the timer's (e.g. a tree's mean rows)
        fwd.update(
            measure_forwards(
                spec_engine.fwd, missing, context, rounds, clock,
                spec_engine.runner.use_graphs, spec_engine.attn_bucket, spec_engine.slots,
            )
        )  # fmt: skip
    dev = model.device
    ar_accept = time_device_accept(0, dev, graphs=ar_engine.runner.use_graphs, clock=clock)
    ar_loop = LoopCosts(
        draft_s=0.0,
        accept_commit_s=ar_accept,
        overhead_s=max(run.ar.step_s - fwd[1].forward_s - ar_accept, 0.0),
    )
    if speculative:
        spec_loop = LoopCosts(
            draft_s=run.spec.per_cycle("draft"),
            accept_commit_s=run.spec.per_cycle("accept"),
            overhead_s=max(run.spec.per_cycle("other"), 0.0),
        )
    else:
        spec_loop = LoopCosts(
            0.0, ar_accept, max(run.spec.step_s - fwd[1].forward_s - ar_accept, 0.0)
        )
    acc = f"{SIM_LABEL}" if sim else "real acceptance"
    mode = "CUDA-graph replays" if timer.graphs else "eager"
    pred = assemble(
        model.cfg,
        model.dtype.itemsize,
        ceilings,
        curve,
        context,
        fwd,
        ar_loop=ar_loop,
        spec_loop=spec_loop,
        draft_roofline_s=drafter_roofline_s(spec_engine, context, ceilings, draft_cfg),
        label=f"measured components, {acc}",
        measured_speedup=run.measured_speedup,
        run_width=run_w,
        roof_width=roof_w,
        notes=(
            *((f"every speculative figure here is {SIM_LABEL}: the drafter computes for real, "
               "its proposals follow the stated profile, verification is real",) if sim else ()),
            f"target components: the engine's forward pieces timed in isolation ({mode}) at the "
            f"run's widths and mean context; {width_note}",
            "draft / accept / other: the engine's phase timers in the run; AR loop overhead: the "
            "run's AR step beyond its isolated forward and accept",
            f"measured speedup: decode-only tok/s ratio of the same run ({acc}), {run.prompts} "
            f"prompts, median of {repeats} repeat(s) per prompt; {timer.rounds} component timing "
            f"rounds interleaved with it (context {context}; the run's mean "
            f"{run.mean_context:.0f}); {clock} clock",
        ),
    )  # fmt: skip
    verify_pred = sum(p * fwd[run_w[w]].forward_s for w, p in probs.items())
    checks: dict[str, Any] = {
        "verify_phase_in_run_s_per_cycle": run.spec.per_cycle("verify") if speculative else None,
        "verify_phase_predicted_s_per_cycle": verify_pred,
        "spec_cycle_in_run_s": run.spec.step_s,
        "spec_cycle_predicted_s": pred.spec.measured_s,
        "ar_step_in_run_s": run.ar.step_s,
        "ar_step_predicted_s": pred.ar.measured_s,
        "expected_tokens_formula": curve.expected_tokens(),
        "tau_measured": run.stats.mean_accepted_len if speculative else 1.0,
    }
    extra: dict[str, Any] = {
        "acceptance": "simulated" if sim else "real",
        "ceilings": ceilings.to_dict(),
        "run": run.to_dict(),
        "forward_times": {str(w): t.to_dict() for w, t in fwd.items()},
        "widths": {"run": {str(w): v for w, v in run_w.items()}, "roofline": {str(w): v for w, v in roof_w.items()}},
        "runner": mode,
        "checks": checks,
    }  # fmt: skip
    return ProfileResult(pred, extra)
