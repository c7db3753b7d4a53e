"""Evaluate one candidate in batched mode: a request stream served by the continuous-batching
scheduler at a fixed concurrency, and the token-forcing gate on every request's output.

It serves the stream the way ``bench --mode batched`` does (``bench/batched.py``: the same
requests, warm-up and ``run_stream`` clock), once through batched plain AR over the stock target
(the baseline, measured once per evaluator) and once through each candidate's scheduler, all in
one process. The metric is total tokens of all requests over first arrival to last finish,
candidate over batched AR. Every request's committed tokens are token-forced against the stock
target; one mismatch rejects the candidate, as in single mode.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from specpilot.bench.batched import (
    BatchedRun,
    poisson_arrivals,
    request_stream,
    run_stream,
    warm_up_scheduler,
)
from specpilot.bench.runner import synchronize
from specpilot.engine.batching import BatchScheduler, Request
from specpilot.engine.build import build_engine
from specpilot.engine.config import EngineConfig, resolve_segment_tokens
from specpilot.errors import SpecPilotError
from specpilot.forcing import force_tokens
from specpilot.tune.evaluate import Evaluator, TrialResult, forcing_summary


@dataclass(frozen=True, slots=True)
class BatchedStream:
    """The request stream a batched tune serves for every candidate."""

    concurrency: int = 4
    """Scheduler slots: requests decoded together."""
    requests: int | None = None
    """Requests in the stream, tuning prompts cycled (None = 2 x concurrency)."""

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise SpecPilotError(f"--concurrency must be at least 1, got {self.concurrency}.")
        if self.requests is not None and self.requests < 1:
            raise SpecPilotError(f"--requests must be at least 1, got {self.requests}.")

    @property
    def size(self) -> int:
        return self.requests or 2 * self.concurrency


class BatchedEvaluator(Evaluator):
    """Holds the stock target, the request stream and its batched-AR baseline."""

    def __init__(
        self,
        base: EngineConfig,
        prompts: Sequence[list[int]],
        max_new_tokens: int,
        stream: BatchedStream,
        max_context: int = 8192,
    ) -> None:
        self.stream = stream
        self.segment_tokens = resolve_segment_tokens(base, None)  # the AR baseline's segment
        self.sched_context = max(len(p) for p in prompts) + max_new_tokens
        super().__init__(base, prompts, max_new_tokens, max_context)

    def _requests(self) -> list[Request]:
        named = [(f"p{i}", p) for i, p in enumerate(self.prompts)]
        return request_stream(named, self.stream.size, self.max_new_tokens, frozenset(self.eos_ids))

    def _serve(self, engine: str, sched: BatchScheduler) -> BatchedRun:
        """Warm ``sched`` up, then serve the whole stream (all requests arrive at once)."""
        warm_up_scheduler(sched, self.prompts[0], frozenset(self.eos_ids))
        reqs = self._requests()
        run = run_stream(engine, sched, reqs, poisson_arrivals(len(reqs), 0.0))
        synchronize(self.device)
        return run

    def _measure_ar(self) -> float:
        """Batched plain AR over the stock target (no mechanism touches it): the baseline."""
        sched = BatchScheduler(
            self.stock.model,
            slots=self.stream.concurrency,
            segment_tokens=self.segment_tokens,
            max_context=self.sched_context,
        )
        return self._serve("ar", sched).tok_s

    def evaluate(self, config: EngineConfig) -> TrialResult:
        t0 = time.perf_counter()
        target = self.stock if not config.mechanisms else None
        try:
            build = build_engine(config, self.max_context, target=target)
            sched = build.scheduler(
                self.stream.concurrency,
                resolve_segment_tokens(config, None),
                self.sched_context,
            )
        except Exception as e:  # a candidate that cannot be built is a failed trial, not a crash
            return self._failed(config, f"{type(e).__name__}: {e}", t0)
        run = self._serve("spec", sched)
        report = force_tokens(
            self.stock.model, [(r.id, r.prompt_ids, r.tokens) for r in run.results]
        )
        wall = time.perf_counter() - t0
        return TrialResult(
            config=config,
            tok_s=run.tok_s,
            speedup=run.tok_s / self.ar_tok_s,
            tau=run.stats.mean_accepted_len,
            acceptance=run.stats.acceptance_rates(),
            forcing_ok=report.ok,
            forcing=forcing_summary(report),
            device_seconds=wall if self.device.type == "cuda" else 0.0,
            wall_seconds=wall,
        )
