"""Teacher-forced verdicts: one forward of the stock target per sequence.

For a prompt p and committed tokens c_0..c_{n-1}, the stock target runs once on
``p + c_0..c_{n-2}``; row ``len(p) - 1 + i`` of its logits is the target's view of position i,
given exactly the prefix the engine had. Each committed token gets a verdict:
**match** (it is the argmax; ties go to the lowest id, as ``torch.argmax`` breaks them),
**near-tie** (not the argmax, but within ``near_tie_tolerance``), or **mismatch**.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from specpilot.forcing.tolerance import near_tie_tolerance
from specpilot.models.transformer import Transformer

MATCH, NEAR_TIE, MISMATCH = "match", "near-tie", "mismatch"


@dataclass(slots=True)
class Mismatch:
    """The first mismatch of a sequence, with what a person needs to look into it."""

    position: int  # index into the committed tokens
    token: int
    logit: float
    top5: list[tuple[int, float]]  # (token id, logit), best first
    tolerance: float  # the near-tie tolerance at this position; the gap exceeded it
    context_ids: list[int]  # up to 24 tokens before the position


@dataclass(slots=True)
class SequenceVerdict:
    id: str
    matches: int = 0
    near_ties: int = 0
    mismatches: int = 0
    max_near_tie_gap: float = 0.0
    first_mismatch: Mismatch | None = None

    @property
    def ok(self) -> bool:
        return self.mismatches == 0


@dataclass(slots=True)
class ForcingReport:
    dtype: str
    sequences: list[SequenceVerdict] = field(default_factory=list)

    @property
    def matches(self) -> int:
        return sum(s.matches for s in self.sequences)

    @property
    def near_ties(self) -> int:
        return sum(s.near_ties for s in self.sequences)

    @property
    def mismatches(self) -> int:
        return sum(s.mismatches for s in self.sequences)

    @property
    def ok(self) -> bool:
        return self.mismatches == 0

    def first_mismatch(self) -> tuple[str, Mismatch] | None:
        for s in self.sequences:
            if s.first_mismatch is not None:
                return s.id, s.first_mismatch
        return None

    def summary(self) -> str:
        verdict = "PASS" if self.ok else "FAIL"
        return (
            f"token forcing {verdict}: {self.matches} match, {self.near_ties} near-tie, "
            f"{self.mismatches} mismatch over {len(self.sequences)} sequences ({self.dtype})"
        )

    def totals(self) -> dict[str, Any]:
        """The verdict and its counts, as a command's JSON summary states them."""
        keys = ("ok", "matches", "near_ties", "mismatches")
        return {k: getattr(self, k) for k in keys} | {"summary": self.summary()}

    def to_dict(self, decode: Callable[[list[int]], str] | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "dtype": self.dtype,
            "ok": self.ok,
            "matches": self.matches,
            "near_ties": self.near_ties,
            "mismatches": self.mismatches,
            "sequences": [],
        }
        for s in self.sequences:
            rec: dict[str, Any] = {
                "id": s.id,
                "matches": s.matches,
                "near_ties": s.near_ties,
                "mismatches": s.mismatches,
                "max_near_tie_gap": s.max_near_tie_gap,
            }
            m = s.first_mismatch
            if m is not None:
                rec["first_mismatch"] = {
                    "position": m.position,
                    "token": m.token,
                    "logit": m.logit,
                    "top5": [{"token": t, "logit": lg} for t, lg in m.top5],
                    "tolerance": m.tolerance,
                    "context_ids": m.context_ids,
                }
                if decode is not None:
                    rec["first_mismatch"]["token_text"] = decode([m.token])
                    rec["first_mismatch"]["context_text"] = decode(m.context_ids)
                    for entry in rec["first_mismatch"]["top5"]:
                        entry["text"] = decode([entry["token"]])
            out["sequences"].append(rec)
        return out


@torch.inference_mode()
def force_sequence(
    target: Transformer, seq_id: str, prompt: Sequence[int], committed: Sequence[int]
) -> SequenceVerdict:
    verdict = SequenceVerdict(id=seq_id)
    if not committed:
        return verdict
    ids = list(prompt) + list(committed[:-1])
    cache = target.allocate_cache(1, len(ids))
    dev = target.device
    rows = torch.arange(len(prompt) - 1, len(ids), device=dev)[None, :]  # [1, n]
    out = target(torch.tensor([ids], device=dev), cache, logits_rows=rows)
    logits = out.logits[0].float()  # [n, V]
    assert out.final_hidden is not None
    hidden = out.final_hidden[0].float()  # [n, hidden]
    want = torch.tensor(list(committed), device=dev)  # [n]
    argmax = logits.argmax(dim=-1)  # [n]
    top = logits.gather(1, argmax[:, None]).squeeze(1)  # [n]
    chosen = logits.gather(1, want[:, None]).squeeze(1)  # [n]
    gaps = (top - chosen).tolist()
    is_argmax = (argmax == want).tolist()
    head = target.lm_head  # [V, hidden] (the checkpoint layout)
    for i, (hit, gap) in enumerate(zip(is_argmax, gaps, strict=True)):
        if hit:
            verdict.matches += 1
            continue
        a, t = int(argmax[i]), int(want[i])
        tol = near_tie_tolerance(
            target.dtype,
            target.cfg.num_layers,
            float(hidden[i].norm()),
            float((head[a].float() - head[t].float()).norm()),
            float(top[i]),
            float(chosen[i]),
        )
        if gap <= tol:
            verdict.near_ties += 1
            verdict.max_near_tie_gap = max(verdict.max_near_tie_gap, gap)
        else:
            verdict.mismatches += 1
            if verdict.first_mismatch is None:
                vals, idx = logits[i].topk(5)
                pos_in_ids = len(prompt) + i
                verdict.first_mismatch = Mismatch(
                    position=i,
                    token=int(committed[i]),
                    logit=float(chosen[i]),
                    top5=list(zip(idx.tolist(), vals.tolist(), strict=True)),
                    tolerance=tol,
                    context_ids=list(
                        (list(prompt) + list(committed))[max(0, pos_in_ids - 24) : pos_in_ids]
                    ),
                )
    return verdict


def force_tokens(
    target: Transformer,
    records: Sequence[tuple[str, Sequence[int], Sequence[int]]],  # (id, prompt ids, committed ids)
    progress: Callable[[], None] | None = None,
) -> ForcingReport:
    """Verdicts for every (id, prompt, committed) record under the stock ``target``."""
    report = ForcingReport(dtype=str(target.dtype).removeprefix("torch."))
    for seq_id, prompt, committed in records:
        report.sequences.append(force_sequence(target, seq_id, prompt, committed))
        if progress is not None:
            progress()
    return report
