"""The one loop over requests: continuous batching over the rows of the engine.

Per step:

1. **admit** — waiting requests take free rows;
2. **prefill** — every row still in prefill feeds its next segment of at most ``segment_tokens``
   prompt tokens (segment admission: a long prompt enters over several steps, so the running
   rows keep committing every step), as few forwards as ``engine/admission.py`` can pack them
   in (every new prompt of the step in one graphed forward up to a token budget); a row whose
   last segment went in commits the target's argmax after its prompt as its first token;
3. **decode** — one engine cycle over every decoding row (``Engine.step``);
4. **leave** — each request is cut at its own stop token or length limit (both may fall inside a
   draft: ``cut_at_stop``); a finished request returns its result and frees its row.

Rows never influence each other's tokens: each row's K/V, positions and mask are its own, and
every committed token is the target's argmax given that row's committed prefix, so in fp32 the
output of every request equals its own single-request AR output, whatever runs beside it.
``generate`` is this loop with every prompt submitted at once, one row each.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from specpilot.engine.engine import Engine
from specpilot.engine.logprobs import committed_logprobs
from specpilot.engine.plans import TreePlan
from specpilot.engine.requests import Request, RequestResult, StepReport, check_fits
from specpilot.engine.types import GenerationResult
from specpilot.engine.verify import cut_at_stop

__all__ = ["Scheduler", "generate"]


@dataclass(slots=True)
class _Row:
    """The request that holds one row."""

    request: Request
    result: RequestResult
    prefilled: int = 0  # prompt tokens whose K/V is in
    decoding: bool = False

    @property
    def remaining(self) -> int:
        return self.request.max_new_tokens - len(self.result.tokens)


class Scheduler:
    """Continuous batching of greedy speculative decoding over ``slots`` rows of ``engine``."""

    def __init__(
        self,
        engine: Engine,
        *,
        slots: int = 1,
        segment_tokens: int | None = None,
        max_context: int | None = None,
        window: int | None = None,
        lookahead: bool = False,
    ) -> None:
        """``segment_tokens``: prompt tokens a row in prefill feeds per step (None: the whole
        prompt at once). ``max_context``: the longest prompt + ``max_new_tokens`` a request may
        ask for (default: all the engine allows); every row is allocated for it once, so that
        captured graphs stay valid. ``window``: AR steps one step may run at most before its
        read-back (None: the engine's ``sync_every``, 16 on CUDA); a server streams each
        step's tokens, so its inter-token latency is a window's time. ``lookahead``: each AR
        window queues the next one's first step behind its read-back (``engine/cycles.py``),
        so the device keeps computing while the caller handles the step's tokens."""
        if slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        if segment_tokens is not None and segment_tokens < 1:
            raise ValueError(f"segment_tokens must be at least 1, got {segment_tokens}")
        self.engine = engine
        self.segment_tokens = segment_tokens
        if window is not None and window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        self.window = window
        self.lookahead = lookahead
        self.max_context = engine.max_context if max_context is None else max_context
        engine.open(slots, self.max_context)
        self.steps = 0
        self._rows: list[_Row | None] = [None] * slots
        self._waiting: deque[Request] = deque()

    # ------------------------------------------------------------------ queue
    @property
    def num_slots(self) -> int:
        return len(self._rows)

    @property
    def running(self) -> int:
        return sum(r is not None for r in self._rows)

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
        check_fits(prompt_len, max_new_tokens, self.max_context, "that this scheduler admits")

    def submit(self, request: Request) -> None:
        """Queue a request; it takes a row at the start of a later step."""
        self.check_fits(len(request.prompt_ids), request.max_new_tokens)
        why = self.logprobs_refused() if request.logprobs is not None else None
        if why is not None:
            raise ValueError(why)
        self._waiting.append(request)

    def logprobs_refused(self) -> str | None:
        """Why this engine cannot give logprobs (None: it can)."""
        if isinstance(self.engine.plan, TreePlan):
            return (
                "logprobs need a chain or packed verify plan: a tree verify commits tokens "
                "from positions off the block's order"
            )
        return None

    def cancel(self, request_id: str) -> RequestResult | None:
        """Drop a waiting or running request now; its result so far (``cancelled``), if any."""
        for req in self._waiting:
            if req.id == request_id:
                self._waiting.remove(req)
                return RequestResult(req.id, list(req.prompt_ids), [], "cancelled")
        for row, held in enumerate(self._rows):
            if held is not None and held.request.id == request_id:
                return self._leave(row, "cancelled")
        return None

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

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def step(self, interrupt: Callable[[], bool] | None = None) -> StepReport:
        """Admit, feed prompt segments, one cycle over the decoding rows, release finished rows.

        A window of AR steps is cut to one step when a row committed its first token in this
        step (so that token is out after the prefill and one step: time to first token) or a
        row wants logprobs (``engine/logprobs.py``); ``interrupt`` (asked between AR steps, e.g.
        "a request waits and a row is free") ends a window early, so a new request is admitted
        at the next step, not at the end of the window."""
        report = StepReport(committed=[], finished=[])
        for row, held in enumerate(self._rows):
            if held is None and self._waiting:
                req = self._waiting.popleft()
                res = RequestResult(req.id, list(req.prompt_ids), [], "length")
                res.admitted_step = self.steps
                self._rows[row] = _Row(req, res)
                self.engine.draft_caps[row] = req.draft_cap
        started = self._prefill(report)
        decoding = [r for r in self._rows if r is not None and r.decoding]
        if decoding:
            logprobs = any(r.request.logprobs is not None for r in decoding)
            one = started or logprobs
            look = self.lookahead and not logprobs  # a step ahead would overwrite their columns
            for c in self.engine.step(1 if one else self.window, interrupt, look):
                held = self._rows[c.row]
                assert held is not None
                report.rows_decoding += 1
                report.drafted += c.drafted
                if c.cycles == 1:
                    held.result.stats.record(c.drafted, c.accepted, len(c.tokens))
                self._commit(c.row, c.tokens, report, per_token_stats=c.cycles > 1)
        self.steps += 1
        return report

    def _prefill(self, report: StepReport) -> bool:
        """Feed the next prompt segments; True when a row committed its first token."""
        rows = [b for b, r in enumerate(self._rows) if r is not None and not r.decoding]
        if not rows:
            return False
        held = [self._rows[b] for b in rows]
        prompts = [r.request.prompt_ids for r in held if r is not None]
        starts = [r.prefilled for r in held if r is not None]
        seg = self.segment_tokens
        lens = [
            len(p) - s if seg is None else min(seg, len(p) - s)
            for p, s in zip(prompts, starts, strict=True)
        ]
        news = [r.request.max_new_tokens for r in held if r is not None]
        before = self.engine.prefill_forwards
        firsts = self.engine.prefill(rows, prompts, starts, lens, news)
        report.rows_prefilling += len(rows)
        report.prefill_forwards += self.engine.prefill_forwards - before
        started = False
        for b, r, n, first in zip(rows, held, lens, firsts, strict=True):
            assert r is not None
            r.prefilled += n
            if first is not None:
                r.decoding = True
                r.result.first_token_step = self.steps
                started = True
                self._commit(b, [first], report, per_token_stats=False)
        return started

    def _commit(
        self, row: int, tokens: list[int], report: StepReport, per_token_stats: bool
    ) -> None:
        """Append a row's committed tokens, cut at its stop token or length limit."""
        held = self._rows[row]
        assert held is not None
        res = held.result
        keep, stopped = cut_at_stop(tokens, held.remaining, held.request.stop_ids)
        if per_token_stats:  # AR steps queued together: one verify forward per token kept
            for _ in keep:
                res.stats.record(0, 0, 1)
        res.tokens.extend(keep)
        top = held.request.logprobs
        if top is not None:
            # the columns of the forward that committed them (one-step windows: ``step``)
            assert not per_token_stats or len(tokens) <= 1, "logprobs need one-step AR windows"
            lps = committed_logprobs(self.engine.fwd, self.engine.final_hidden[row], keep, top)
            res.logprobs.extend(lps)
            report.logprobs.setdefault(held.request.id, []).extend(lps)
        report.committed.append((held.request.id, keep))
        if stopped or held.remaining <= 0:
            report.finished.append(self._leave(row, "eos" if stopped else "length"))

    def _leave(self, row: int, reason: str) -> RequestResult:
        held = self._rows[row]
        assert held is not None
        held.result.stop_reason = reason
        held.result.finished_step = self.steps
        self.engine.release(row)
        self._rows[row] = None
        return held.result


def generate(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_ids: Sequence[int] = (),
    on_commit: Callable[[int, list[int]], None] | None = None,
) -> list[GenerationResult]:
    """Decode every prompt (one row each) until EOS or ``max_new_tokens``; ``on_commit(i,
    tokens)`` streams what prompt i committed, as it is committed."""
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be at least 1")
    if not prompts:
        return []
    for p in prompts:
        engine.check_fits(len(p), max_new_tokens)
    need = max(len(p) for p in prompts) + max_new_tokens
    sched = Scheduler(engine, slots=len(prompts), max_context=need)
    stop = frozenset(eos_ids)
    for i, p in enumerate(prompts):
        sched.submit(Request(str(i), tuple(p), max_new_tokens, stop))
    done: dict[str, RequestResult] = {}
    while sched.has_work:
        report = sched.step()
        if on_commit is not None:
            for rid, toks in report.committed:
                if toks:
                    on_commit(int(rid), toks)
        for res in report.finished:
            done[res.id] = res
    out = []
    for i, p in enumerate(prompts):
        r = done[str(i)]
        out.append(GenerationResult(list(p), r.tokens, r.stop_reason, r.stats))
    return out
