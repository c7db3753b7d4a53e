"""Evaluate candidates in batched mode: a request stream served by the continuous-batching
scheduler at a fixed concurrency, measured exactly as single mode is (``tune/evaluate.py``):
warmed up, interleaved with the baseline in repeated rounds, bounded by the cost model, and
token-forced on every request's output.

The baseline is batched plain AR over the stock target on the same stream (the same scheduler
over the AR engine). The metric is total tokens of all requests over first arrival to last
finish, candidate over batched AR.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from specpilot.bench.batched import (
    BatchedRun,
    poisson_arrivals,
    request_stream,
    run_stream,
    warm_up_scheduler,
)
from specpilot.bench.protocol import Sample, timed
from specpilot.engine import AcceptanceStats, Engine, Request, Scheduler
from specpilot.engine.build import build_engine
from specpilot.engine.config import EngineConfig, resolve_segment_tokens
from specpilot.errors import SpecPilotError
from specpilot.tune.evaluate import Evaluator


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
    """The stock target, the request stream and its batched-AR baseline."""

    def __init__(
        self,
        base: EngineConfig,
        prompts: Sequence[list[int]],
        max_new_tokens: int,
        stream: BatchedStream,
        max_context: int = 8192,
        graphs: bool | None = None,
        rounds: int = 3,
    ) -> None:
        self.stream = stream
        self.segment_tokens = resolve_segment_tokens(base, None)  # the AR baseline's segment
        self.sched_context = max(len(p) for p in prompts) + max_new_tokens
        super().__init__(base, prompts, max_new_tokens, max_context, graphs, rounds)

    def _scheduler(self, engine: Engine, segment_tokens: int) -> Scheduler:
        return Scheduler(
            engine,
            slots=self.stream.concurrency,
            segment_tokens=segment_tokens,
            max_context=self.sched_context,
        )

    def make_baseline(self) -> Any:
        return self._scheduler(Engine(self.stock.model, graphs=self.graphs), self.segment_tokens)

    def make_candidate(self, config: EngineConfig) -> Any:
        target = self.stock if not config.mechanisms else None
        build = build_engine(config, self.max_context, target=target, graphs=self.graphs)
        return self._scheduler(build.engine(profile=True), resolve_segment_tokens(config, None))

    def _requests(self) -> list[Request]:
        named = [(f"p{i}", p) for i, p in enumerate(self.prompts)]
        return request_stream(named, self.stream.size, self.max_new_tokens, frozenset(self.eos_ids))

    def workload(self, engine: Any) -> Sample:
        """The whole stream (all requests arriving at once); payload: (run, phase times)."""
        sched: Scheduler = engine
        eng = sched.engine
        eng.times = type(eng.times)()

        def run() -> tuple[int, Any]:
            reqs = self._requests()
            got: BatchedRun = run_stream("spec", sched, reqs, poisson_arrivals(len(reqs), 0.0))
            return got.tokens, got

        sample = timed(self.device, run, lambda: eng.times.excluded)
        sample.payload = (sample.payload, eng.times.to_dict())
        return sample

    def warm(self, engine: Any) -> None:
        if self._runner(engine).use_graphs:
            self.workload(engine)
        else:
            warm_up_scheduler(engine, self.prompts[0], frozenset(self.eos_ids))

    def results(self, sample: Sample) -> list[tuple[str, list[int], list[int]]]:
        run, _ = sample.payload
        return [(r.id, r.prompt_ids, r.tokens) for r in run.results]

    def stats(self, sample: Sample) -> tuple[AcceptanceStats, dict[str, float]]:
        run, times = sample.payload
        return run.stats, times
