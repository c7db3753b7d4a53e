"""Batched serving benchmark: N requests arrive (all at once or as a Poisson stream) at a
continuous-batching scheduler; throughput over all requests and per-request latency.

AR-batched and speculative-batched runs use the same requests, the same arrival times and the
same clock (``time.perf_counter``; every step ends in a host read of the committed tokens, which
synchronises the device), so the two are counted the same way. ``measure_stream`` runs them as
arms of the interleaved protocol (``bench/protocol.py``): one warm-up round (graph captures,
allocator growth), then rounds in which both arms serve the whole stream, order alternating, and
a per-round speedup with its spread.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from specpilot.bench.protocol import Measurement, Sample, interleave
from specpilot.engine import Request, RequestResult, Scheduler
from specpilot.engine.stats import AcceptanceStats


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival times in seconds: all 0 when ``rate`` is 0, else a seeded Poisson stream."""
    if rate < 0:
        raise ValueError(f"arrival rate must be at least 0, got {rate}")
    if rate == 0:
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def request_stream(
    prompts: Sequence[tuple[str, Sequence[int]]],
    n: int,
    max_new_tokens: int,
    eos: frozenset[int],
) -> list[Request]:
    """``n`` requests cycling through ``prompts`` (id, token ids), ids ``<prompt id>#<i>``."""
    return [
        Request(
            f"{prompts[i % len(prompts)][0]}#{i}",
            tuple(prompts[i % len(prompts)][1]),
            max_new_tokens,
            eos,
        )
        for i in range(n)
    ]


def warm_up_scheduler(sched: Scheduler, prompt: Sequence[int], eos: frozenset[int]) -> None:
    """A few short requests through ``sched``, outside any timing."""
    sched.run([Request(f"warm{i}", tuple(prompt[-16:]), 8, eos) for i in range(2)])


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty sequence."""
    s = sorted(values)
    rank = max(1, min(len(s), round(q / 100 * len(s) + 0.5)))
    return s[rank - 1]


@dataclass(slots=True)
class BatchedRun:
    """One engine serving one request stream at one concurrency."""

    engine: str  # "ar" | "spec"
    concurrency: int
    results: list[RequestResult]  # in request order
    latencies: list[float]  # [N] seconds from arrival to the last token
    seconds: float  # first arrival to last finish
    steps: int
    stats: AcceptanceStats = field(default_factory=AcceptanceStats)

    @property
    def tokens(self) -> int:
        return sum(len(r.tokens) for r in self.results)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def latency(self) -> dict[str, float]:
        lat = self.latencies
        return {
            "mean": statistics.fmean(lat),
            "p50": percentile(lat, 50),
            "p99": percentile(lat, 99),
        }


def run_stream(
    engine: str,
    sched: Scheduler,
    requests: Sequence[Request],
    arrivals: Sequence[float],
    on_finish: Callable[[], None] | None = None,
) -> BatchedRun:
    """Feed ``requests`` to ``sched`` at their ``arrivals`` (seconds from now) until all finish."""
    order = sorted(range(len(requests)), key=lambda i: arrivals[i])
    index = {r.id: i for i, r in enumerate(requests)}
    finished: dict[str, tuple[RequestResult, float]] = {}
    steps0 = sched.steps
    excluded0 = sched.engine.times.excluded  # simulated acceptance's reference runs
    t0 = time.perf_counter()
    nxt = 0
    while nxt < len(order) or sched.has_work:
        now = time.perf_counter() - t0
        while nxt < len(order) and arrivals[order[nxt]] <= now:
            sched.submit(requests[order[nxt]])
            nxt += 1
        if not sched.has_work:
            time.sleep(max(0.0, arrivals[order[nxt]] - now))
            continue
        report = sched.step()
        now = time.perf_counter() - t0
        for res in report.finished:
            finished[res.id] = (res, now)
            if on_finish is not None:
                on_finish()
    seconds = time.perf_counter() - t0 - min(arrivals, default=0.0)
    seconds -= sched.engine.times.excluded - excluded0
    results = [finished[r.id][0] for r in requests]
    latencies = [finished[r.id][1] - arrivals[index[r.id]] for r in requests]
    stats = AcceptanceStats()
    for res in results:
        stats.merge(res.stats)
    return BatchedRun(
        engine=engine,
        concurrency=sched.num_slots,
        results=results,
        latencies=latencies,
        seconds=seconds,
        steps=sched.steps - steps0,
        stats=stats,
    )


def measure_stream(
    schedulers: Mapping[str, Scheduler],
    requests: Sequence[Request],
    arrivals: Sequence[float],
    rounds: int = 3,
    warmup: int = 1,
    on_finish: Callable[[], None] | None = None,
) -> Measurement:
    """Every scheduler serves the whole stream once per round (``warmup`` rounds uncounted), in
    an order that rotates from round to round; each sample's payload is its :class:`BatchedRun`.
    A scheduler is reused from round to round (its rows are all free after a run), so the
    graphs it captured in the warm-up are the ones the counted rounds replay."""

    def arm(name: str, sched: Scheduler) -> Callable[[], Sample]:
        def serve() -> Sample:
            run = run_stream(name, sched, requests, arrivals, on_finish)
            return Sample(run.tokens, run.seconds, run)

        return serve

    return interleave({n: arm(n, s) for n, s in schedulers.items()}, rounds, warmup)
