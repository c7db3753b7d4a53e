"""The speculative decode loop for a batch of sequences (batch 1 is the fast case today).

Each cycle: the drafter proposes up to k tokens per row; the target runs once on
``[pending, drafts...]``; ``verify_fn`` finds the accepted prefix and the bonus token; the
committed tokens are appended, stop conditions are applied (EOS or the length limit may fall
in the middle of a draft), and the KV cache is committed to the new length (rejected entries
are simply left behind to be overwritten). With no drafter (k = 0) every cycle is one AR step.

Propose/verify/accept/KV-commit go through a :class:`~specpilot.engine.strategy.VerifyStrategy`
(the ``verify_strategy`` plug point): the chain above by default, or e.g. a tree.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from specpilot.drafters.base import Drafter
from specpilot.engine.stats import AcceptanceStats
from specpilot.engine.strategy import ChainStrategy, VerifyFn, VerifyStrategy
from specpilot.engine.verify import cut_at_stop, greedy_verify
from specpilot.errors import PromptTooLongError
from specpilot.models.kv_cache import KVCache
from specpilot.models.transformer import Transformer

__all__ = ["GenerationResult", "PhaseTimes", "SpecEngine", "VerifyFn"]


@dataclass(slots=True)
class PhaseTimes:
    """Wall time per phase in seconds (device synchronised at phase ends when timing is on)."""

    prefill: float = 0.0
    draft: float = 0.0
    verify: float = 0.0
    commit: float = 0.0

    def total(self) -> float:
        return self.prefill + self.draft + self.verify + self.commit


@dataclass(slots=True)
class GenerationResult:
    prompt_ids: list[int]
    tokens: list[int]  # committed tokens after the prompt, stop token included
    stop_reason: str  # "eos" | "length"
    stats: AcceptanceStats = field(default_factory=AcceptanceStats)


class SpecEngine:
    """Greedy speculative decoding; ``drafter=None`` is plain autoregressive decoding."""

    def __init__(
        self,
        target: Transformer,
        drafter: Drafter | None = None,
        verify_fn: VerifyFn = greedy_verify,
        time_phases: bool = False,
        strategy: VerifyStrategy | None = None,
    ) -> None:
        self.target = target
        self.drafter = drafter
        self.verify_fn = verify_fn
        self.strategy: VerifyStrategy = strategy or ChainStrategy(verify_fn)
        self.time_phases = time_phases
        self.times = PhaseTimes()
        self._cache: KVCache | None = None

    @property
    def k(self) -> int:
        return 0 if self.drafter is None else self.drafter.k

    @property
    def verify_width(self) -> int:
        """Most drafted tokens one verify forward feeds per row (chain: k; tree: nodes)."""
        return self.strategy.width(self.drafter)

    def _clock(self) -> float:
        if self.time_phases and self.target.device.type == "cuda":
            torch.cuda.synchronize(self.target.device)
        return time.perf_counter()

    def _cache_for(self, batch: int, need: int) -> KVCache:
        cache = self._cache
        if cache is None or cache.batch_size != batch or cache.max_seq_len < need:
            cache = self.target.allocate_cache(batch, need)
            self._cache = cache
        cache.reset()
        return cache

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        context = self.target.max_positions
        if prompt_len == 0:
            raise PromptTooLongError("The prompt is empty; give at least one token.")
        if prompt_len + max_new_tokens > context:
            raise PromptTooLongError(
                f"A prompt of {prompt_len} tokens plus {max_new_tokens} new tokens exceeds the "
                f"model's context of {context}; shorten the prompt or lower --max-new-tokens."
            )

    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        eos_ids: Sequence[int] = (),
        on_commit: Callable[[int, list[int]], None] | None = None,
    ) -> list[GenerationResult]:
        """Decode every prompt until EOS or ``max_new_tokens``; ``on_commit(row, tokens)`` streams."""
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        for p in prompts:
            self.check_fits(len(p), max_new_tokens)
        target, dev = self.target, self.target.device
        b, k = len(prompts), self.verify_width
        eos = set(eos_ids)
        lens = [len(p) for p in prompts]
        cache = self._cache_for(
            b, min(max(lens) + max_new_tokens + k + 1, target.max_positions + k + 1)
        )
        t0 = self._clock()

        # Prefill: one forward over the padded prompts; the first token is the target's argmax.
        width = max(lens)
        padded = torch.zeros(b, width, dtype=torch.int64)
        for row, p in enumerate(prompts):
            padded[row, : len(p)] = torch.tensor(list(p), dtype=torch.int64)
        last = torch.tensor(lens, dtype=torch.int64, device=dev)[:, None] - 1  # [B, 1]
        first = target.forward_argmax(padded.to(dev), cache, logits_rows=last)[:, 0].tolist()
        for row, n in enumerate(lens):
            cache.commit(row, n)

        results = [
            GenerationResult(prompt_ids=list(p), tokens=[], stop_reason="length") for p in prompts
        ]
        rows = _Rows(
            results=results,
            contexts=[list(p) for p in prompts],
            active=[True] * b,
            pending=torch.zeros(b, dtype=torch.int64),
            eos=eos,
            max_new_tokens=max_new_tokens,
            on_commit=on_commit,
        )
        for row in range(b):
            rows.append(row, [first[row]])
        t1 = self._clock()
        self.times.prefill += t1 - t0
        if self.drafter is not None:
            self.drafter.start(rows.contexts)

        while any(rows.active):
            t0 = self._clock()
            # Never draft past the length limit: a row with r tokens left drafts at most r - 1.
            max_lens = [
                max_new_tokens - len(r.tokens) - 1 if a else 0
                for r, a in zip(results, rows.active, strict=True)
            ]
            proposal = self.strategy.propose(self.drafter, rows.contexts, max_lens)
            t1 = self._clock()
            outcome = self.strategy.verify(target, cache, rows.pending, proposal, rows.active)
            t2 = self._clock()
            for row in range(b):
                if not rows.active[row]:
                    continue
                committed = outcome.committed[row]
                results[row].stats.record(
                    outcome.draft_lens[row], outcome.accepted_lens[row], len(committed)
                )
                rows.append(row, committed)
            t3 = self._clock()
            self.times.draft += t1 - t0
            self.times.verify += t2 - t1
            self.times.commit += t3 - t2
        return results


@dataclass(slots=True)
class _Rows:
    """Per-row decoding state of one ``generate`` call."""

    results: list[GenerationResult]
    contexts: list[list[int]]  # prompt + committed tokens, what drafters see
    active: list[bool]
    pending: Tensor  # [B] int64: last committed token, whose KV is not in the cache yet
    eos: set[int]
    max_new_tokens: int
    on_commit: Callable[[int, list[int]], None] | None

    def append(self, row: int, committed: list[int]) -> None:
        """Append committed tokens to a row, cutting at the first EOS or at the length limit."""
        res = self.results[row]
        keep, stopped = cut_at_stop(committed, self.max_new_tokens - len(res.tokens), self.eos)
        if stopped:
            res.stop_reason = "eos"
            self.active[row] = False
        res.tokens.extend(keep)
        self.contexts[row].extend(keep)
        if len(res.tokens) >= self.max_new_tokens:
            self.active[row] = False
        self.pending[row] = keep[-1]
        if self.on_commit is not None and keep:
            self.on_commit(row, keep)
