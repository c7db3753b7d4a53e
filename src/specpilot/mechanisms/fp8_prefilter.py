"""FP8 pre-filter for large verify batches: an FP8 copy of the target cuts each row's block to the
drafts it agrees with (plus a margin) before the exact verify.

Variant built (*pre-filter*), per cycle of the engine (a drafter wrapper,
``drafters/wrapped.FilteredDrafter``):

1. the drafter proposes each row's block ``d_1..d_n``;
2. when at least ``min_batch`` rows have drafts, the cheap model (``fp8_copy.fp8_model``: every
   linear layer and the LM head in per-channel FP8 e4m3) runs **one** batched forward over all
   rows' context tails and drafts (``CheapScorer``, its own KV cache rolled back per row) and
   gives its greedy token ``c_i`` after each prefix ``d_1..d_i``; the row's agreed length ``a`` is
   the longest prefix with ``d_i == c_{i-1}``;
3. the row's block sent to the exact verify is cut to ``d_1..d_m``, ``m = min(n, a + margin)``
   (``margin`` drafts past the first disagreement hedge against the cheap model being wrong
   there);
4. the exact target verifies every row exactly as before (one padded forward, ``greedy_verify``).

A row whose cheap cache lags its context by more than ``chunk = max(catch_up, 2 (k + 1))``
tokens (a request that just took its slot: the cheap model has not seen its prompt) only feeds
the next ``chunk`` tokens of its context in that forward and keeps its whole block, so one new
request does not widen the cheap forward of every row to its prompt length; a context grows by at
most ``k + 1`` tokens a step, so the lag shrinks every step the pre-filter runs.

**Why it is lossless.** The pre-filter only shortens blocks: the wrapper keeps a prefix of each
row's own drafts (clamped to ``0..n``, whatever the pre-filter returns), a prefix of a draft is a
draft, and the unchanged exact verify commits the longest drafted prefix equal to the exact
target's argmax plus the exact target's bonus token. So every committed token is the exact
target's argmax given the committed prefix, whatever the cheap model outputs (the tests replace
it by random tokens). The cheap model's KV cache is its own, so nothing it does reaches the
target's cache. A cut block can commit fewer tokens in a step, never different ones.

**What it saves, what it costs.** At large batch the padded verify (rows x (1 + drafts) tokens) is
compute-bound: its time grows with its tokens, so drafts that will be rejected cost real time.
The pre-filter removes the drafts after the cheap model's first disagreement (plus ``margin``)
from the exact verify, so the exact forward computes fewer tokens per step. Its cost is one cheap
forward over the same rows and drafts per step, at FP8 GEMM rate (twice bf16 on FP8 tensor cores;
half the weight bytes), and the tokens the exact target would have accepted past a wrong cheap
disagreement. The dense verify is as wide as its widest row, so it saves only when every row's
block is cut (all rows of a step drafting past their agreement); ``min_batch`` keeps it off at
small batch, where the verify is memory-bound and its width nearly free. On the CPU the FP8 path
is emulated (dequantized weights) and saves nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

from specpilot.drafters.wrapped import FilteredDrafter
from specpilot.errors import SpecPilotError
from specpilot.mechanisms.cheap_scorer import CheapScorer
from specpilot.mechanisms.registry import Applicability, Knob, Mechanism
from specpilot.models.transformer import Transformer

if TYPE_CHECKING:
    from specpilot.mechanisms.parts import EngineParts


@dataclass(slots=True)
class PrefilterStats:
    """Counts over the cycles the pre-filter was asked about."""

    steps: int = 0
    """Steps with at least one drafted row."""
    applied: int = 0
    """Steps with at least ``min_batch`` drafted rows: one cheap forward each."""
    rows: int = 0
    """Row-steps scored by the cheap model (their blocks may be cut)."""
    catch_up_rows: int = 0
    """Drafted row-steps that only fed the cheap cache (it lagged the row's context): not cut."""
    drafted: int = 0
    """Drafts of the scored rows."""
    agreed: int = 0
    """Drafts of the scored rows inside the cheap model's agreed prefix (so ``agreed / drafted``
    is bounded by how often the drafts are right, not only by the cheap model's fidelity)."""
    cut: int = 0
    """Drafts removed before the exact verify."""

    def as_dict(self) -> dict[str, float]:
        return {
            **asdict(self),
            "agreed_frac": self.agreed / max(self.drafted, 1),
            "cut_frac": self.cut / max(self.drafted, 1),
        }


class Fp8Prefilter:
    """A ``DraftFilter``: cut each row's block to the cheap model's agreed prefix + margin."""

    def __init__(
        self, cheap: Transformer, margin: int = 1, min_batch: int = 8, catch_up: int = 64
    ) -> None:
        if margin < 0:
            raise ValueError(f"margin must be at least 0, got {margin}")
        if min_batch < 1:
            raise ValueError(f"min_batch must be at least 1, got {min_batch}")
        if catch_up < 1:
            raise ValueError(f"catch_up must be at least 1, got {catch_up}")
        self.cheap = cheap
        self.scorer = CheapScorer(cheap)
        self.margin = margin
        self.min_batch = min_batch
        self.catch_up = catch_up
        """Context tokens a lagging row feeds the cheap cache per step (at least 2 (k + 1))."""
        self.stats = PrefilterStats()

    def reset(self) -> None:
        """Forget every row's cheap K/V and zero the stats (a bench's next timed run)."""
        with torch.inference_mode():
            self.scorer.start(self.scorer.rows)
        self.stats = PrefilterStats()

    def __call__(
        self, contexts: Sequence[Sequence[int] | None], drafts: Sequence[Sequence[int]]
    ) -> list[int]:
        keep = [len(d) for d in drafts]
        rows = [
            r for r, (c, d) in enumerate(zip(contexts, drafts, strict=True)) if c is not None and d
        ]
        if not rows:
            return keep
        self.stats.steps += 1
        if len(rows) < self.min_batch:
            return keep
        self.stats.applied += 1
        b = rows[-1] + 1  # the scorer's rows are the batch's rows 0..b-1
        chunk = max(self.catch_up, 2 * (1 + max(len(d) for d in drafts)))
        if self.scorer.rows < len(drafts):  # one cheap cache row per slot, kept across steps
            self.scorer.start(len(drafts))
        seqs: list[list[int]] = []
        first: list[int] = []
        scored: list[int] = []
        for r in range(b):
            ctx, d = contexts[r], drafts[r]
            held = self.scorer.cached(r)
            common = 0 if ctx is None else _common_prefix(held, ctx)
            if ctx is None:  # free or in prefill: refeed the row's last cached token, keep its K/V
                seq = held or [0]
            elif len(ctx) - common > chunk:  # lagging: feed a chunk of its context only
                seq = list(ctx[: common + chunk])
                self.stats.catch_up_rows += int(bool(d))
            elif not d:  # decoding without drafts this step: the cheap cache catches up
                seq = list(ctx)
            else:
                seqs.append([*ctx, *d])
                first.append(len(ctx))
                scored.append(r)
                continue
            seqs.append(seq)
            first.append(len(seq))
        greedy = self.scorer.greedy_after(seqs, first)
        for r in scored:
            d = drafts[r]
            agreed = 0
            while agreed < len(d) and d[agreed] == greedy[r][agreed]:
                agreed += 1
            keep[r] = min(len(d), agreed + self.margin)
            st = self.stats
            st.rows += 1
            st.drafted += len(d)
            st.agreed += agreed
            st.cut += len(d) - keep[r]
        return keep


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n, limit = 0, min(len(a), len(b))
    while n < limit and a[n] == b[n]:
        n += 1
    return n


def _apply(build: EngineParts, knobs: Mapping[str, Any]) -> None:
    from specpilot.mechanisms.fp8_copy import fp8_model

    if build.drafter is None:
        raise SpecPilotError("The FP8 pre-filter needs a drafter; choose one with --drafter.")
    keep = Fp8Prefilter(
        fp8_model(build.target.model), int(knobs["margin"]), int(knobs["min_batch"])
    )
    build.drafter = FilteredDrafter(build.drafter, keep, "fp8-prefilter")


MECHANISM = Mechanism(
    name="fp8-prefilter",
    component="verify",
    plug_point="drafter_schedule",
    lossless=(
        "The FP8 copy only shortens each row's drafted block (to the prefix it agrees with plus "
        "a margin; the wrapper keeps a prefix of the row's own drafts whatever it says); the "
        "exact target then verifies every row with the unchanged chain verify, committing only "
        "drafts equal to its own argmax plus its own bonus token. The cheap model has its own KV "
        "cache, rolled back to the common prefix."
    ),
    apply=_apply,
    knobs=(
        Knob("margin", 1, low=0, high=4, doc="drafts kept past the cheap model's agreed prefix"),
        Knob("min_batch", 8, low=1, high=64, doc="apply only with at least this many drafted rows"),
    ),
    # FP8 tensor cores (CUDA, capability >= 8.9) make the cheap forward cheap; on the CPU the FP8
    # path is emulated and costs as much as the exact forward it is meant to shorten. Measured on
    # the H200 (8B shape, 8 layers, concurrency 16-24): 0.44-0.75x, because the eager scheduler
    # pads its verify to the widest row; the tuner measures it before picking it.
    applies=Applicability(devices=("cuda",), drafters=("ngram", "draft-model"), modes=("batched",)),
    summary="FP8 copy of the target cuts each row's block before a large batched exact verify",
)

__all__ = ["MECHANISM", "Fp8Prefilter", "PrefilterStats"]
