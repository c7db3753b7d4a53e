"""Continuous batching with speculation over a fixed number of slots.

Each slot holds one request. Per step (one target forward for every slot at once):

1. **admit** — waiting requests take free slots (their KV length is set to 0: rollback is free);
2. **draft** — the drafter proposes for the rows that are decoding, each row at most its own
   block length (``BlockPolicy``) and never past its own remaining budget; an optional
   ``DraftPrefilter`` may then cut each row's drafts to a prefix (never anything else);
3. **forward** — one ragged forward: a decoding row feeds ``[pending, d_1..d_n]``, a row still in
   prefill feeds the next ``segment_tokens`` of its prompt (segment admission: a long prompt is
   spread over several steps so running decodes keep committing every step), a free slot below
   the highest occupied one feeds one dummy token (slots above it do not run: requests take the
   lowest free slot); rows are padded to the widest, and every row attends only to its own KV
   (``Transformer.forward`` with per-row start lengths);
4. **accept/commit** — ``greedy_verify`` over all rows; a decoding row commits its accepted
   drafts plus the bonus token, a row whose last prompt segment went in commits the target's
   argmax after the prompt as its first token; each row's KV length grows by what it committed;
5. **leave** — rows that hit a stop token or their length limit return their result and free
   the slot for the next request.

Rows never influence each other's tokens: each row's K/V, positions and mask are its own, and
every committed token is the target's argmax given that row's committed prefix, so in fp32 the
output of every request equals its own single-request AR output, whatever runs beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specpilot.drafters.base import Drafter, RowResettable
from specpilot.engine.batching.block import BlockPolicy
from specpilot.engine.batching.prefilter import DraftPrefilter
from specpilot.engine.batching.queue import RequestQueue
from specpilot.engine.batching.request import Request, RequestResult, StepReport
from specpilot.engine.strategy import VerifyFn
from specpilot.engine.verify import cut_at_stop, greedy_verify
from specpilot.models.transformer import Transformer

__all__ = ["BatchScheduler"]

_PLACEHOLDER = (0,)  # what the drafter sees for a slot that is free or still in prefill


@dataclass(slots=True)
class _Slot:
    """Decoding state of the request that holds one slot."""

    request: Request
    result: RequestResult
    context: list[int]  # prompt + committed tokens: what the drafter sees
    prefilled: int = 0  # prompt tokens whose KV is committed
    pending: int = -1  # last committed token, KV not yet cached (-1 while in prefill)
    block_state: object = None

    @property
    def decoding(self) -> bool:
        return self.pending >= 0

    @property
    def remaining(self) -> int:
        return self.request.max_new_tokens - len(self.result.tokens)


class BatchScheduler(RequestQueue):
    """Continuous batching of greedy speculative decoding; ``drafter=None`` is batched AR."""

    def __init__(
        self,
        target: Transformer,
        drafter: Drafter | None = None,
        *,
        slots: int = 8,
        segment_tokens: int = 256,
        max_context: int | None = None,
        block_policy: BlockPolicy | None = None,
        verify_fn: VerifyFn = greedy_verify,
        prefilter: DraftPrefilter | None = None,
    ) -> None:
        if slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        if segment_tokens < 1:
            raise ValueError(f"segment_tokens must be at least 1, got {segment_tokens}")
        self.target = target
        self.drafter = drafter
        self.segment_tokens = segment_tokens
        self.block_policy = block_policy
        self.verify_fn = verify_fn
        self.prefilter = prefilter
        self.max_context = min(max_context or target.max_positions, target.max_positions)
        width = max(segment_tokens, self.k + 1)  # widest row a forward can feed
        self.cache = target.allocate_cache(slots, self.max_context + width)
        super().__init__()
        self._slots: list[_Slot | None] = [None] * slots
        self._drafter_started = False

    # ------------------------------------------------------------------ queue
    @property
    def k(self) -> int:
        return 0 if self.drafter is None else self.drafter.k

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    @property
    def running(self) -> int:
        return sum(s is not None for s in self._slots)

    def _cancel_running(self, request_id: str) -> RequestResult | None:
        for row, slot in enumerate(self._slots):
            if slot is not None and slot.request.id == request_id:
                slot.result.stop_reason = "cancelled"
                slot.result.finished_step = self.steps
                self._slots[row] = None
                return slot.result
        return None

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def step(self) -> StepReport:
        """Admit, draft, one forward over every slot, accept, commit, release finished rows."""
        self._admit()
        report = StepReport(committed=[], finished=[])
        if self.running == 0:
            return report
        inputs, drafts = self._inputs()
        # Only the slots up to the highest occupied one run (requests take the lowest free slot),
        # so a lone request costs a one-row forward, not a forward over every slot.
        b = 1 + max(row for row, s in enumerate(self._slots) if s is not None)
        inputs, drafts, cache = inputs[:b], drafts[:b], self.cache.rows(b)
        target, dev = self.target, self.target.device
        width = max(len(x) for x in inputs)
        r = 1 + max((len(d) for d in drafts), default=0)  # argmax rows per slot
        tokens = torch.zeros(b, width, dtype=torch.int64)  # [B, T]
        draft_t = torch.zeros(b, r - 1, dtype=torch.int64)  # [B, K]
        rows = torch.zeros(b, r, dtype=torch.int64)  # [B, R] which of T to read the argmax at
        for row, (seq, d) in enumerate(zip(inputs, drafts, strict=True)):
            tokens[row, : len(seq)] = torch.tensor(seq, dtype=torch.int64)
            draft_t[row, : len(d)] = torch.tensor(d, dtype=torch.int64)
            slot = self._slots[row]
            if slot is not None and slot.decoding:  # the argmax at pending and at every draft
                rows[row] = torch.arange(r).clamp(max=len(seq) - 1)
            else:  # a prefill row: the argmax after its last token (the first new token)
                rows[row] = len(seq) - 1
        start = cache.lengths.to(dev)
        # Padding past a row's own tokens may run past the RoPE table; its K/V is never read.
        positions = (start[:, None] + torch.arange(width, device=dev)).clamp(
            max=target.max_positions - 1
        )  # [B, T]
        argmax = target.forward_argmax(
            tokens.to(dev), cache, positions=positions, logits_rows=rows.to(dev)
        )  # [B, R]
        lens = torch.tensor([len(d) for d in drafts], dtype=torch.int64, device=dev)
        outcome = self.verify_fn(draft_t.to(dev), lens, argmax)
        accepted, bonus = outcome.accepted_len.tolist(), outcome.bonus.tolist()
        report.forward_tokens = b * width
        report.drafted = sum(len(d) for d in drafts)
        for row, slot in enumerate(self._slots[:b]):
            if slot is None:
                continue
            if slot.decoding:
                report.rows_decoding += 1
                n = accepted[row]
                committed = [*drafts[row][:n], bonus[row]]
                self.cache.commit(row, int(self.cache.lengths[row]) + n + 1)
                slot.result.stats.record(len(drafts[row]), n, len(committed))
                if self.block_policy is not None and drafts[row]:
                    self.block_policy.update(slot.block_state, len(drafts[row]), n)
            else:
                report.rows_prefilling += 1
                slot.prefilled += len(inputs[row])
                self.cache.commit(row, slot.prefilled)
                if slot.prefilled < len(slot.request.prompt_ids):
                    continue
                committed = [bonus[row]]  # the target's argmax after the whole prompt
                slot.result.first_token_step = self.steps
                self._start_decoding(row, slot)
            kept = self._append(slot, committed)
            report.committed.append((slot.request.id, kept))
            if slot.pending < 0:  # finished
                slot.result.finished_step = self.steps
                report.finished.append(slot.result)
                self._slots[row] = None
        self.steps += 1
        return report

    def _admit(self) -> None:
        for row, slot in enumerate(self._slots):
            if slot is None and self._waiting:
                req = self._waiting.popleft()
                result = RequestResult(req.id, list(req.prompt_ids), [], "length")
                result.admitted_step = self.steps
                self._slots[row] = _Slot(req, result, list(req.prompt_ids))
                self.cache.commit(row, 0)

    def _start_decoding(self, row: int, slot: _Slot) -> None:
        """The prompt is in: the drafter forgets the slot's previous request."""
        if self.block_policy is not None:
            slot.block_state = self.block_policy.new_state(self.k)
        if self.drafter is None or not self._drafter_started:
            return
        if isinstance(self.drafter, RowResettable):
            self.drafter.reset_row(row)
        else:  # a drafter that cannot forget one row restarts every row (correct, slower)
            self.drafter.start(self._drafter_contexts())

    def _drafter_contexts(self) -> list[list[int] | tuple[int, ...]]:
        return [s.context if s is not None and s.decoding else _PLACEHOLDER for s in self._slots]

    def _inputs(self) -> tuple[list[list[int]], list[list[int]]]:
        """Per slot: the tokens this forward feeds, and the drafted tokens among them."""
        drafts: list[list[int]] = [[] for _ in self._slots]
        max_lens = [
            min(self._block(s), s.remaining - 1) if s is not None and s.decoding else 0
            for s in self._slots
        ]
        if self.drafter is not None and max(max_lens) > 0:
            contexts = self._drafter_contexts()
            if not self._drafter_started:
                self.drafter.start(contexts)
                self._drafter_started = True
            proposal = self.drafter.propose(contexts, max_lens)
            proposed = proposal.tokens.tolist()
            drafts = [
                p[: min(n, m)] for p, n, m in zip(proposed, proposal.lengths, max_lens, strict=True)
            ]
            if self.prefilter is not None:
                drafts = self._prefilter(drafts)
        inputs: list[list[int]] = []
        for slot, d in zip(self._slots, drafts, strict=True):
            if slot is None:
                inputs.append([0])
            elif slot.decoding:
                inputs.append([slot.pending, *d])
            else:
                prompt = slot.request.prompt_ids
                inputs.append(list(prompt[slot.prefilled : slot.prefilled + self.segment_tokens]))
        return inputs, drafts

    def _prefilter(self, drafts: list[list[int]]) -> list[list[int]]:
        """Each row keeps a prefix of its own drafts, as long as the pre-filter says (clamped)."""
        assert self.prefilter is not None
        contexts = [s.context if s is not None and s.decoding else None for s in self._slots]
        keep = self.prefilter(contexts, drafts)
        if len(keep) != len(drafts):
            raise ValueError(f"the draft pre-filter gave {len(keep)} rows, expected {len(drafts)}")
        return [d[: max(0, min(len(d), int(n)))] for d, n in zip(drafts, keep, strict=True)]

    def _block(self, slot: _Slot) -> int:
        if self.block_policy is None:
            return self.k
        return self.block_policy.block(slot.block_state, self.k)

    @staticmethod
    def _append(slot: _Slot, committed: list[int]) -> list[int]:
        """Append committed tokens, cutting at the first stop token or the length limit."""
        res = slot.result
        keep, stopped = cut_at_stop(committed, slot.remaining, slot.request.stop_ids)
        if stopped:
            res.stop_reason = "eos"
        res.tokens.extend(keep)
        slot.context.extend(keep)
        done = res.stop_reason == "eos" or slot.remaining <= 0
        slot.pending = -1 if done else keep[-1]
        return keep
