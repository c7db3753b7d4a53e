"""A real AR-vs-speculative run of the one engine, decode-only figures from its own timers.

:func:`run_engines` decodes every prompt with the stock AR engine and the speculative engine
through :func:`~specpilot.engine.scheduler.generate`, alternating, and keeps decode-only figures
(prefill excluded, its token not counted) from the engine's timers
(:class:`~specpilot.engine.types.CycleTimes`): tokens, wall seconds, cycles and the draft /
verify / accept / other split of the speculative engine (its ``profile`` timers).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from specpilot.costmodel.measure import CLOCKS
from specpilot.engine import AcceptanceStats, CycleTimes, Engine, generate

PHASES = ("draft", "verify", "accept", "other")
"""The engine's decode-time split (``CycleTimes``): other = wall − draft − verify − accept."""


@dataclass(slots=True)
class EngineRun:
    """Decode-only totals of one engine over a prompt set (medians over repeats per prompt)."""

    tokens: int = 0
    """Decode tokens: committed tokens after prefill's first."""
    seconds: float = 0.0
    cycles: int = 0
    """Verify forwards (AR: steps)."""
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds in the engine's phases during decode (``PHASES``; 0 without profile timers)."""
    rows_verified: int = 0
    """Packed rows verified (packed and tree plans; bucket padding included), else 0."""

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def step_s(self) -> float:
        """Seconds per cycle (AR: per step)."""
        return self.seconds / self.cycles if self.cycles else 0.0

    def per_cycle(self, phase: str) -> float:
        return self.phases.get(phase, 0.0) / self.cycles if self.cycles else 0.0

    def to_dict(self) -> dict[str, object]:
        return {
            "tokens": self.tokens,
            "seconds": self.seconds,
            "cycles": self.cycles,
            "tok_s": self.tok_s,
            "phases_s": dict(self.phases),
            "rows_verified": self.rows_verified,
        }


@dataclass(slots=True)
class RunMeasurement:
    ar: EngineRun
    spec: EngineRun
    stats: AcceptanceStats
    """Acceptance counts of the speculative engine (first repeat)."""
    mean_context: float
    """Mean committed length at a decode step (prompt + half the generated tokens)."""
    prompts: int
    identical: int
    """Prompts whose speculative tokens equal AR's (every repeat of both)."""
    repeats: int
    clock: str = "wall"

    @property
    def measured_speedup(self) -> float:
        return self.spec.tok_s / self.ar.tok_s if self.ar.tok_s else 0.0

    def to_dict(self) -> dict[str, object]:
        return {
            "ar": self.ar.to_dict(),
            "spec": self.spec.to_dict(),
            "measured_speedup": self.measured_speedup,
            "acceptance": self.stats.to_dict(),
            "mean_context": self.mean_context,
            "prompts": self.prompts,
            "identical_to_ar": self.identical,
            "repeats": self.repeats,
            "clock": self.clock,
            "note": "decode only (prefill and its token excluded); medians over repeats",
        }


@dataclass(slots=True)
class _Once:
    tokens: list[int]
    stats: AcceptanceStats
    seconds: float
    phases: dict[str, float]
    cycles: int
    rows_verified: int


def _decode_once(
    engine: Engine, ids: Sequence[int], max_new: int, eos: Sequence[int], clock: str
) -> _Once:
    """One generation through the scheduler; decode-only seconds and phases.

    ``wall``: the engine's own timers (``CycleTimes.wall``: decode steps only, prefill and
    simulated-acceptance reference runs excluded). ``process``: CPU seconds of the generation
    minus those of a prefill-only generation of the same prompt; the phases are scaled from
    wall to CPU time by the same ratio.
    """
    now = CLOCKS[clock]
    engine.times = CycleTimes()  # this generation's timers alone
    c0 = now()
    res = generate(engine, [ids], max_new, eos)[0]
    cpu = now() - c0
    t = engine.times
    phases = {"draft": t.draft, "verify": t.verify, "accept": t.accept, "other": t.other}
    rows = int(getattr(engine.plan, "rows_verified", 0) or 0)
    once = _Once(res.tokens, res.stats, t.wall, phases, t.cycles, rows)
    if clock == "wall":
        return once
    c0 = now()
    generate(engine, [ids], 1, eos)  # prefill and its token only
    decode = max(cpu - (now() - c0), 0.0)
    scale = decode / t.wall if t.wall else 1.0
    once.seconds = decode
    once.phases = {k: v * scale for k, v in phases.items()}
    return once


def run_engines(
    ar_engine: Engine,
    spec_engine: Engine,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_ids: Sequence[int],
    repeats: int = 1,
    between: Callable[[], None] | None = None,
    clock: str = "wall",
) -> RunMeasurement:
    """Decode each prompt with AR then speculative, ``repeats`` times, alternating;
    ``between()`` runs after every (prompt, repeat) pair (e.g. a round of component timings)."""
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {', '.join(CLOCKS)}, got {clock!r}")
    ar, spec = EngineRun(), EngineRun()
    stats = AcceptanceStats()
    identical, ctx_sum, ctx_n = 0, 0.0, 0
    for ids in prompts:
        per: dict[str, list[_Once]] = {"ar": [], "spec": []}
        for rep in range(repeats):
            for name, engine in (("ar", ar_engine), ("spec", spec_engine)):
                once = _decode_once(engine, ids, max_new_tokens, eos_ids, clock)
                per[name].append(once)
                if name == "spec" and rep == 0:
                    stats.merge(once.stats)
            if between is not None:
                between()
        want = per["ar"][0].tokens
        identical += int(all(r.tokens == want for r in per["ar"] + per["spec"]))
        n_new = len(per["spec"][0].tokens)
        ctx_sum += (len(ids) + n_new / 2) * n_new
        ctx_n += n_new
        for name, run in (("ar", ar), ("spec", spec)):
            rows = per[name]
            run.seconds += statistics.median(r.seconds for r in rows)
            for phase in PHASES:
                run.phases[phase] = run.phases.get(phase, 0.0) + statistics.median(
                    r.phases[phase] for r in rows
                )
            run.cycles += rows[0].cycles
            run.tokens += len(rows[0].tokens) - 1
            run.rows_verified += rows[0].rows_verified
    return RunMeasurement(
        ar=ar,
        spec=spec,
        stats=stats,
        mean_context=ctx_sum / ctx_n if ctx_n else 0.0,
        prompts=len(prompts),
        identical=identical,
        repeats=repeats,
        clock=clock,
    )
