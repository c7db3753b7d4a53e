"""One thread owns the engine: requests queue up and run one at a time, streaming tokens out.

The HTTP side is asyncio; the engine is synchronous PyTorch. Each job carries a thread-safe
channel back to its request (``loop.call_soon_threadsafe``) and a cancel flag, checked at every
commit, so a client that disconnects stops its generation at the next cycle. Continuous batching
(requests joining a running batch) replaces this worker in the batched serving mode.
"""

from __future__ import annotations

import asyncio
import functools
import queue
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from specpilot.engine import SpecEngine
from specpilot.forcing import force_tokens
from specpilot.loading import TextTokenizer
from specpilot.serve.metrics import ServerMetrics


class Cancelled(Exception):
    """Raised inside the engine's commit callback to abandon a job."""


@dataclass(slots=True)
class Job:
    prompt_ids: list[int]
    max_new_tokens: int
    stops: list[str]
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue[Any]
    """Receives ``("delta", text)``, then ``("done", Outcome)`` or ``("error", message)``."""
    cancelled: threading.Event = field(default_factory=threading.Event)

    def send(self, item: tuple[str, Any]) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, item)


@dataclass(slots=True)
class Outcome:
    text: str
    tokens: list[int]
    finish_reason: str  # "stop" | "length"
    seconds: float


class EngineWorker:
    def __init__(
        self,
        engine: SpecEngine,
        tokenizer: TextTokenizer,
        eos_ids: tuple[int, ...],
        metrics: ServerMetrics,
        audit_rate: float = 0.0,
        seed: int = 0,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.metrics = metrics
        self.audit_rate = audit_rate
        self._rng = random.Random(seed)
        self._jobs: queue.Queue[Job | Callable[[], None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="specpilot-engine", daemon=True)
        self._stopping = threading.Event()

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        if self._stopping.is_set():
            raise RuntimeError("the server is shutting down")
        self._jobs.put(job)
        self.metrics.queue_depth.set(self._jobs.qsize())

    def stop(self, timeout: float = 30.0) -> None:
        """Refuse new jobs, cancel queued ones, let the running one finish (or time out)."""
        self._stopping.set()
        while True:
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Job):
                item.send(("error", "the server is shutting down"))
        self._jobs.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            self.metrics.queue_depth.set(self._jobs.qsize())
            if item is None:
                return
            if not isinstance(item, Job):
                item()  # a background audit
                continue
            if item.cancelled.is_set():
                continue
            try:
                outcome = self._generate(item)
            except Cancelled:
                self.metrics.cancelled.inc()
                continue
            except Exception as e:  # report to the client; the worker lives on
                item.send(("error", f"generation failed: {e}"))
                continue
            item.send(("done", outcome))
            if self.audit_rate > 0 and self._rng.random() < self.audit_rate:
                self._jobs.put(functools.partial(self._audit, item, outcome))

    def _generate(self, job: Job) -> Outcome:
        tok = self.tokenizer
        committed: list[int] = []
        sent = ""
        stopped_by_string = False

        def on_commit(_row: int, tokens: list[int]) -> None:
            nonlocal sent, stopped_by_string
            if job.cancelled.is_set():
                raise Cancelled
            committed.extend(tokens)
            text = tok.decode(committed, skip_special_tokens=True)
            for s in job.stops:
                cut = text.find(s)
                if cut >= 0:
                    text, stopped_by_string = text[:cut], True
            # hold back a possibly incomplete multi-byte character or a partial stop string
            safe = text if stopped_by_string else text.rstrip("\ufffd")
            if job.stops and not stopped_by_string:
                longest = max(len(s) for s in job.stops)
                safe = safe[: max(len(sent), len(safe) - longest + 1)]
            if len(safe) > len(sent) and safe.startswith(sent):
                job.send(("delta", safe[len(sent) :]))
                sent = safe
            if stopped_by_string:
                raise _StopString

        t0 = time.perf_counter()
        try:
            res = self.engine.generate(
                [job.prompt_ids], job.max_new_tokens, self.eos_ids, on_commit
            )[0]
            tokens, reason = res.tokens, ("stop" if res.stop_reason == "eos" else "length")
            self.metrics.observe(res.stats)
        except _StopString:
            tokens, reason = committed, "stop"
        seconds = time.perf_counter() - t0
        text = tok.decode(tokens, skip_special_tokens=True)
        for s in job.stops:
            cut = text.find(s)
            if cut >= 0:
                text = text[:cut]
        if len(text) > len(sent) and text.startswith(sent):
            job.send(("delta", text[len(sent) :]))
        self.metrics.tokens.inc(len(tokens))
        self.metrics.requests.inc()
        self.metrics.seconds.inc(seconds)
        return Outcome(text=text, tokens=tokens, finish_reason=reason, seconds=seconds)

    def _audit(self, job: Job, outcome: Outcome) -> None:
        report = force_tokens(self.engine.target, [("audit", job.prompt_ids, outcome.tokens)])
        self.metrics.audit_matches.inc(report.matches)
        self.metrics.audit_near_ties.inc(report.near_ties)
        self.metrics.audit_mismatches.inc(report.mismatches)
        self.metrics.audited.inc()


class _StopString(Exception):
    """A stop string appeared: end the generation early (no more tokens are needed)."""
