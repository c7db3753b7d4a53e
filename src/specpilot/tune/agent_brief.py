"""What an agent is told each round: a compact brief, and the JSON schema its answer must follow.

The brief holds the deployment, the cost model's ranked gaps with their numbers, the searchable
directions with their knobs, ranges and lossless argument (a mechanism's own words), what the
memory validated on similar deployments, this run's trials so far (with the first mismatch of a
rejected one), the reasons the agents' last proposals were rejected, and the direction this
agent works this round. It is plain text, a few hundred tokens for the embedded default, so
that a small local model can take it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from specpilot.engine.config import EngineConfig
from specpilot.mechanisms import MECHANISMS, Knob
from specpilot.tune.space import Direction, describe

if TYPE_CHECKING:
    from specpilot.memory.store import TrialRow

SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["proposals"],
    "properties": {
        "proposals": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["direction", "knobs", "hypothesis"],
                "properties": {
                    "direction": {"type": "string", "description": "your direction's name"},
                    "knobs": {"type": "object", "description": "knob name -> value"},
                    "k": {"type": "integer", "description": "draft length, if it has a k knob"},
                    "hypothesis": {"type": "string", "description": "one line: why faster here"},
                },
            },
        }
    },
}
"""The answer's JSON schema, as the brief states it (``agent_parse.py`` checks every field)."""

BUILTIN_LOSSLESS = {
    "draft-length": "changes how many tokens are drafted; the target verifies every one",
    "ngram-sizes": "changes what is drafted, never what is committed: the target verifies",
    "learned-drafter": "another drafter; its tokens are verified by the target's argmax",
    "early-exit-drafter": "the target's first layers draft; the full target verifies",
    "spec-gate": "pauses drafting; AR steps commit the target's argmax themselves",
    "segment-tokens": "how many prompt tokens a new request feeds per step: no value changes",
}
"""Why the knob directions cannot change a token (mechanisms state their own)."""

LOSSLESS_CHARS = 180
"""A lossless argument is cut to this many characters in the brief."""


@dataclass(frozen=True, slots=True)
class BriefContext:
    """What stays the same all run: given once by ``tune`` when the team is made."""

    deployment: str
    """One line: target, architecture, drafter, device, dtype, mode, stock AR tok/s."""
    gaps: tuple[str, ...] = ()
    """Ranked gaps, largest first, each with its number (``component 3.1 ms/token (45%)``)."""
    similar: tuple[str, ...] = ()
    """Validated configs of similar deployments in memory: ``label: config → speedup``."""
    not_searched: dict[str, str] = field(default_factory=dict)
    """Registered mechanisms that do not apply here, by name, with the reason."""


def knob_text(k: Knob) -> str:
    if k.choices:
        values = "|".join(json.dumps(c) for c in k.choices)
        return f"{k.name} in {{{values}}} (default {json.dumps(k.default)})"
    kind = "int" if isinstance(k.default, int) else "float"
    return f"{k.name} {kind} [{k.low:g}, {k.high:g}] (default {k.default:g})"


def lossless_of(d: Direction) -> str:
    if d.name.startswith("mechanism:"):
        text = " ".join(MECHANISMS[d.name.split(":", 1)[1]].lossless.split())
    else:
        text = BUILTIN_LOSSLESS.get(d.name, "verified by token forcing")
    return text if len(text) <= LOSSLESS_CHARS else text[: LOSSLESS_CHARS - 1] + "…"


def direction_lines(directions: Sequence[Direction]) -> list[str]:
    out = []
    for d in directions:
        knobs = "; ".join(knob_text(k) for k in d.params) or "no knobs"
        out.append(
            f"- {d.name} (attacks {', '.join(d.attacks)}): {knobs}. Lossless: {lossless_of(d)}"
        )
    return out


def trial_line(row: TrialRow) -> str:
    m = row.metrics
    try:
        what = describe(EngineConfig.from_dict(row.config))
    except Exception:
        what = row.config_hash
    if m.get("error"):
        verdict = f"FAILED ({m['error']})"
    elif not row.forcing_ok:
        first = row.forcing.get("first_mismatch", {})
        verdict = f"REJECTED by token forcing (first mismatch at {first.get('position', '?')})"
    elif m.get("anomaly"):
        verdict = "anomaly (speedup above the cost model's bound): never a winner"
    else:
        rounds = m.get("speedup_rounds") or [m["speedup"]]
        verdict = f"{m['speedup']:.2f}x ({min(rounds):.2f}-{max(rounds):.2f}), tau {m['tau']:.2f}"
    return f"- r{row.round} {row.explorer}: {what} -> {verdict}"


def brief_messages(
    ctx: BriefContext,
    directions: Sequence[Direction],
    mine: Direction,
    best: EngineConfig,
    rows: Sequence[TrialRow],
    feedback: Sequence[str],
    n: int,
) -> list[dict[str, str]]:
    """The chat messages of one agent's call: a system line, then the brief."""
    system = (
        "You are a performance engineer tuning a lossless greedy speculative decoder. Answer "
        "with one JSON object only, no prose."
    )
    parts = [
        f"Deployment: {ctx.deployment}.",
        "Every proposal is measured against plain autoregressive decoding in the same process "
        "(interleaved rounds, median with spread) and token-forced: a proposal that changes one "
        "committed token is rejected. A winner must beat the best by more than both spreads.",
        "Cost-model gaps, largest first: " + ("; ".join(ctx.gaps) or "not profiled (static order)"),
        "Directions (knobs with ranges; why each is lossless):",
        *direction_lines(directions),
    ]
    if ctx.not_searched:
        parts.append(
            "Not applicable here: " + "; ".join(f"{k}: {v}" for k, v in ctx.not_searched.items())
        )
    if ctx.similar:
        parts += ["Validated on similar deployments (memory):", *[f"- {s}" for s in ctx.similar]]
    parts.append(f"Current best config: {describe(best)}.")
    parts += ["Trials so far in this run:", *([trial_line(r) for r in rows] or ["- none yet"])]
    if feedback:
        parts += [
            "Your earlier proposals that were rejected, and why:",
            *[f"- {f}" for f in feedback],
        ]
    parts += [
        f"Your direction this round: {mine.name}. Propose at most {n} new settings of its knobs "
        "that differ from every config above, each with a one-line hypothesis.",
        "Answer with JSON following this schema: " + json.dumps(SCHEMA, separators=(",", ":")),
        'Example: {"proposals": [{"direction": "'
        + mine.name
        + '", "knobs": {'
        + ", ".join(f'"{k.name}": {json.dumps(k.default)}' for k in mine.params)
        + '}, "hypothesis": "..."}]}',
    ]
    return [{"role": "system", "content": system}, {"role": "user", "content": "\n".join(parts)}]


__all__ = ["SCHEMA", "BriefContext", "brief_messages", "direction_lines", "trial_line"]
