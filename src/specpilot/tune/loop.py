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
Stop at the round or time budget, or after a round that improves nothing. The time budget is a
wall-clock deadline checked before every chunk of candidates (they share AR rounds): a chunk is
started only if the time left covers the median chunk so far, so the last round is cut short
cleanly (its finished candidates are still integrated) instead of overrunning. A streaming
executor (Ray's, ``tune/ray_executor.py``) hands trials to its workers one by one: there the
budget is checked before every trial (against the median trial), each result is written to
memory as it arrives, and a round's candidates of all its directions go to the workers as one
queue (``tune/dispatch.py``); the round's decisions wait for all of them, so the search is the
same as one direction after another. Without a warm start the stock trial joins round 1's queue
(round 1 proposes around the stock config, known before it is measured). The loop is the
memory's one writer; workers only return results.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from specpilot.engine.config import EngineConfig
from specpilot.memory import Fingerprint, MemoryStore
from specpilot.tune.build_estimate import BuildEstimates
from specpilot.tune.confirm import best_contender, clock, confirm_winner
from specpilot.tune.dispatch import Batch, stream_batches
from specpilot.tune.evaluate import TrialResult
from specpilot.tune.executors import Executor, StreamingExecutor
from specpilot.tune.explorers import Proposal, Proposer, make_explorer
from specpilot.tune.integrate import stacked
from specpilot.tune.outcome import Trial, TuneOutcome, TuneSettings
from specpilot.tune.proposal import RoundPlanner
from specpilot.tune.space import (
    STATIC_GAP_ORDER,
    Direction,
    config_hash,
    describe,
    rank_directions,
    with_deployment,
)
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
        self.pool = executor if isinstance(executor, StreamingExecutor) else None
        """The executor, if it streams results to a pool's idle workers (one queue a round)."""
        self.settings, self.log = settings, log
        self.directions = rank_directions(directions, gap_order)
        self.by_name = {d.name: d for d in self.directions}
        self.planner = planner
        """Explorers that plan each round together (the LLM agents, ``tune/agent_team.py``)."""
        self.explorers: dict[str, Proposer] = {}
        for d in self.directions:
            tpe = make_explorer(d, settings.seed, settings.explorer)
            self.explorers[d.name] = planner.explorer(d, tpe) if planner else tpe
        self.t0 = time.perf_counter()
        self.chunk_seconds: list[float] = []
        """Seconds of every ``executor.map`` call so far (a chunk shares its AR rounds, so it
        costs about the sum of its trials); the next one starts only if a typical one fits."""
        self.finished: dict[str, float] = {}
        """Loop seconds at which each streamed trial came back, by config hash."""
        self.quarantined: set[str] = set()
        self._proposed: set[str] = set()
        """Directions that have proposed at least once (a probe proposes one trial first)."""
        self.kernels = kernels
        """The kernel search's tilings (``EngineConfig.kernels``), given to every candidate that
        runs W12's tensor-core kernel."""
        self.deployment = store.add_deployment(fingerprint, label)
        self.builds = BuildEstimates(
            (t.config, t.wall_seconds) for t in store.trials(deployment=self.deployment)
        )
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
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def _time_left(self) -> bool:
        """True if one more chunk, as long as the median chunk so far, fits in the budget. (The
        slowest chunk would be safer but lets one slow direction, a draft model, starve every
        later one; an overrun is at most the slowest less the median, and the final compare
        fits itself into what is left.)"""
        typical = statistics.median(self.chunk_seconds) if self.chunk_seconds else 0.0
        return self.elapsed() + typical <= self.settings.budget_seconds

    def _evaluate(
        self, round_: int, explorer: str, configs: Sequence[EngineConfig], force: bool = False
    ) -> list[TrialResult]:
        """Evaluate configs not already finished in this run; record each as it comes back.

        Configs are sent in chunks of the executor's width (or one by one to a streaming
        executor); before each chunk (trial) the budget is checked (unless ``force``), so the
        result may be shorter than ``configs``."""
        configs = [self._prepared(c) for c in configs]
        if self.pool is not None:
            return self._stream([Batch(round_, explorer, list(configs), force)])[0]
        todo = list(
            {config_hash(c): c for c in configs if config_hash(c) not in self.done}.values()
        )
        results: dict[str, TrialResult] = {}
        width = max(1, int(getattr(self.executor, "width", 1)))
        for i in range(0, len(todo), width):
            if not force and not self._time_left():
                self.log(f"  [{explorer}] time budget reached: {len(todo) - i} candidates not run")
                break
            left = self.settings.budget_seconds - self.elapsed()
            fits, why = self.builds.fits(todo[i : i + width], left)
            if not force and not fits:
                self.log(f"  [{explorer}] not started: {why}; {len(todo) - i} candidates not run")
                break
            t0 = time.perf_counter()
            for r in self.executor.map(todo[i : i + width]):
                results[config_hash(r.config)] = r
            self.chunk_seconds.append(time.perf_counter() - t0)
        return self._collect(round_, explorer, configs, results)

    def _collect(
        self,
        round_: int,
        explorer: str,
        configs: Sequence[EngineConfig],
        results: dict[str, TrialResult],
    ) -> list[TrialResult]:
        """The results of ``configs`` in order (read from memory if finished earlier), up to the
        first one the budget cut; each new one is recorded and logged unless it was on arrival."""
        out = []
        for c in configs:
            h = config_hash(c)
            if h in results:
                r = results[h]
                if h not in self.done:  # a streamed result is recorded (and logged) on arrival
                    self._record(round_, explorer, c, r)
                    self._log_trial(explorer, c, r)
            elif h in self.done:
                r = TrialResult.from_row(c, self.done[h])
                self._log_trial(explorer, c, r)
            else:  # cut by the budget
                break
            out.append(r)
        return out

    def _stream(self, batches: list[Batch]) -> list[list[TrialResult]]:
        """Run the batches on the pool as one queue (``tune/dispatch.py``); each result is
        written to memory and logged as it arrives (a pool lost mid-round loses no finished
        trial). Per batch, its results as ``_evaluate`` gives them."""
        assert self.pool is not None

        def arrived(b: Batch, r: TrialResult) -> None:
            self._record(b.round, b.explorer, r.config, r)
            self._log_trial(b.explorer, r.config, r)
            self.finished[config_hash(r.config)] = self.elapsed()
            if r.busy_seconds > 0:
                self.chunk_seconds.append(r.busy_seconds)

        stream_batches(self.pool, batches, self.done, self._time_left, arrived)
        for b in batches:
            if b.not_run:
                self.log(f"  [{b.explorer}] time budget reached: {b.not_run} candidates not run")
        return [self._collect(b.round, b.explorer, b.configs, b.ran) for b in batches]

    def _pool_round(
        self, round_: int, picked: list[Direction], best: EngineConfig, stock: bool = False
    ) -> tuple[Measured, TrialResult | None]:
        """Every picked direction's proposals around ``best`` and their results, all in one
        queue on the pool (led by the stock engine if ``stock``; then its result too)."""
        self._plan(round_, picked, best)
        plans = [(d, self.explorers[d.name].propose(best, self._trials(d))) for d in picked]
        batches = [
            Batch(round_, d.name, [self._prepared(p.config) for p in props]) for d, props in plans
        ]
        lead = [Batch(0, "stock", [self.base], force=True)] if stock else []
        got = self._stream(lead + batches)
        out = [(d, props, res) for (d, props), res in zip(plans, got[len(lead) :], strict=True)]
        return out, got[0][0] if stock else None

    def _one_by_one(self, round_: int, picked: list[Direction], best: EngineConfig) -> Measured:
        """Locally: one direction after another, the budget checked before each proposes."""
        self._plan(round_, picked, best)
        for d in picked:
            if not self._time_left():
                return
            props = self.explorers[d.name].propose(best, self._trials(d))
            yield d, props, self._evaluate(round_, d.name, [p.config for p in props])

    def _plan(self, round_: int, picked: list[Direction], best: EngineConfig) -> None:
        if self.planner is not None:  # its trials so far, and the budget's deadline
            rows = self.store.trials(run=self.run_id)
            self.planner.start_round(
                round_, picked, best, rows, self.t0 + self.settings.budget_seconds
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

    def _trial(self, round_: int, explorer: str, r: TrialResult, **kw: Any) -> Trial:
        """A trial for the outcome, stamped when it came back (streamed) or now."""
        at = self.finished.get(config_hash(r.config), self.elapsed())
        return Trial(round_, explorer, r, elapsed=at, **kw)

    def _prepared(self, c: EngineConfig) -> EngineConfig:
        """``c`` with the kernel search's tilings if it runs W12's tensor-core kernel."""
        w12 = c.mechanisms.get("w12")
        if self.kernels is None or w12 is None or w12.get("kernel") != "mma":
            return c
        return dataclasses.replace(c, kernels=self.kernels)

    def _record(self, round_: int, explorer: str, c: EngineConfig, r: TrialResult) -> None:
        self.builds.record(c, r.wall_seconds)
        h = config_hash(c)
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

    def _log_trial(self, explorer: str, c: EngineConfig, r: TrialResult) -> None:
        where = f" (on {r.worker})" if r.worker != "local" else ""
        self.log(
            f"  [{clock(self.elapsed())}] [{explorer}] {describe(c)}: {r.tok_s:.1f} tok/s, "
            f"{r.spread_text()} AR, τ {r.tau:.2f}, {r.verdict()}{where}"
        )

    # --------------------------------------------------------------------- loop
    def run(self) -> TuneOutcome:
        self.t0 = time.perf_counter()
        s = self.settings
        self.log(f"round 0: stock engine ({describe(self.base)}) and warm start")
        warm = self._warm_start()
        ahead: tuple[list[Direction], Measured] | None = None
        if self.pool is not None and not warm and s.rounds >= 1 and self._time_left():
            # Round 1 proposes around the stock config, known before it is measured, and only
            # its decisions need the stock result: the stock trial leads round 1's queue.
            picked = self._pick(1, "the stock engine, measured in this round")
            first_round, first = self._pool_round(1, picked, self.base, stock=True)
            assert first is not None
            stock, ahead = first, (picked, first_round)
        else:
            stock = self._evaluate(0, "stock", [self.base], force=True)[0]
        outcome = TuneOutcome(stock=stock, best=stock, ar_tok_s=self.executor.ar_tok_s)
        outcome.trials.append(self._trial(0, "stock", stock))
        for label, cfg in warm:
            got = self._evaluate(0, "memory", [cfg])
            if not got:
                break
            r = got[0]
            outcome.trials.append(self._trial(0, "memory", r, reused_from=label))
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
                if self.pool is None:
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
                    outcome.trials.append(self._trial(round_, d.name, r))
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
                for r in self._evaluate(round_, "integrate", [stack]):
                    outcome.trials.append(self._trial(round_, "integrate", r))
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
            self.chunk_seconds.append(seconds)
        return got


def _cfg(c: EngineConfig) -> dict[str, Any]:
    import json

    return dict(json.loads(c.to_json()))
