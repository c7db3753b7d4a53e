"""Two-level verification: an INT8 copy of the target corrects the draft before the exact verify.

This module is the host variant (for host drafters: n-gram) and the mechanism; ``wrap`` hands a
graph-safe drafter to the device variant (``two_level_device``: the same block rule inside the
captured draft step, the cheap KV cache at the target's slots).

Variant built (*correct*, optionally *extend*), per row and cycle:

1. the inner drafter (n-gram, draft model, ...) proposes ``d_1..d_k``;
2. the cheap model (``int8_copy.cheap_model``: the target's weights in per-channel INT8, ~half the
   bytes) runs **once** on the context tail and ``d_1..d_k`` and gives its greedy token ``c_i``
   after each prefix ``d_1..d_i`` (i = 0..k);
3. the block keeps the agreed prefix ``d_1..d_n`` (``d_i == c_{i-1}``) and ends with ``c_n``: the
   cheap model's replacement of the first disagreeing token, or, when it agrees with all k, its
   own next token (free: the same forward computed it);
4. ``correct-extend`` only: the cheap model then appends its greedy tokens one forward (of one
   token) at a time, up to ``max_extension`` more;
5. the exact target verifies the block as usual (the chain verify plan, ``greedy_verify``).

**Why it is lossless.** Steps 1–4 only choose which tokens the exact target is asked about; step
5 is the unchanged chain verify, which commits the longest prefix equal to the exact target's own
argmax plus its own bonus token. So every committed token is the exact target's argmax given the
committed prefix, whatever the cheap model outputs (the tests replace it by random tokens). The
cheap model's KV cache is its own (``CheapScorer``), rolled back to the common prefix of what it
fed and what the engine committed, so nothing it does can reach the target's cache.

**Why this variant.** The exact verify of a block of ≤ 16–32 tokens costs about one weight pass
on a memory-bound GPU, whatever the block holds; the win of a cycle is its committed tokens. With
the drafter right for ``m`` tokens, one-level commits ``m + 1``; the corrected block commits
``m + 2`` when the cheap model agrees with the exact target at the first ``m + 1`` positions
(probability ≈ a^(m+1) for a per-token agreement a; ~0.99+ for INT8 of bf16), and the extension
adds the cheap model's own run of agreeing tokens (it is then a self-speculative INT8 drafter on
top of the inner one). Costs: one cheap forward over ``1 + k`` rows (~0.5 of an exact verify in
weight bytes) plus one cheap one-row forward per extension token. Pruning instead (sending fewer
positions to the exact verify) saves nothing where the verify cost is flat in its width, and
choosing the verify width needs no model at all, so both were set aside. ``two_level_cost``
predicts both sides; roughly, correction pays when the one-level τ is below ~2 (the +1 token per
cycle must beat the ~1.5× cycle), and loses when the drafter already agrees with the target
(high τ), when the verify is not memory-bound (the CPU: the cheap level is not cheaper there),
or when the cheap model is far from the target.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

from specpilot.drafters.base import Drafter, DraftRows
from specpilot.drafters.wrapped import WrappedDrafter
from specpilot.errors import SpecPilotError
from specpilot.mechanisms.cheap_scorer import CheapScorer, idle_safe
from specpilot.mechanisms.registry import Applicability, ConfigView, Knob, Mechanism
from specpilot.mechanisms.two_level_device import DeviceTwoLevelDrafter, two_level_k
from specpilot.models.transformer import Transformer

if TYPE_CHECKING:
    from specpilot.mechanisms.parts import EngineParts

VARIANTS = ("correct", "correct-extend")


@dataclass(slots=True)
class TwoLevelStats:
    """Counts over every proposed row-cycle (inactive rows excluded)."""

    rows: int = 0
    """Row-cycles proposed."""
    drafted: int = 0
    """Tokens the inner drafter proposed."""
    kept: int = 0
    """Drafted tokens the cheap model agreed with (the kept prefixes)."""
    replaced: int = 0
    """Row-cycles where the cheap model replaced a drafted token."""
    appended: int = 0
    """Cheap tokens put in blocks: replacements, free next tokens and extensions."""
    forwards: int = 0
    """Cheap-model forwards (one per block, one per extension step; each covers every row)."""

    def merge(self, other: TwoLevelStats) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "kept_frac": self.kept / max(self.drafted, 1)}


class TwoLevelDrafter(WrappedDrafter):
    """Wraps any :class:`Drafter`: its proposals are corrected (and extended) by a cheap model."""

    def __init__(self, inner: Drafter, cheap: Transformer, max_extension: int = 0) -> None:
        super().__init__(inner, f"{inner.name}+two-level", two_level_k(inner, max_extension))
        self.cheap = cheap
        self.scorer = CheapScorer(cheap)
        self.max_extension = max_extension
        self.stats = TwoLevelStats()

    def bind(self, rows: DraftRows) -> None:
        super().bind(rows)
        self.scorer.start(rows.state.batch_size)

    def propose(self, rows: DraftRows, attn_len: int) -> list[int]:
        drafts = self.inner_drafts(rows, attn_len)
        contexts, active = rows.contexts, rows.active
        live = [b for b, a in enumerate(active) if a]
        blocks: list[list[int]] = [[] for _ in contexts]
        room = self.k
        if live:
            greedy = self.scorer.greedy_after(*idle_safe(self.scorer, contexts, active, drafts))
            self.stats.forwards += 1
            for b in live:
                n = 0
                while n < len(drafts[b]) and drafts[b][n] == greedy[b][n]:
                    n += 1
                blocks[b] = [*drafts[b][:n], greedy[b][n]][:room]
                self._count(drafts[b], n)
            for _ in range(self.max_extension):
                grow = [b for b in live if len(blocks[b]) < room]
                if not grow:
                    break
                nxt = self.scorer.greedy_after(
                    *idle_safe(self.scorer, contexts, active, blocks, from_end=True)
                )
                self.stats.forwards += 1
                for b in grow:
                    blocks[b].append(nxt[b][0])
                    self.stats.appended += 1
        return rows.write_drafts(blocks)

    def _count(self, drafted: list[int], n: int) -> None:
        st = self.stats
        st.rows += 1
        st.drafted += len(drafted)
        st.kept += n
        st.replaced += int(n < len(drafted))
        st.appended += 1


DEVICE_MAX_M = 256
"""Rows per call up to which the device variant's cheap copy reads INT8 (its block forward has
``batch * (k + 2)`` rows; the host variant's default of 64 would send a batch of 8 at block 8
to the exact weights). Longer prompt segments still prefill with the exact weights."""


def wrap(
    drafter: Drafter, target: Transformer, variant: str, max_extension: int
) -> TwoLevelDrafter | DeviceTwoLevelDrafter:
    """``drafter`` corrected by an INT8 copy of ``target`` (built here, sharing its tensors):
    inside the captured draft step for a graph-safe drafter (``two_level_device``), on the
    host otherwise."""
    from specpilot.mechanisms.int8_copy import cheap_model

    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    extension = max_extension if variant == "correct-extend" else 0
    if drafter.graph_safe:
        return DeviceTwoLevelDrafter(drafter, cheap_model(target, DEVICE_MAX_M), extension)
    return TwoLevelDrafter(drafter, cheap_model(target), extension)


def _apply(build: EngineParts, knobs: Mapping[str, Any]) -> None:
    if build.drafter is None:
        raise SpecPilotError("two-level verification needs a drafter; choose one with --drafter.")
    build.drafter = wrap(
        build.drafter, build.target.model, knobs["variant"], int(knobs["max_extension"])
    )


GRAPH_SAFE_DRAFTERS = ("draft-model", "block", "dflash", "dflash2", "eagle3")
"""Drafters whose proposal is device work: corrected inside the captured draft step."""


def _screen(config: ConfigView) -> str | None:
    """The cost model's verdict where the acceptance is known in advance (a simulated profile,
    with the mechanism's knobs as the tuner starts them); None otherwise: the trial measures."""
    from specpilot.drafters.simulated import AcceptanceProfile
    from specpilot.mechanisms.two_level_cost import screen

    text = config.deployment.simulate_acceptance
    if text is None:
        return None
    knobs = config.mechanisms.get("two-level", {})
    ext = int(knobs.get("max_extension", 4)) if knobs.get("variant") == "correct-extend" else 0
    return screen(AcceptanceProfile.parse(text).survival(), ext)


MECHANISM = Mechanism(
    name="two-level",
    component="verify",
    plug_point="verify_strategy",
    lossless=(
        "The INT8 copy only rewrites the drafted block (keeps the prefix it agrees with, replaces "
        "the first disagreement by its own greedy token, optionally extends); the exact target then "
        "verifies the block with the unchanged chain verify, so it has the final word on every "
        "committed token. The cheap model has its own KV cache: rolled back to the common "
        "prefix (host drafters), or kept at the target's slots and re-fed from C - 2 each cycle "
        "(graph-safe drafters)."
    ),
    apply=_apply,
    knobs=(
        Knob("bits", 8, choices=(8,), doc="bits per weight of the cheap copy (INT8 only)"),
        Knob(
            "variant",
            "correct",
            choices=VARIANTS,
            doc="correct: fix the first disagreement (or add the cheap next token); "
            "correct-extend: then append cheap greedy tokens one forward each",
        ),
        Knob(
            "max_extension",
            4,
            low=1,
            high=16,
            doc="cheap greedy tokens appended after the correction (correct-extend only)",
        ),
    ),
    # Memory-bound verify (cuda, bf16) is where the cheap level is ~half an exact verify; on the
    # CPU the reference dequantizes per call and costs more than the exact forward. Host drafters
    # (n-gram) through the host wrapper, graph-safe ones (draft model, block / DFlash, EAGLE-3)
    # inside the captured draft step (two_level_device). It still loses where the drafter already
    # agrees with the target (one-level tau above ~2 for ``correct``): the screen asks
    # two_level_cost under a simulated profile; with real acceptance the tuner's trial measures.
    # H200 (docs/BENCHMARKS.md, third session, host variant): SmolLM2 real acceptance doubles tau
    # per exact verify on mt-bench (0.79-1.08x one-level speed, within noise) and loses on
    # copy-heavy (0.34-0.44x), as predicted. The device variant is not measured yet.
    applies=Applicability(
        devices=("cuda",), dtypes=("bf16", "bfloat16"), drafters=(*GRAPH_SAFE_DRAFTERS, "ngram")
    ),
    summary="INT8 copy of the target corrects (and extends) each draft before the exact verify",
    screen=_screen,
)

__all__ = [
    "GRAPH_SAFE_DRAFTERS",
    "MECHANISM",
    "VARIANTS",
    "TwoLevelDrafter",
    "TwoLevelStats",
    "wrap",
]
