"""The search loop, in rounds.

round 0: the stock speculative config (what the user gave), plus the validated configs of the
         most similar deployments in memory (warm start, reported by name);
round r: rank the gaps → the explorers of the directions that attack the biggest ones propose
         candidates around the current best → the executor evaluates them → every candidate is
         token-forced (a mismatch rejects it, logged with its first mismatch) → passing candidates
         that beat the best by ``min_gain`` are winners → winners from different directions are
         stacked and the stack re-measured (gains do not simply add) → memory is updated.
Stop at the round or time budget, or after a round that improves nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from specpilot.engine.config import EngineConfig
from specpilot.memory import Fingerprint, MemoryStore
from specpilot.tune.evaluate import TrialResult
from specpilot.tune.executors import Executor
from specpilot.tune.explorers import Explorer, Proposal
from specpilot.tune.space import Direction, config_hash, describe

STATIC_GAP_ORDER = (
    "draft",
    "verify",
    "lm_head",
    "mlp",
    "attn_proj",
    "attn_kv",
    "overhead",
    "accept_commit",
)
"""Component order used when no measured profile ranks the gaps."""


@dataclass(frozen=True, slots=True)
class TuneSettings:
    rounds: int = 3
    """Most search rounds after round 0."""
    trials_per_direction: int = 3
    directions_per_round: int = 3
    budget_seconds: float = 1800.0
    min_gain: float = 0.02
    """A candidate must beat the best speedup by this fraction to count as a winner (noise margin)."""
    seed: int = 0


@dataclass(slots=True)
class Trial:
    round: int
    explorer: str
    result: TrialResult
    reused_from: str | None = None


@dataclass(slots=True)
class TuneOutcome:
    stock: TrialResult
    best: TrialResult
    ar_tok_s: float
    trials: list[Trial] = field(default_factory=list)
    reused: list[str] = field(default_factory=list)
    wall_seconds: float = 0.0
    device_seconds: float = 0.0
    rounds_run: int = 0


def rank_directions(directions: Sequence[Direction], gap_order: Sequence[str]) -> list[Direction]:
    """Directions sorted by the rank of the best-ranked component they attack."""
    rank = {c: i for i, c in enumerate(gap_order)}
    return sorted(
        directions,
        key=lambda d: min((rank.get(c, len(rank)) for c in d.attacks), default=len(rank)),
    )


class TuneLoop:
    def __init__(
        self,
        base: EngineConfig,
        directions: Sequence[Direction],
        executor: Executor,
        store: MemoryStore,
        fingerprint: Fingerprint,
        label: str,
        settings: TuneSettings,
        gap_order: Sequence[str] = STATIC_GAP_ORDER,
        resume: bool = False,
        log: Callable[[str], None] = print,
    ) -> None:
        self.base, self.executor, self.store, self.fp = base, executor, store, fingerprint
        self.settings, self.log = settings, log
        self.directions = rank_directions(directions, gap_order)
        self.explorers = {d.name: Explorer(d, seed=settings.seed) for d in self.directions}
        self.quarantined: set[str] = set()
        self.deployment = store.add_deployment(fingerprint, label)
        previous = store.latest_run(self.deployment) if resume else None
        if previous is not None:
            self.run_id = previous[0]
            self.done = {t.config_hash: t for t in store.trials(run=self.run_id)}
            self.log(
                f"resuming run {self.run_id}: {len(self.done)} finished trials are reused, not re-run"
            )
        else:
            self.run_id = store.start_run(
                self.deployment, {"settings": settings.__repr__(), "base": base.to_json()}
            )
            self.done = {}

    # ------------------------------------------------------------------ helpers
    def _evaluate(
        self, round_: int, explorer: str, configs: Sequence[EngineConfig]
    ) -> list[TrialResult]:
        """Evaluate configs not already finished in this run; record each as it comes back."""
        todo = [c for c in configs if config_hash(c) not in self.done]
        results = {config_hash(r.config): r for r in self.executor.map(todo)} if todo else {}
        out = []
        for c in configs:
            h = config_hash(c)
            if h in results:
                r = results[h]
                self.store.add_trial(
                    self.run_id,
                    self.deployment,
                    round_,
                    explorer,
                    h,
                    _cfg(c),
                    r.metrics(),
                    r.forcing_ok,
                    r.forcing,
                    r.device_seconds,
                    r.wall_seconds,
                )
                self.done[h] = self.store.trials(run=self.run_id)[-1]
            else:
                row = self.done[h]
                r = TrialResult(
                    config=c,
                    tok_s=row.metrics["tok_s"],
                    speedup=row.metrics["speedup"],
                    tau=row.metrics["tau"],
                    acceptance=row.metrics["acceptance"],
                    forcing_ok=row.forcing_ok,
                    forcing=row.forcing,
                    device_seconds=0.0,
                    wall_seconds=0.0,
                    phase_seconds=row.metrics.get("phase_seconds", {}),
                    error=row.metrics.get("error"),
                )
            verdict = "ok" if r.forcing_ok else f"REJECTED by token forcing {r.forcing}"
            self.log(
                f"  [{explorer}] {describe(c)}: {r.tok_s:.1f} tok/s, {r.speedup:.2f}x AR, τ {r.tau:.2f}, {verdict}"
            )
            out.append(r)
        return out

    # --------------------------------------------------------------------- loop
    def run(self) -> TuneOutcome:
        t0 = time.perf_counter()
        s = self.settings
        self.log(f"round 0: stock engine ({describe(self.base)}) and warm start")
        stock = self._evaluate(0, "stock", [self.base])[0]
        outcome = TuneOutcome(stock=stock, best=stock, ar_tok_s=self.executor.ar_tok_s)
        outcome.trials.append(Trial(0, "stock", stock))
        for label, _sim, row in self.store.similar_validated(self.fp):
            try:
                cfg = _with_deployment(EngineConfig.from_dict(row["config"]), self.base)
            except Exception:
                continue
            r = self._evaluate(0, "memory", [cfg])[0]
            outcome.trials.append(Trial(0, "memory", r, reused_from=label))
            outcome.reused.append(f"{label}: {describe(cfg)} → {r.speedup:.2f}x here")
            if r.forcing_ok and r.speedup > outcome.best.speedup:
                outcome.best = r

        for round_ in range(1, s.rounds + 1):
            if time.perf_counter() - t0 > s.budget_seconds:
                self.log("time budget spent")
                break
            outcome.rounds_run = round_
            picked = [d for d in self.directions if d.name not in self.quarantined][
                : s.directions_per_round
            ]
            self.log(
                f"round {round_}: directions {', '.join(d.name for d in picked)} (best so far {outcome.best.speedup:.2f}x)"
            )
            winners: list[tuple[Proposal, TrialResult]] = []
            for d in picked:
                ex = self.explorers[d.name]
                proposals = ex.propose(outcome.best.config, s.trials_per_direction)
                results = self._evaluate(round_, d.name, [p.config for p in proposals])
                for p, r in zip(proposals, results, strict=True):
                    ex.tell(p.trial_number, r.speedup if r.forcing_ok else 0.0)
                    outcome.trials.append(Trial(round_, d.name, r))
                    if r.forcing_ok and r.speedup > outcome.best.speedup * (1 + s.min_gain):
                        winners.append((p, r))
                if d.name.startswith("mechanism:") and any(not r.forcing_ok for r in results):
                    # One mismatch proves the mechanism is not lossless here; a later pass on other
                    # prompts would only mean the fault was not triggered.
                    self.quarantined.add(d.name)
                    winners = [w for w in winners if w[0].explorer != d.name]
                    self.log(f"  {d.name} quarantined: a candidate with it failed token forcing")
            if not winners:
                self.log(
                    f"round {round_}: no candidate beat {outcome.best.speedup:.2f}x by {s.min_gain:.0%}; stopping"
                )
                break
            best_round = max(winners, key=lambda w: w[1].speedup)
            by_direction: dict[str, tuple[Proposal, TrialResult]] = {}
            for p, r in winners:
                if (
                    p.explorer not in by_direction
                    or r.speedup > by_direction[p.explorer][1].speedup
                ):
                    by_direction[p.explorer] = (p, r)
            new_best = best_round[1]
            if len(by_direction) > 1:  # integrate: stack every direction's winner, re-measure
                stacked = outcome.best.config
                for p, _ in by_direction.values():
                    stacked = self.explorers[p.explorer].direction.derive(stacked, p.params)
                r = self._evaluate(round_, "integrate", [stacked])[0]
                outcome.trials.append(Trial(round_, "integrate", r))
                if r.forcing_ok and r.speedup > new_best.speedup:
                    new_best = r
            outcome.best = new_best
            h = config_hash(new_best.config)
            self.store.validate(
                self.deployment, h, _cfg(new_best.config), new_best.speedup, self.done[h].id
            )

        if outcome.best is stock and stock.forcing_ok:
            self.store.validate(
                self.deployment,
                config_hash(stock.config),
                _cfg(stock.config),
                stock.speedup,
                self.done[config_hash(stock.config)].id,
            )
        self.store.finish_run(self.run_id)
        outcome.wall_seconds = time.perf_counter() - t0
        outcome.device_seconds = sum(t.result.device_seconds for t in outcome.trials)
        return outcome


def _cfg(c: EngineConfig) -> dict[str, Any]:
    import json

    return dict(json.loads(c.to_json()))


def _with_deployment(cfg: EngineConfig, base: EngineConfig) -> EngineConfig:
    """A config validated elsewhere, moved onto this deployment (knobs and mechanisms kept)."""
    import dataclasses

    return dataclasses.replace(cfg, deployment=base.deployment)
