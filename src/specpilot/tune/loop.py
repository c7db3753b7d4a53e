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
budget is checked before every trial (against the median trial), and each result is written to
memory as it arrives. The loop is the memory's one writer; workers only return results.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from specpilot.bench.protocol import Ratio
from specpilot.engine.config import EngineConfig
from specpilot.memory import Fingerprint, MemoryStore
from specpilot.tune.evaluate import TrialResult
from specpilot.tune.executors import Executor, StreamingExecutor
from specpilot.tune.explorers import Proposal, Proposer, make_explorer
from specpilot.tune.space import Direction, config_hash, describe
from specpilot.tune.usage import Usage

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
    """A winner must beat the best by more than both spreads and by this fraction of it."""
    seed: int = 0
    explorer: str = "auto"
    """Knob proposer: ``tpe`` (Optuna), ``local`` (local search, no dependency), ``auto``."""
    patience: int = 1
    """Rounds a direction may go without a winner (since the last improvement) before it counts
    as exhausted; the loop stops when every direction is exhausted."""


@dataclass(slots=True)
class Trial:
    round: int
    explorer: str
    result: TrialResult
    reused_from: str | None = None
    elapsed: float = 0.0
    """Seconds since the loop started when this trial finished (0 for one reused on resume)."""


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
    unexplored: list[str] = field(default_factory=list)
    """Directions the budget ran out before (never measured), for the log and the report."""
    usage: Usage = field(default_factory=lambda: Usage("local", "cpu"))
    """Workers and the busy seconds summed over them (the executor's, ``tune/usage.py``)."""


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
        self.by_name = {d.name: d for d in self.directions}
        self.explorers: dict[str, Proposer] = {
            d.name: make_explorer(d, settings.seed, settings.explorer) for d in self.directions
        }
        self.t0 = time.perf_counter()
        self.chunk_seconds: list[float] = []
        """Seconds of every ``executor.map`` call so far (a chunk shares its AR rounds, so it
        costs about the sum of its trials); the next one starts only if a typical one fits."""
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
        todo = list(
            {config_hash(c): c for c in configs if config_hash(c) not in self.done}.values()
        )
        results: dict[str, TrialResult] = {}
        if isinstance(self.executor, StreamingExecutor):
            self._stream(self.executor, round_, explorer, todo, force, results)
        else:
            width = max(1, int(getattr(self.executor, "width", 1)))
            for i in range(0, len(todo), width):
                if not force and not self._time_left():
                    self.log(
                        f"  [{explorer}] time budget reached: {len(todo) - i} candidates not run"
                    )
                    break
                t0 = time.perf_counter()
                for r in self.executor.map(todo[i : i + width]):
                    results[config_hash(r.config)] = r
                self.chunk_seconds.append(time.perf_counter() - t0)
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

    def _stream(
        self,
        executor: StreamingExecutor,
        round_: int,
        explorer: str,
        todo: list[EngineConfig],
        force: bool,
        results: dict[str, TrialResult],
    ) -> None:
        """Hand ``todo`` to a streaming executor; each result is written to memory and logged
        as it arrives (a worker pool lost mid-chunk then loses no finished trial)."""
        by_hash = {config_hash(c): c for c in todo}

        def arrived(r: TrialResult) -> None:
            h = config_hash(r.config)
            r.config = by_hash.get(h, r.config)
            results[h] = r
            self._record(round_, explorer, r.config, r)
            self._log_trial(explorer, r.config, r)
            if r.busy_seconds > 0:
                self.chunk_seconds.append(r.busy_seconds)

        got = executor.stream(todo, admit=None if force else self._time_left, on_result=arrived)
        if len(got) < len(todo):
            self.log(
                f"  [{explorer}] time budget reached: {len(todo) - len(got)} candidates not run"
            )

    def _record(self, round_: int, explorer: str, c: EngineConfig, r: TrialResult) -> None:
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
            f"  [{_clock(self.elapsed())}] [{explorer}] {describe(c)}: {r.tok_s:.1f} tok/s, "
            f"{r.spread_text()} AR, τ {r.tau:.2f}, {r.verdict()}{where}"
        )

    # --------------------------------------------------------------------- loop
    def run(self) -> TuneOutcome:
        self.t0 = time.perf_counter()
        s = self.settings
        self.log(f"round 0: stock engine ({describe(self.base)}) and warm start")
        stock = self._evaluate(0, "stock", [self.base], force=True)[0]
        outcome = TuneOutcome(stock=stock, best=stock, ar_tok_s=self.executor.ar_tok_s)
        outcome.trials.append(Trial(0, "stock", stock, elapsed=self.elapsed()))
        for label, _sim, row in self.store.similar_validated(self.fp):
            try:
                cfg = _with_deployment(EngineConfig.from_dict(row["config"]), self.base)
            except Exception:
                continue
            got = self._evaluate(0, "memory", [cfg])
            if not got:
                break
            r = got[0]
            outcome.trials.append(Trial(0, "memory", r, reused_from=label, elapsed=self.elapsed()))
            outcome.reused.append(f"{label}: {describe(cfg)} → {r.spread_text()} here")
            if r.eligible and r.ratio.beats(outcome.best.ratio, s.min_gain):
                confirmed = self._confirm(0, outcome, r)
                if confirmed is not None:
                    outcome.best = confirmed

        stale: dict[
            str, int
        ] = {}  # rounds without a winner per direction since the last improvement
        for round_ in range(1, s.rounds + 1):
            if not self._time_left():
                self.log(f"[{_clock(self.elapsed())}] time budget spent")
                break
            outcome.rounds_run = round_
            picked = [d for d in self.directions if d.name not in self.quarantined][
                : s.directions_per_round
            ]
            self.log(
                f"[{_clock(self.elapsed())}] round {round_}: directions "
                f"{', '.join(d.name for d in picked)} (best so far {outcome.best.speedup:.2f}x)"
            )
            winners: list[tuple[Proposal, TrialResult]] = []
            for d in picked:
                if not self._time_left():
                    break
                ex = self.explorers[d.name]
                proposals = ex.propose(outcome.best.config, s.trials_per_direction)
                results = self._evaluate(round_, d.name, [p.config for p in proposals])
                for p, r in zip(proposals, results, strict=False):  # shorter if cut by the budget
                    ex.tell(p.trial_number, r.speedup if r.eligible else 0.0)
                    outcome.trials.append(Trial(round_, d.name, r, elapsed=self.elapsed()))
                    if r.eligible and r.ratio.beats(outcome.best.ratio, s.min_gain):
                        winners.append((p, r))
                if d.name.startswith("mechanism:") and any(not r.forcing_ok for r in results):
                    # One mismatch proves the mechanism is not lossless here; a later pass on other
                    # prompts would only mean the fault was not triggered.
                    self.quarantined.add(d.name)
                    winners = [w for w in winners if w[0].explorer != d.name]
                    self.log(f"  {d.name} quarantined: a candidate with it failed token forcing")
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
            stale = {}
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
                    stacked = self.by_name[p.explorer].derive(stacked, p.params)
                for r in self._evaluate(round_, "integrate", [stacked]):
                    outcome.trials.append(Trial(round_, "integrate", r, elapsed=self.elapsed()))
                    if r.eligible and r.ratio.beats(new_best.ratio):
                        new_best = r
            confirmed = self._confirm(round_, outcome, new_best)
            if confirmed is None:
                continue
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
        measured = {t.explorer for t in outcome.trials}
        outcome.unexplored = [d.name for d in self.directions if d.name not in measured]
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

    def _confirm(self, round_: int, outcome: TuneOutcome, cand: TrialResult) -> TrialResult | None:
        """A winner measured head to head with the best: both in one chunk (the same AR rounds,
        interleaved), the candidate's per-round ratio over the best must lie above 1 by more
        than the noise (and ``min_gain``). Ratios over AR measured at different times can
        differ by a few percent without either engine changing; this rules that out. Returns
        the candidate as measured here, or None. (Executors that do not share rounds across a
        chunk, e.g. Ray's actors, keep the interval rule alone.)"""
        if not getattr(self.executor, "shares_rounds", False):
            return cand
        if not self._time_left():
            self.log(f"  [confirm] no time left to confirm {describe(cand.config)}: not taken")
            return None
        best = outcome.best
        t0 = time.perf_counter()
        got = self.executor.map([best.config, cand.config])
        self.chunk_seconds.append(time.perf_counter() - t0)
        b, c = got[0], got[1]
        for r in (b, c):
            outcome.trials.append(Trial(round_, "confirm", r, elapsed=self.elapsed()))
        pair = Ratio([x / y for x, y in zip(c.rounds, b.rounds, strict=True) if y > 0])
        ok = (
            b.eligible
            and c.eligible
            and pair.beats(Ratio([1.0] * len(pair.values)), self.settings.min_gain)
        )
        self.log(
            f"  [{_clock(self.elapsed())}] [confirm] {describe(cand.config)} over the best "
            f"{describe(best.config)}, head to head: {pair.text()} → "
            + ("a winner" if ok else "not a winner (within the noise)")
        )
        if not ok:
            return None
        c.config = cand.config
        return c


def _cfg(c: EngineConfig) -> dict[str, Any]:
    import json

    return dict(json.loads(c.to_json()))


def _with_deployment(cfg: EngineConfig, base: EngineConfig) -> EngineConfig:
    """A config validated elsewhere, moved onto this deployment (knobs and mechanisms kept; an
    early-exit draft model, which needs no separate model, is kept too)."""
    import dataclasses

    dep = base.deployment
    if cfg.deployment.drafter == "draft-model" and "exit_layers" in cfg.drafter_knobs:
        dep = dataclasses.replace(dep, drafter="draft-model", draft_model=None)
    elif cfg.deployment.drafter != dep.drafter:
        raise ValueError("the remembered config uses another drafter")
    return dataclasses.replace(cfg, deployment=dep)


def _clock(seconds: float) -> str:
    return f"{int(seconds) // 60:02d}:{int(seconds) % 60:02d}"
