"""A search run's trials: evaluated on the executor within the time budget, recorded in memory.

:class:`TrialRunner` is what the search loop (``tune/loop.py``) measures through. It owns the run
in memory (its deployment, its id, the trials finished so far: a resumed run reuses them, never
re-runs them) and the wall-clock budget. The budget is checked before every chunk of candidates
(they share AR rounds): a chunk is started only if the time left covers the median chunk so far,
and only if the build estimates say its engines can be built in it. A streaming executor (Ray's,
``tune/ray_executor.py``) gets trials one by one through ``tune/dispatch.py``: there the budget is
checked before every trial, and each result is written to memory as it arrives. The runner is
the memory's one writer of trials; workers only return results.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from specpilot.engine.config import EngineConfig
from specpilot.memory import Fingerprint, MemoryStore
from specpilot.tune.build_estimate import BuildEstimates
from specpilot.tune.confirm import clock
from specpilot.tune.dispatch import Batch, stream_batches
from specpilot.tune.evaluate import TrialResult
from specpilot.tune.executors import Executor, StreamingExecutor
from specpilot.tune.outcome import Trial, TuneSettings
from specpilot.tune.space import config_hash, describe


class TrialRunner:
    def __init__(
        self,
        base: EngineConfig,
        executor: Executor,
        store: MemoryStore,
        fingerprint: Fingerprint,
        label: str,
        settings: TuneSettings,
        resume: bool = False,
        log: Callable[[str], None] = print,
        kernels: dict[str, Any] | None = None,
    ) -> None:
        self.executor, self.store, self.settings, self.log = executor, store, settings, log
        self.pool = executor if isinstance(executor, StreamingExecutor) else None
        """The executor, if it streams results to a pool's idle workers (one queue a round)."""
        self.t0 = time.perf_counter()
        self.chunk_seconds: list[float] = []
        """Seconds of every ``executor.map`` call so far (a chunk shares its AR rounds, so it
        costs about the sum of its trials); the next one starts only if a typical one fits."""
        self.finished: dict[str, float] = {}
        """Loop seconds at which each streamed trial came back, by config hash."""
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

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def time_left(self) -> bool:
        """True if one more chunk, as long as the median chunk so far, fits in the budget. (The
        slowest chunk would be safer but lets one slow direction, a draft model, starve every
        later one; an overrun is at most the slowest less the median, and the final compare
        fits itself into what is left.)"""
        typical = statistics.median(self.chunk_seconds) if self.chunk_seconds else 0.0
        return self.elapsed() + typical <= self.settings.budget_seconds

    def evaluate(
        self, round_: int, explorer: str, configs: Sequence[EngineConfig], force: bool = False
    ) -> list[TrialResult]:
        """Evaluate configs not already finished in this run; record each as it comes back.

        Configs are sent in chunks of the executor's width (or one by one to a streaming
        executor); before each chunk (trial) the budget is checked (unless ``force``), so the
        result may be shorter than ``configs``."""
        configs = [self.prepared(c) for c in configs]
        if self.pool is not None:
            return self.stream([Batch(round_, explorer, list(configs), force)])[0]
        todo = list(
            {config_hash(c): c for c in configs if config_hash(c) not in self.done}.values()
        )
        results: dict[str, TrialResult] = {}
        width = max(1, int(getattr(self.executor, "width", 1)))
        for i in range(0, len(todo), width):
            if not force and not self.time_left():
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

    def stream(self, batches: list[Batch]) -> list[list[TrialResult]]:
        """Run the batches on the pool as one queue (``tune/dispatch.py``); each result is
        written to memory and logged as it arrives (a pool lost mid-round loses no finished
        trial). Per batch, its results as ``evaluate`` gives them."""
        assert self.pool is not None

        def arrived(b: Batch, r: TrialResult) -> None:
            self._record(b.round, b.explorer, r.config, r)
            self._log_trial(b.explorer, r.config, r)
            self.finished[config_hash(r.config)] = self.elapsed()
            if r.busy_seconds > 0:
                self.chunk_seconds.append(r.busy_seconds)

        stream_batches(self.pool, batches, self.done, self.time_left, arrived)
        for b in batches:
            if b.not_run:
                self.log(f"  [{b.explorer}] time budget reached: {b.not_run} candidates not run")
        return [self._collect(b.round, b.explorer, b.configs, b.ran) for b in batches]

    def trial(self, round_: int, explorer: str, r: TrialResult, **kw: Any) -> Trial:
        """A trial for the outcome, stamped when it came back (streamed) or now."""
        at = self.finished.get(config_hash(r.config), self.elapsed())
        return Trial(round_, explorer, r, elapsed=at, **kw)

    def prepared(self, c: EngineConfig) -> EngineConfig:
        """``c`` with the kernel search's tilings if it runs W12's tensor-core kernel."""
        w12 = c.mechanisms.get("w12")
        if self.kernels is None or w12 is None or w12.get("kernel") != "mma":
            return c
        return dataclasses.replace(c, kernels=self.kernels)

    def validate(self, r: TrialResult) -> None:
        """Mark ``r``'s config (a finished trial of this run) validated for the deployment."""
        h = config_hash(r.config)
        self.store.validate(self.deployment, h, _cfg(r.config), r.speedup, self.done[h].id)

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


def _cfg(c: EngineConfig) -> dict[str, Any]:
    return dict(json.loads(c.to_json()))
