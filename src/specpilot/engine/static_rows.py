"""Refilling one row of a running :class:`~specpilot.engine.static_engine.StaticEngine`: the
engine side of continuous batching on the static (CUDA-graph) path.

A mixin, like ``static_steps.py``. ``open_rows`` allocates the batch once for the longest
context that will be admitted (prompt + new tokens), so the graphs captured against the decode
state stay valid for every later request; every row starts idle. Between cycles, ``fill_row``
runs one prompt eagerly into that row's slice of the KV cache (its own positions from 0), sets
the row's device state and host mirrors, and restarts the drafter's state of that row
(``RowRefillable.prefill_row``; ``fill_rows`` admits several rows with one batched prefill; ``rows_filled`` once before the next cycle, so that one oracle
run of simulated acceptance serves every row admitted in a step); ``step_rows`` runs one cycle;
``release_row`` makes the row idle again. The other rows are not touched, so their tokens do
not change: every committed token stays the target's argmax given the row's own prefix.

An idle row is frozen (``active = 0``: it commits nothing) at a committed length of 2, so that
the forwards that still run over it (verify, draft, the simulated-acceptance oracle) read and
write only its own first slots, and the attention bucket is set by the rows that decode.

Chain verify only: the width and tree policies keep per-batch state (``reset(batch)``) that a
refill would have to restart per row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specpilot.drafters.static_base import RowRefillable, can_refill_rows
from specpilot.engine.loop import GenerationResult
from specpilot.engine.static_steps import _EngineParts
from specpilot.engine.widths import WidthPolicy
from specpilot.errors import PromptTooLongError
from specpilot.models.static_forward import StaticForward
from specpilot.models.transformer import Transformer

NO_LIMIT = 1 << 30
"""Length limit ``step_rows`` gives the engine's loop: the caller cuts each row at its own."""
IDLE_LEN = 2
"""Committed length of an idle row (a draft model re-feeds the last two committed tokens)."""


class RowSteps(_EngineParts):
    """``open_rows`` / ``fill_row`` / ``release_row``: see the module docstring."""

    target: Transformer
    fwd: StaticForward
    width_policy: WidthPolicy | None
    k_max: int
    sync_every: int
    _final_len: list[int]

    def _prepare(self, batch: int, need: int) -> None:
        raise NotImplementedError

    def _ar_window(
        self, results: list[GenerationResult], active: list[bool], eos: set[int], max_new: int
    ) -> None:
        raise NotImplementedError

    def _spec_cycle(
        self,
        results: list[GenerationResult],
        active: list[bool],
        eos: set[int],
        max_new: int,
        events: list[tuple[torch.cuda.Event, ...]],
    ) -> None:
        raise NotImplementedError

    def context_margin(self) -> int:
        """Slots past a row's limit that a cycle may write (drafts, verify block, AR window)."""
        return 2 * (self.k_max + 1) + self.sync_every + 2

    @torch.inference_mode()
    def open_rows(self, batch: int, max_context: int) -> None:
        """Allocate ``batch`` idle rows, each for up to ``max_context`` tokens (prompt + new)."""
        if self.width_policy is not None or self.tree_policy is not None:
            raise ValueError(
                "Refilling rows of a running batch supports chain verify only; drop the width "
                "or tree policy."
            )
        if self.drafter is not None and not can_refill_rows(self.drafter):
            raise ValueError(
                f"The drafter '{self.drafter.name}' cannot restart one row of a running batch; "
                "use the draft-model or block drafter (optionally under simulated acceptance)."
            )
        if batch < 1:
            raise ValueError(f"batch must be at least 1, got {batch}")
        need = max_context + self.context_margin()
        if need > self.target.max_positions:
            raise PromptTooLongError(
                f"A context of {max_context} tokens exceeds the model's context of "
                f"{self.target.max_positions - self.context_margin()} for this engine; lower "
                "the longest prompt or max_new_tokens."
            )
        self._prepare(batch, need)
        st = self.state
        assert st is not None
        st.tokens.zero_()
        st.committed_len.fill_(IDLE_LEN)
        st.prev_committed.fill_(IDLE_LEN)
        for t in (st.pending, st.active, st.cycle, st.drafts, st.draft_lens, st.accepted):
            t.zero_()
        self._dev_len = [IDLE_LEN] * batch
        self._final_len = [IDLE_LEN] * batch
        self._filled: list[int] = []  # rows refilled since the last cycle
        self.rows_verified = 0

    @torch.inference_mode()
    def fill_row(self, row: int, prompt: list[int], max_new: int) -> int:
        """Start ``prompt`` in idle row ``row`` (between cycles); returns its first token."""
        return self.fill_rows([row], [prompt], [max_new])[0]

    @torch.inference_mode()
    def fill_rows(
        self, rows: Sequence[int], prompts: Sequence[list[int]], max_news: Sequence[int]
    ) -> list[int]:
        """Start ``prompts[i]`` in idle row ``rows[i]`` (between cycles) with one batched eager
        prefill (padded to the longest prompt, in a scratch cache whose K/V are then copied into
        the rows' slices); returns the first tokens."""
        st, cache = self.state, self.cache
        if st is None or cache is None:
            raise RuntimeError("Call open_rows before fill_row.")
        room = st.capacity - self.context_margin()
        for prompt, max_new in zip(prompts, max_news, strict=True):
            if not prompt:
                raise PromptTooLongError("The prompt is empty; give at least one token.")
            if len(prompt) + max_new > room:
                raise PromptTooLongError(
                    f"A prompt of {len(prompt)} tokens plus {max_new} new tokens exceeds the "
                    f"{room} tokens each row was opened for; shorten the prompt or lower "
                    "max_new_tokens."
                )
        dev, b = self.device, len(rows)
        lens = [len(p) for p in prompts]
        width = max(lens)
        padded = torch.zeros(b, width, dtype=torch.int64)
        for i, p in enumerate(prompts):
            padded[i, : len(p)] = torch.tensor(p, dtype=torch.int64)
        ids = padded.to(dev)  # [b, P]
        layers = () if self.drafter is None else self.drafter.hidden_layers
        hidden = None
        if layers:
            h, dtype = self.target.cfg.hidden_size, self.target.dtype
            hidden = torch.empty(len(layers), b, width, h, dtype=dtype, device=dev)
        attn_len = self.bucket(width)
        scratch = self.target.allocate_cache(b, attn_len)
        start = torch.zeros(b, dtype=torch.int64, device=dev)
        logits = self.fwd(ids, scratch, start, attn_len, layers, hidden)  # [b, P, V]
        lens_d = torch.tensor(lens, dtype=torch.int64, device=dev)
        first = logits[torch.arange(b, device=dev), lens_d - 1].argmax(dim=-1)  # [b]
        rows_d = torch.tensor(list(rows), dtype=torch.int64, device=dev)
        for dst, src in zip(cache.k + cache.v, scratch.k + scratch.v, strict=True):
            dst[rows_d, :, :width] = src[:, :, :width]  # [b, H_kv, P, D]
        first_host = first.tolist()
        for i, (row, n) in enumerate(zip(rows, lens, strict=True)):
            st.tokens[row].zero_()
            st.tokens[row, :n].copy_(ids[i, :n])
            st.tokens[row, n] = first[i]
            self._dev_len[row] = n + 1
            self._final_len[row] = n + max_news[i]
        st.committed_len[rows_d] = lens_d + 1
        st.prev_committed[rows_d] = lens_d + 1
        st.pending[rows_d] = first
        st.active[rows_d] = 1
        st.drafts[rows_d] = 0
        st.draft_lens[rows_d] = 0
        st.accepted[rows_d] = 0
        if self.drafter is not None:
            assert isinstance(self.drafter, RowRefillable)
            for i, (row, n) in enumerate(zip(rows, lens, strict=True)):
                rh = None if hidden is None else hidden[:, i : i + 1, :n].contiguous()
                self.drafter.prefill_row(self, row, ids[i : i + 1, :n], rh)  # type: ignore[arg-type]
        self._filled.extend(rows)
        return first_host

    @torch.inference_mode()
    def step_rows(self, results: list[GenerationResult], active: list[bool]) -> None:
        """One speculative cycle (``sync_every`` AR steps without a drafter) over the rows whose
        ``active`` is set, appending their committed tokens to ``results[row].tokens``. No stop
        tokens and no length limit apply: the caller cuts each row at its own, then releases it
        (a cycle writes at most ``context_margin`` slots past a row's limit)."""
        if self.drafter is None:
            self._ar_window(results, active, set(), NO_LIMIT)
            return
        if self._filled:
            assert isinstance(self.drafter, RowRefillable)
            self.drafter.rows_filled(self, self._filled)  # type: ignore[arg-type]
            self._filled = []
        self._spec_cycle(results, active, set(), NO_LIMIT, [])

    @torch.inference_mode()
    def release_row(self, row: int) -> None:
        """Make ``row`` idle (frozen at ``IDLE_LEN``); its KV slice is scratch from now on."""
        st = self.state
        assert st is not None
        st.active[row] = 0
        st.committed_len[row] = IDLE_LEN
        st.prev_committed[row] = IDLE_LEN
        st.pending[row] = 0
        self._dev_len[row] = IDLE_LEN
        self._final_len[row] = IDLE_LEN
