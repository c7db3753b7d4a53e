"""The search loop, in rounds.

round 0: the stock speculative config (what the user gave), plus the validated configs of the
         most similar deployments in memory (warm start, reported by name);
round r: rank the gaps → the explorers of the directions that attack the biggest ones propose
         candidates around the current best → the executor evaluates them → every candidate is
         token-forced (a mismatch rejects it, logged with its first mismatch) → passing candidates
         whose speedup beats the best's by more than both spreads (and by ``min_gain``), and
         that the cost model can explain, are winners → winners from different directions are
         stacked and the stack re-measured (gains do not simply add) → memory is updated.
Every speedup is a median of per-round ratios over AR measured interleaved in one process
(``tune/evaluate.py``); a candidate within the noise of the best is not a winner.
Stop at the round or time budget, or after a round that improves nothing. The trials are run,
budgeted and recorded by ``tune/trials.py`` (a chunk is started only if the time left covers the
median chunk so far, so the last round is cut short cleanly: its finished candidates are still
integrated). With a streaming executor (Ray's, ``tune/ray_executor.py``) a round's candidates of
all its directions go to the workers as one queue (``tune/dispatch.py``); the round's decisions
wait for all of them, so the search is the same as one direction after another. Without a warm
start the stock trial joins round 1's queue (round 1 proposes around the stock config, known
before it is measured).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from specpilot.engine.config import EngineConfig
from specpilot.memory import Fingerprint, MemoryStore
from specpilot.tune.confirm import best_contender, clock, confirm_winner
from specpilot.tune.dispatch import Batch
from specpilot.tune.evaluate import TrialResult
from specpilot.tune.executors import Executor
from specpilot.tune.explorers import Proposal, Proposer, make_explorer
from specpilot.tune.integrate import stacked
from specpilot.tune.outcome import Trial, TuneOutcome, TuneSettings
from specpilot.tune.proposal import RoundPlanner
from specpilot.tune.space import (
    STATIC_GAP_ORDER,
    Direction,
    describe,
    rank_directions,
    with_deployment,
)
from specpilot.tune.trials import TrialRunner
from specpilot.tune.usage import Usage

Measured = Iterable[tuple[Direction, list[Proposal], list[TrialResult]]]
"""A round's directions, each with its proposals and their results (shorter if cut)."""

__all__ = ["STATIC_GAP_ORDER", "Trial", "TuneLoop", "TuneOutcome", "TuneSettings"]


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
        planner: RoundPlanner | None = None,
        kernels: dict[str, Any] | None = None,
    ) -> None:
        self.base, self.executor, self.store, self.fp = base, executor, store, fingerprint
        self.settings, self.log = settings, log
        self.runner = TrialRunner(
            base, executor, store, fingerprint, label, settings, resume, log, kernels
        )
        """Runs, budgets and records the trials (the run in memory, its finished trials)."""
        self.directions = rank_directions(directions, gap_order)
        self.by_name = {d.name: d for d in self.directions}
        self.planner = planner
        """Explorers that plan each round together (the LLM agents, ``tune/agent_team.py``)."""
        self.explorers: dict[str, Proposer] = {}
        for d in self.directions:
            tpe = make_explorer(d, settings.seed, settings.explorer)
            self.explorers[d.name] = planner.explorer(d, tpe) if planner else tpe
        self.quarantined: set[str] = set()
        self._proposed: set[str] = set()
        """Directions that have proposed at least once (a probe proposes one trial first)."""

    @property
    def run_id(self) -> int:
        """This search's run in memory."""
        return self.runner.run_id

    # ------------------------------------------------------------------ helpers
    def elapsed(self) -> float:
        return self.runner.elapsed()

    def _time_left(self) -> bool:
        """True if one more chunk fits in the budget (``TrialRunner.time_left``)."""
        return self.runner.time_left()

    def _pool_round(
        self, round_: int, picked: list[Direction], best: EngineConfig, stock: bool = False
    ) -> tuple[Measured, TrialResult | None]:
        """Every picked direction's proposals around ``best`` and their results, all in one
        queue on the pool (led by the stock engine if ``stock``; then its result too)."""
        self._plan(round_, picked, best)
        plans = [(d, self.explorers[d.name].propose(best, self._trials(d))) for d in picked]
        batches = [
            Batch(round_, d.name, [self.runner.prepared(p.config) for p in props])
            for d, props in plans
        ]
        lead = [Batch(0, "stock", [self.base], force=True)] if stock else []
        got = self.runner.stream(lead + batches)
        out = [(d, props, res) for (d, props), res in zip(plans, got[len(lead) :], strict=True)]
        return out, got[0][0] if stock else None

    def _one_by_one(self, round_: int, picked: list[Direction], best: EngineConfig) -> Measured:
        """Locally: one direction after another, the budget checked before each proposes."""
        self._plan(round_, picked, best)
        for d in picked:
            if not self._time_left():
                return
            props = self.explorers[d.name].propose(best, self._trials(d))
            yield d, props, self.runner.evaluate(round_, d.name, [p.config for p in props])

    def _plan(self, round_: int, picked: list[Direction], best: EngineConfig) -> None:
        if self.planner is not None:  # its trials so far, and the budget's deadline
            rows = self.store.trials(run=self.run_id)
            self.planner.start_round(
                round_, picked, best, rows, self.runner.t0 + self.settings.budget_seconds
            )

    def _trials(self, d: Direction) -> int:
        """Trials ``d`` proposes this round: one the first time for a probe (``Direction.probe``)."""
        first = d.name not in self._proposed
        self._proposed.add(d.name)
        return 1 if d.probe and first else self.settings.trials_per_direction

    def _pick(self, round_: int, best: str) -> list[Direction]:
        n = self.settings.directions_per_round
        picked = [d for d in self.directions if d.name not in self.quarantined][:n]
        self.log(
            f"[{clock(self.elapsed())}] round {round_}: directions "
            f"{', '.join(d.name for d in picked)} (best so far {best})"
        )
        return picked

    def _warm_start(self) -> list[tuple[str, EngineConfig]]:
        """Validated configs of the most similar deployments, moved onto this one, by label."""
        out = []
        for label, _sim, row in self.store.similar_validated(self.fp):
            try:
                out.append(
                    (label, with_deployment(EngineConfig.from_dict(row["config"]), self.base))
                )
            except Exception:
                continue
        return out

    # --------------------------------------------------------------------- loop
    def run(self) -> TuneOutcome:
        self.runner.t0 = time.perf_counter()
        s = self.settings
        self.log(f"round 0: stock engine ({describe(self.base)}) and warm start")
        warm = self._warm_start()
        ahead: tuple[list[Direction], Measured] | None = None
        if self.runner.pool is not None and not warm and s.rounds >= 1 and self._time_left():
            # Round 1 proposes around the stock config, known before it is measured, and only
            # its decisions need the stock result: the stock trial leads round 1's queue.
            picked = self._pick(1, "the stock engine, measured in this round")
            first_round, first = self._pool_round(1, picked, self.base, stock=True)
            assert first is not None
            stock, ahead = first, (picked, first_round)
        else:
            stock = self.runner.evaluate(0, "stock", [self.base], force=True)[0]
        outcome = TuneOutcome(stock=stock, best=stock, ar_tok_s=self.executor.ar_tok_s)
        outcome.trials.append(self.runner.trial(0, "stock", stock))
        for label, cfg in warm:
            got = self.runner.evaluate(0, "memory", [cfg])
            if not got:
                break
            r = got[0]
            outcome.trials.append(self.runner.trial(0, "memory", r, reused_from=label))
            outcome.reused.append(f"{label}: {describe(cfg)} → {r.spread_text()} here")
            if r.eligible and r.ratio.beats(outcome.best.ratio, s.min_gain):
                confirmed = self._confirm(0, outcome, r)
                if confirmed is not None:
                    outcome.best = confirmed

        stale: dict[str, int] = {}  # rounds without a winner per direction since the last gain
        for round_ in range(1, s.rounds + 1):
            measured: Measured
            if ahead is not None and round_ == 1:
                picked, measured = ahead
            elif not self._time_left():
                self.log(f"[{clock(self.elapsed())}] time budget spent")
                break
            else:
                picked = self._pick(round_, f"{outcome.best.speedup:.2f}x")
                if self.runner.pool is None:
                    measured = self._one_by_one(round_, picked, outcome.best.config)
                else:
                    measured = self._pool_round(round_, picked, outcome.best.config)[0]
            outcome.rounds_run = round_
            winners: list[tuple[Proposal, TrialResult]] = []
            eligible: list[tuple[Proposal, TrialResult]] = []
            for d, proposals, results in measured:  # the round's decisions, direction by direction
                ex = self.explorers[d.name]
                for p, r in zip(proposals, results, strict=False):  # shorter if cut by the budget
                    ex.tell(p.trial_number, r.speedup if r.eligible else 0.0)
                    outcome.trials.append(self.runner.trial(round_, d.name, r))
                    if r.eligible:
                        eligible.append((p, r))
                    if r.eligible and r.ratio.beats(outcome.best.ratio, s.min_gain):
                        winners.append((p, r))
                if d.name.startswith("mechanism:") and any(r.rejected for r in results):
                    # One mismatch proves the mechanism is not lossless here; a later pass on other
                    # prompts would only mean the fault was not triggered. A candidate that failed
                    # to build says nothing about the others: it is reported, not quarantined.
                    self.quarantined.add(d.name)
                    winners = [w for w in winners if w[0].explorer != d.name]
                    self.log(f"  {d.name} quarantined: a candidate with it failed token forcing")
            contender = None
            if not winners and getattr(self.executor, "shares_rounds", False):
                ok = [w for w in eligible if w[0].explorer not in self.quarantined]
                contender = best_contender(ok, outcome.best, s.min_gain)
            if contender is not None:  # the head-to-head confirm below decides
                winners = [contender]
                self.log(
                    f"  {describe(contender[1].config)}: {contender[1].spread_text()} AR lies above "
                    f"the best's median ({outcome.best.spread_text()}) but inside its spread; "
                    "measuring the two head to head"
                )
            # A direction whose candidates all lost yields its slot to the next one next round,
            # so every direction gets tried within the budget, not only the top-ranked ones.
            won = {p.explorer for p, _ in winners}
            tried = [d for d in picked if d.name not in won]
            self.directions = [d for d in self.directions if d not in tried] + tried
            if not winners:
                for d in picked:
                    stale[d.name] = stale.get(d.name, 0) + 1
                left = [
                    d.name
                    for d in self.directions
                    if stale.get(d.name, 0) < s.patience and d.name not in self.quarantined
                ]
                if not left:
                    self.log(
                        f"round {round_}: no candidate beat {outcome.best.spread_text()} by more "
                        f"than the noise and every direction was tried since; stopping"
                    )
                    break
                self.log(f"round {round_}: no winner; next: {', '.join(left)}")
                continue
            if contender is None:
                stale = {}
            new_best = max(winners, key=lambda w: w[1].speedup)[1]
            derive = {name: d.derive for name, d in self.by_name.items()}
            stack = stacked(outcome.best.config, winners, derive)
            if stack is not None:  # integrate: every direction's winner stacked, re-measured
                for r in self.runner.evaluate(round_, "integrate", [stack]):
                    outcome.trials.append(self.runner.trial(round_, "integrate", r))
                    if r.eligible and r.ratio.beats(new_best.ratio):
                        new_best = r
            confirmed = self._confirm(round_, outcome, new_best, contender is None)
            if confirmed is None:
                if contender is not None:  # a round without a winner after all
                    for d in picked:
                        stale[d.name] = stale.get(d.name, 0) + 1
                continue
            stale = {}
            outcome.best = new_best = confirmed
            self.runner.validate(new_best)

        if outcome.best is stock and stock.forcing_ok:
            self.runner.validate(stock)
        seen = {t.explorer for t in outcome.trials}
        outcome.unexplored = [d.name for d in self.directions if d.name not in seen]
        if outcome.unexplored:
            self.log(
                f"not measured (the time budget ran out first): {', '.join(outcome.unexplored)}"
            )
        self.store.finish_run(self.run_id)
        outcome.wall_seconds = self.elapsed()
        outcome.device_seconds = sum(t.result.device_seconds for t in outcome.trials)
        outcome.usage = getattr(self.executor, "usage", None) or self._usage_of(outcome)
        return outcome

    def _usage_of(self, outcome: TuneOutcome) -> Usage:
        """The usage of an executor that keeps none: one worker, the trials' own seconds."""
        device = "cuda" if self.base.deployment.device.startswith("cuda") else "cpu"
        return Usage.of_results("local", device, [t.result for t in outcome.trials])

    def _confirm(
        self, round_: int, outcome: TuneOutcome, cand: TrialResult, interval_ok: bool = True
    ) -> TrialResult | None:
        """``confirm.confirm_winner`` with this loop's executor, clock and log."""
        got, seconds = confirm_winner(
            self.executor, outcome, cand, self.settings.min_gain, round_, self._time_left(),
            interval_ok, self.log, self.elapsed,
        )  # fmt: skip
        if seconds is not None:
            self.runner.chunk_seconds.append(seconds)
        return got
