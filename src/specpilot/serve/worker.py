"""One thread owns the engine's scheduler and runs continuous batching; tokens stream out.

The HTTP side is asyncio; the engine is synchronous PyTorch. Each job carries a thread-safe
channel back to its request (``loop.call_soon_threadsafe``) and a cancel flag. Between scheduler
steps the thread takes new jobs (they join the running batch as rows free up), drops cancelled
ones (a client that disconnects frees its row at the next step) and runs background audits.
Concurrent requests share every target forward; each one's tokens are still exactly its own
single-request output (``engine/scheduler.py``).

The scheduler comes from the composition root (``EngineBuild.scheduler``), so the server runs
whatever plan and mechanisms the engine config enables, on CUDA graphs by default on CUDA. A step
that raises fails the requests in flight; the worker then re-opens the rows of the *same* engine
(``Scheduler(engine, ...)``), so no second copy of the KV cache or the graphs is ever made.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import queue
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from specpilot.engine import Request, RequestResult, Scheduler
from specpilot.engine.logprobs import TokenLogprob
from specpilot.forcing import force_tokens
from specpilot.loading import TextTokenizer
from specpilot.serve.detok import IncrementalDetokenizer
from specpilot.serve.metrics import ServerMetrics


@dataclass(slots=True)
class Job:
    prompt_ids: list[int]
    max_new_tokens: int
    stops: list[str]
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue[Any]
    """Receives ``("delta", (text, logprobs))`` (streamed jobs only), then ``("done", Outcome)`` or
    ``("error", message)``."""
    stream: bool = True
    """Send the text as it comes (``delta``); a plain request only needs the outcome."""
    logprobs: int | None = None
    """None, or the alternatives per token (``Request.logprobs``); deltas then carry them."""
    draft_cap: int | None = None
    """``Request.draft_cap``: speed only."""
    cancelled: threading.Event = field(default_factory=threading.Event)
    cancel_step: int | None = None
    """The worker's step count when the client went away (set by ``EngineWorker.cancel``)."""
    submitted: float = field(default_factory=time.perf_counter)
    """When the job was made (just before ``EngineWorker.submit``): time to first token's zero."""

    def send(self, item: tuple[str, Any]) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, item)


@dataclass(slots=True)
class Outcome:
    text: str
    tokens: list[int]
    finish_reason: str  # "stop" | "length"
    seconds: float
    logprobs: list[TokenLogprob] = field(default_factory=list)
    unsent: list[TokenLogprob] = field(default_factory=list)
    """The logprobs no streamed delta carried (the last chunk carries them)."""


@dataclass(slots=True)
class _Stream:
    """A running job's text so far: decodes committed tokens incrementally (a few per step,
    ``serve/detok.py``), cuts at stop strings, sends what is safe to show."""

    job: Job
    request: Request
    detok: IncrementalDetokenizer
    started: float = field(default_factory=time.perf_counter)
    shown: list[str] = field(default_factory=list)
    """The text sent (or, for a plain job, kept for the outcome), in pieces."""
    pending: str = ""
    """Decoded text held back: it may be the start of a stop string."""
    stopped_by_string: bool = False
    unsent: list[TokenLogprob] = field(default_factory=list)
    """Logprobs of tokens whose text is not shown yet (sent with the next delta)."""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    first_token_at: float | None = None
    first_text_at: float | None = None

    def _add(self, new: str, final: bool) -> None:
        """Show ``new`` up to a stop string; hold back a tail that could begin one."""
        if self.stopped_by_string or not (new or final):
            return
        text, stops = self.pending + new, self.job.stops
        # a stop string ends in ``new``: ``pending`` holds the longest stop string's length
        # minus one of what came before, so it starts inside ``text``
        cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
        if cuts:
            text, self.stopped_by_string, final = text[: min(cuts)], True, True
        keep = 0 if final or not stops else max(len(s) for s in stops) - 1
        self._show(text[: len(text) - keep])
        self.pending = text[len(text) - keep :]

    def _show(self, text: str) -> None:
        if text:
            if self.first_text_at is None:
                self.first_text_at = time.perf_counter()
            self.shown.append(text)
            if self.job.stream:
                self.job.send(("delta", (text, self.unsent)))
                self.unsent = []

    def feed(self, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> bool:
        """Stream what is safe to show; True when a stop string appeared (the job is done)."""
        if tokens and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        if logprobs:
            self.unsent = self.unsent + logprobs
            self.logprobs.extend(logprobs)
        self._add(self.detok.push(tokens), final=False)
        return self.stopped_by_string

    def finish(self, stop_reason: str) -> Outcome:
        self._add(self.detok.flush(), final=True)
        reason = "stop" if stop_reason == "eos" or self.stopped_by_string else "length"
        seconds = time.perf_counter() - self.started
        tokens = list(self.detok.ids)
        text = "".join(self.shown)
        return Outcome(text, tokens, reason, seconds, list(self.logprobs), self.unsent)


class EngineWorker:
    """The engine thread: owns ``scheduler`` (its engine's rows) from ``start`` to ``stop``."""

    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer: TextTokenizer,
        eos_ids: tuple[int, ...],
        metrics: ServerMetrics,
        audit_rate: float = 0.0,
        seed: int = 0,
    ) -> None:
        self.scheduler = scheduler
        """Continuous batching over the engine's rows; only the engine thread touches it."""
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.metrics = metrics
        self.audit_rate = audit_rate
        self._rng = random.Random(seed)
        self._ids = itertools.count()
        self._jobs: queue.Queue[Job | Callable[[], None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="specpilot-engine", daemon=True)
        self._stopping = threading.Event()
        self._live: dict[str, _Stream] = {}
        self.restarts = 0
        """Times a failed step made the worker re-open the engine's rows."""
        self.steps = 0
        """Scheduler steps run (written by the engine thread only)."""

    @property
    def max_context(self) -> int:
        """Longest prompt + max_tokens one request may ask for."""
        return self.scheduler.max_context

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        if self._stopping.is_set():
            raise RuntimeError("the server is shutting down")
        self._jobs.put(job)
        self.metrics.submitted.inc()
        self.metrics.queue_depth.set(self._jobs.qsize())

    def cancel(self, job: Job) -> None:
        """The client went away: its row is freed before the next step starts (any thread).
        A job that already finished is left as it is."""
        if not job.cancelled.is_set():
            job.cancel_step = self.steps
            job.cancelled.set()

    def stop(self, timeout: float = 30.0) -> None:
        """Refuse new jobs, cancel queued ones, let the running ones finish (or time out)."""
        self._stopping.set()
        while True:
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Job):
                item.send(("error", "the server is shutting down"))
                self.metrics.failed.inc()
        self._jobs.put(None)
        self._thread.join(timeout)

    def _reopen(self) -> Scheduler:
        """A fresh scheduler over the same engine: its rows re-opened (every buffer and graph
        is reused, nothing is allocated again), nothing of the failed step left in them."""
        old = self.scheduler
        self.scheduler = Scheduler(
            old.engine,
            slots=old.num_slots,
            segment_tokens=old.segment_tokens,
            max_context=old.max_context,
            window=old.window,
            lookahead=old.lookahead,
        )
        self.restarts += 1
        return self.scheduler

    def _run(self) -> None:
        device = self.scheduler.engine.device
        if device.type == "cuda":  # the current device is per thread
            torch.cuda.set_device(device)
        sched = self.scheduler
        stopping = False
        busy_since: float | None = None  # engine-thread clock while it has work
        while True:
            if stopping and not sched.has_work:
                return
            block = not (sched.has_work or stopping)
            if block and busy_since is not None:
                self.metrics.host_seconds.inc(time.perf_counter() - busy_since)
                busy_since = None
            stopping = self._take_jobs(sched, block=block) or stopping
            if busy_since is None:
                busy_since = time.perf_counter()
            if stopping:  # shutdown: queued requests are cancelled, running ones finish
                for rid in sched.waiting_ids:
                    sched.cancel(rid)
                    self._live.pop(rid).job.send(("error", "the server is shutting down"))
                    self.metrics.failed.inc()
            for rid, stream in list(self._live.items()):
                if stream.job.cancelled.is_set():
                    sched.cancel(rid)
                    del self._live[rid]
                    self._count_cancel(stream.job)
            self.metrics.queue_depth.set(self._jobs.qsize() + sched.waiting)
            if not sched.has_work:
                continue
            t0 = time.perf_counter()
            self.metrics.step_rows.observe(sched.running)
            try:
                report = sched.step(functools.partial(self._admittable, sched))
            except Exception as e:  # the running requests fail; the worker lives on
                sched = self._recover(sched, f"generation failed: {e}")
                continue
            t1 = time.perf_counter()
            self.metrics.step_seconds.inc(t1 - t0)
            if report.rows_prefilling:
                self.metrics.prefill_step_seconds.observe(t1 - t0)
                self.metrics.prefill_rows.observe(report.rows_prefilling)
                self.metrics.prefill_forwards.inc(report.prefill_forwards)
            self.metrics.host_seconds.inc(t0 - busy_since)
            busy_since = t1
            self.steps += 1
            for rid, tokens in report.committed:
                live = self._live.get(rid)  # gone if a stop string ended it earlier this step
                if live is None:
                    continue
                firsts = live.first_token_at, live.first_text_at
                stopped = live.feed(tokens, report.logprobs.pop(rid, None))
                self._observe_firsts(live, firsts)
                if stopped:  # a stop string: no more tokens
                    result = sched.cancel(rid)  # None if it also finished in this step
                    if result is not None:
                        self._done(result)
            for result in report.finished:
                self._done(result)

    def _admittable(self, sched: Scheduler) -> bool:
        """A queued job could take a row now (asked between the AR steps of a window)."""
        return not self._jobs.empty() and sched.running < sched.num_slots

    def _recover(self, sched: Scheduler, message: str) -> Scheduler:
        """After a failed step: every request in a row gets ``message``; the rows of the same
        engine are re-opened and the requests still waiting keep their place in the queue."""
        waiting = sched.waiting_ids
        queued = set(waiting)
        for rid in [r for r in self._live if r not in queued]:
            self._live.pop(rid).job.send(("error", message))
            self.metrics.failed.inc()
        sched = self._reopen()
        for rid in waiting:
            sched.submit(self._live[rid].request)
        return sched

    def _take_jobs(self, sched: Scheduler, block: bool) -> bool:
        """Move queued jobs into the scheduler and run queued audits; True on the stop sentinel."""
        while True:
            try:
                item = self._jobs.get(block=block)
            except queue.Empty:
                return False
            block = False
            if item is None:
                return True
            if not isinstance(item, Job):
                item()  # a background audit
                continue
            if item.cancelled.is_set():  # gone while queued
                self._count_cancel(item)
                continue
            rid = f"job-{next(self._ids)}"
            stop = frozenset(self.eos_ids)
            request = Request(
                rid,
                tuple(item.prompt_ids),
                item.max_new_tokens,
                stop,
                draft_cap=item.draft_cap,
                logprobs=item.logprobs,
            )
            try:
                sched.submit(request)
            except Exception as e:  # check_fits: the app checks first, so this is rare
                item.send(("error", f"generation failed: {e}"))
                self.metrics.failed.inc()
                continue
            self._live[rid] = _Stream(item, request, IncrementalDetokenizer(self.tokenizer))

    def _count_cancel(self, job: Job) -> None:
        self.metrics.cancelled.inc()
        if job.cancel_step is not None:
            self.metrics.cancel_delay_steps.observe(max(0, self.steps - job.cancel_step))

    def _observe_firsts(self, live: _Stream, before: tuple[float | None, float | None]) -> None:
        """Time to first token / text, once each, when ``live`` just reached them."""
        zero = live.job.submitted
        if before[0] is None and live.first_token_at is not None:
            self.metrics.time_to_first_token.observe(live.first_token_at - zero)
        if before[1] is None and live.first_text_at is not None:
            self.metrics.time_to_first_text.observe(live.first_text_at - zero)

    def _done(self, result: RequestResult) -> None:
        stream = self._live.pop(result.id)
        firsts = stream.first_token_at, stream.first_text_at
        outcome = stream.finish(result.stop_reason)
        self._observe_firsts(stream, firsts)
        self.metrics.observe(result.stats)
        self.metrics.tokens.inc(len(outcome.tokens))
        self.metrics.requests.inc()
        self.metrics.seconds.inc(outcome.seconds)
        stream.job.send(("done", outcome))
        if self.audit_rate > 0 and self._rng.random() < self.audit_rate:
            self._jobs.put(functools.partial(self._audit, stream.job, outcome))

    def _audit(self, job: Job, outcome: Outcome) -> None:
        report = force_tokens(
            self.scheduler.engine.target, [("audit", job.prompt_ids, outcome.tokens)]
        )
        self.metrics.audit_matches.inc(report.matches)
        self.metrics.audit_near_ties.inc(report.near_ties)
        self.metrics.audit_mismatches.inc(report.mismatches)
        self.metrics.audited.inc()
