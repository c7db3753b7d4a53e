"""What a ``specpilot tune`` run measures, and the order in which it attacks the gaps.

:func:`scope_notes` states the scope in the report (the runner, the rounds, batched or simulated
acceptance, the registered mechanisms not searched and why); :func:`profiled_gaps` orders the
components by the time the stock engine loses in each, measured by the cost model, for the loop
to rank its directions by (``--rank-gaps profile``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from specpilot.engine.config import EngineConfig

if TYPE_CHECKING:
    from specpilot.tune.evaluate_batched import BatchedStream


def scope_notes(
    base: EngineConfig,
    stream: BatchedStream | None,
    device: str,
    arch: str,
    rounds: int,
    graphs: bool | None = None,
) -> list[str]:
    """What this tune measures, and the registered mechanisms it does not search (with why)."""
    from specpilot.drafters.simulated import SIM_LABEL
    from specpilot.tune.space import skipped_mechanisms

    runner = "CUDA graphs" if device == "cuda" and graphs is not False else "eager"
    lines = [
        f"Measured on the engine the commands serve with ({runner}): each trial warms up, then "
        f"runs AR and the candidate(s) in {rounds} interleaved rounds in this process; a "
        "speedup is the median round with its spread; winners must beat the best by more than "
        "both spreads; a speedup above the cost model's bound is an anomaly, never a winner."
    ]
    if stream is not None:
        lines.append(
            f"Mode: batched. Every candidate serves the same {stream.size} requests (tuning "
            f"prompts cycled, all arriving at once) through the continuous-batching scheduler at "
            f"concurrency {stream.concurrency}; tok/s = tokens of all requests over first arrival "
            "to last finish, speedup = over batched AR on the same stream; every request's "
            "output is token-forced."
        )
    if base.deployment.simulate_acceptance is not None:
        lines.append(
            f"{SIM_LABEL.capitalize()} ({base.deployment.simulate_acceptance}): the drafter runs "
            "for real, its proposals follow the profile, verification is real; the draft length "
            "and the drafter's knobs are fixed by the profile, so only mechanisms are searched."
        )
        lines += tree_ceiling(base.deployment.simulate_acceptance)
    lines += [f"not searched: {s}" for s in skipped_mechanisms(base, device, arch)]
    return lines


def tree_ceiling(profile_text: str) -> list[str]:
    """What a simulated profile with siblings lets any tree reach (``AcceptanceProfile``'s
    ``best_tree_tau``), before the wider verify's cost: one line, none without siblings."""
    from specpilot.drafters.simulated import SIM_LABEL, AcceptanceProfile

    p = AcceptanceProfile.parse(profile_text)
    if p.p_sibling <= 0:
        return []
    chain = p.tau
    taus = {n: p.best_tree_tau(n) for n in (16, 32, 64)}
    best = ", ".join(f"{n} nodes {t:.2f} ({t / chain:.2f}x)" for n, t in taus.items())
    cap = p.best_tree_tau()
    return [
        f"Trees under this profile ({SIM_LABEL}): the chain's τ {chain:.2f}; the best tree of "
        f"{best}; any tree at most τ {cap:.2f} ({cap / chain:.2f}x the chain's), before the cost "
        "of its wider verify."
    ]


def profiled_gaps(
    evaluator: Any, base: Any, prompts: list[list[int]], max_new_tokens: int
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Components ordered by the time they lose per generated token in the stock engine (largest
    first), measured by the cost model on the tuning prompts; unranked components follow. And
    the measured gaps, one line each (``verify 3.10 ms/token (45%)``: the agents' brief)."""
    from specpilot.costmodel.hardware import measure_ceilings
    from specpilot.costmodel.profile_run import profile_engines
    from specpilot.engine.build import build_engine
    from specpilot.tune.space import STATIC_GAP_ORDER

    build = build_engine(base, target=evaluator.stock)
    ceilings = measure_ceilings(evaluator.device, evaluator.dtype)
    # One prompt and two timing rounds: enough to order the components, and cheap enough to leave
    # the main job's budget to the search.
    result = profile_engines(
        build.stock_engine(),
        build.engine(),
        prompts[:1],
        max_new_tokens,
        evaluator.eos_ids,
        ceilings,
        rounds=2,
    )
    measured = [g for g in result.prediction.gaps() if g.lost_s_per_token > 0]
    ranked = [g.component for g in measured]
    lines = tuple(
        f"{g.component} {1e3 * g.lost_s_per_token:.2f} ms/token ({100 * g.share:.0f}%)"
        for g in measured
    )
    return tuple(dict.fromkeys([*ranked, *STATIC_GAP_ORDER])), lines
