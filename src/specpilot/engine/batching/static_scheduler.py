"""Continuous batching on the static (CUDA-graph) engine: requests take rows of a running
:class:`~specpilot.engine.static_engine.StaticEngine` as earlier ones leave.

Per step:

1. **admit** — waiting requests take the free rows: their prompts are prefilled together, in one
   batched eager forward (``StaticEngine.fill_rows``), which commits each one's first token;
2. **cycle** — one speculative cycle over every row (graph replays; idle rows are frozen and
   commit nothing), or ``sync_every`` AR steps without a drafter;
3. **leave** — each row is cut at its own stop token or length limit; a row that reached either
   returns its result and its row is released for the next request.

Same public surface as :class:`~specpilot.engine.batching.scheduler.BatchScheduler` (``submit``,
``step``, ``cancel``, ``run``, ``has_work``, ``running``, ``waiting``). Differences: the whole
prompt is prefilled at admission (no segments), every row holds the context given at
construction (the longest prompt plus new tokens it will admit), and verify is a chain of the
drafter's ``k`` tokens (no block policy or pre-filter). Rows never influence each other's
tokens, so in fp32 every request's output equals its own single-request AR output.
"""

from __future__ import annotations

import torch

from specpilot.engine.batching.queue import RequestQueue
from specpilot.engine.batching.request import Request, RequestResult, StepReport
from specpilot.engine.loop import GenerationResult
from specpilot.engine.static_engine import StaticEngine
from specpilot.engine.verify import cut_at_stop

__all__ = ["StaticScheduler"]


class StaticScheduler(RequestQueue):
    """Continuous batching over the rows of a :class:`StaticEngine` (see the module docstring)."""

    def __init__(
        self, engine: StaticEngine, *, slots: int = 16, max_context: int | None = None
    ) -> None:
        """``max_context``: the longest prompt plus ``max_new_tokens`` any request may ask for
        (default: all the model's context allows); every row is allocated for it once, so that
        captured graphs stay valid."""
        if max_context is None:
            max_context = engine.target.max_positions - engine.context_margin()
        self.engine = engine
        self.max_context = max_context
        engine.open_rows(slots, max_context)
        super().__init__()
        self._rows: list[Request | None] = [None] * slots
        self._results = [self._idle() for _ in range(slots)]  # per row, engine-side
        self._active = [False] * slots
        self._admitted_step = [0] * slots

    @staticmethod
    def _idle() -> GenerationResult:
        return GenerationResult(prompt_ids=[], tokens=[], stop_reason="length")

    # ------------------------------------------------------------------ queue
    @property
    def num_slots(self) -> int:
        return len(self._rows)

    @property
    def running(self) -> int:
        return sum(r is not None for r in self._rows)

    def _cancel_running(self, request_id: str) -> RequestResult | None:
        for row, held in enumerate(self._rows):
            if held is not None and held.id == request_id:
                return self._leave(row, "cancelled")
        return None

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def step(self) -> StepReport:
        """Admit into free rows, one cycle over every row, release the rows that finished."""
        report = StepReport(committed=[], finished=[])
        before = [len(r.tokens) for r in self._results]
        free = [row for row, req in enumerate(self._rows) if req is None]
        admit = [(row, self._waiting.popleft()) for row in free[: len(self._waiting)]]
        if admit:
            self._admit(admit)
            for row, _ in admit:
                before[row] = 0
            report.rows_prefilling += len(admit)
        if self._still_running():  # a request may end on its first token
            report.rows_decoding = sum(self._active)
            report.forward_tokens = self.num_slots * (self.engine.k + 1)
            report.drafted = report.rows_decoding * self.engine.k
            self.engine.step_rows(self._results, self._active)
        for row, req in enumerate(self._rows):
            if req is None:
                continue
            res = self._results[row]
            keep, stopped = cut_at_stop(res.tokens, req.max_new_tokens, req.stop_ids)
            del res.tokens[len(keep) :]
            report.committed.append((req.id, keep[before[row] :]))
            if stopped or len(keep) >= req.max_new_tokens:
                report.finished.append(self._leave(row, "eos" if stopped else "length"))
        self.steps += 1
        return report

    def _still_running(self) -> bool:
        """Cut rows whose first token already ended them; whether any row is left to decode."""
        for row, req in enumerate(self._rows):
            if req is None:
                continue
            toks = self._results[row].tokens
            if len(toks) >= req.max_new_tokens or toks[-1] in req.stop_ids:
                self._active[row] = False
        return any(self._active)

    def _admit(self, admit: list[tuple[int, Request]]) -> None:
        """Start each request in its row, all with one batched prefill."""
        firsts = self.engine.fill_rows(
            [row for row, _ in admit],
            [list(req.prompt_ids) for _, req in admit],
            [req.max_new_tokens for _, req in admit],
        )
        for (row, req), first in zip(admit, firsts, strict=True):
            self._rows[row] = req
            self._results[row] = GenerationResult(list(req.prompt_ids), [first], "length")
            self._active[row] = True
            self._admitted_step[row] = self.steps

    def _leave(self, row: int, reason: str) -> RequestResult:
        req = self._rows[row]
        assert req is not None
        gen = self._results[row]
        res = RequestResult(req.id, gen.prompt_ids, gen.tokens, reason, gen.stats)
        res.admitted_step = res.first_token_step = self._admitted_step[row]
        res.finished_step = self.steps
        self.engine.release_row(row)
        self._rows[row] = None
        self._results[row] = self._idle()
        self._active[row] = False
        return res
