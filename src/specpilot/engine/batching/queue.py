"""The request queue both continuous-batching schedulers share: submit, wait, cancel, run.

A scheduler keeps its running requests its own way (``BatchScheduler``: slots with eager per-row
KV; ``StaticScheduler``: rows of a CUDA-graph engine); what waits for a row, the context check
that refuses a request up front, and the submit-then-step loop are the same.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from specpilot.engine.batching.request import Request, RequestResult, StepReport
from specpilot.errors import PromptTooLongError


class RequestQueue:
    """Waiting requests of a scheduler whose ``step`` admits them and whose ``running`` counts
    the requests holding a row. Subclasses set ``max_context`` and implement ``running``,
    ``step`` and ``_cancel_running``."""

    max_context: int

    def __init__(self) -> None:
        self.steps = 0
        self._waiting: deque[Request] = deque()

    @property
    def running(self) -> int:
        raise NotImplementedError

    def step(self) -> StepReport:
        raise NotImplementedError

    def _cancel_running(self, request_id: str) -> RequestResult | None:
        """Drop ``request_id`` if it holds a row; its result so far (``cancelled``)."""
        raise NotImplementedError

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def waiting_ids(self) -> list[str]:
        """Requests submitted but not yet in a row, oldest first."""
        return [r.id for r in self._waiting]

    @property
    def has_work(self) -> bool:
        return bool(self._waiting) or self.running > 0

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        if prompt_len == 0:
            raise PromptTooLongError("The prompt is empty; give at least one token.")
        if prompt_len + max_new_tokens > self.max_context:
            raise PromptTooLongError(
                f"A prompt of {prompt_len} tokens plus {max_new_tokens} new tokens exceeds the "
                f"scheduler's context of {self.max_context}; shorten the prompt or lower "
                "max_new_tokens."
            )

    def submit(self, request: Request) -> None:
        """Queue a request; it takes a row at the start of a later step."""
        self.check_fits(len(request.prompt_ids), request.max_new_tokens)
        self._waiting.append(request)

    def cancel(self, request_id: str) -> RequestResult | None:
        """Drop a waiting or running request now; its result so far (``cancelled``), if any."""
        for req in self._waiting:
            if req.id == request_id:
                self._waiting.remove(req)
                return RequestResult(req.id, list(req.prompt_ids), [], "cancelled")
        return self._cancel_running(request_id)

    def run(self, requests: Iterable[Request]) -> list[RequestResult]:
        """Submit every request, step until all are done; results in submission order."""
        order = []
        for req in requests:
            self.submit(req)
            order.append(req.id)
        done: dict[str, RequestResult] = {}
        while self.has_work:
            for res in self.step().finished:
                done[res.id] = res
        return [done[i] for i in order]
