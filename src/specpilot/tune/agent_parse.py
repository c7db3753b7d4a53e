"""An agent's answer, read and validated: proposals the loop may measure, or reasons they may not.

Nothing an agent writes reaches the engine unchecked. The answer must hold a JSON object (bare,
or in a code fence, or amid prose); each proposal must name the direction this agent works,
only that direction's knobs, each within its range (``Knob.validate``), and derive a config
that is neither the current best nor one already measured or proposed in this run. A
proposal that fails any of these is rejected with one sentence saying why, which the agent is
told in its next brief. A proposal that passes is still only a candidate: the loop measures it
and token-forces it like any other (``tune/loop.py``).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from specpilot.engine.config import EngineConfig
from specpilot.mechanisms import Knob, canonical
from specpilot.tune.space import Direction, config_hash

HYPOTHESIS_CHARS = 160
FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.DOTALL)


@dataclass(slots=True)
class Accepted:
    params: dict[str, Any]
    config: EngineConfig
    hypothesis: str


@dataclass(slots=True)
class Parsed:
    accepted: list[Accepted]
    rejected: list[str]
    """One sentence per rejected proposal (or one for an unreadable answer)."""


def extract_json(text: str) -> Any:
    """The JSON value in ``text``: the whole text, a fenced block, or the outermost ``{...}``.
    Raises ValueError saying what was found instead."""
    candidates = [text.strip(), *FENCE.findall(text)]
    start, end = text.find("{"), text.rfind("}")
    if 0 <= start < end:
        candidates.append(text[start : end + 1])
    for c in candidates:
        try:
            return json.loads(c)
        except ValueError:
            continue
    head = " ".join(text.split())[:80]
    if start < 0:
        raise ValueError(f"the answer holds no JSON object (it began: {head!r})")
    raise ValueError(f"the answer's JSON does not parse (it began: {head!r})")


def _value(knob: Knob, value: Any) -> Any:
    """``value`` for ``knob``, or ValueError with the reason (``Knob.validate`` plus type checks)."""
    if knob.choices:
        return knob.validate(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"knob {knob.name} must be a number, got {value!r}")
    if isinstance(knob.default, int) and value != int(value):
        raise ValueError(f"knob {knob.name} must be an integer, got {value!r}")
    return knob.validate(value)


def _direction_name(raw: Mapping[str, Any], mine: Direction) -> str:
    name = raw.get("direction", raw.get("mechanism", mine.name))
    if not isinstance(name, str):
        raise ValueError(f"direction must be a string, got {name!r}")
    if name != mine.name and f"mechanism:{name}" == mine.name:
        return mine.name  # "w12" for "mechanism:w12"
    return name


def check_proposal(
    raw: Any,
    mine: Direction,
    known: Collection[str],
    not_applicable: Mapping[str, str],
    base: EngineConfig,
) -> Accepted:
    """One proposal, validated for direction ``mine`` around ``base``; ValueError says why not."""
    if not isinstance(raw, dict):
        raise ValueError(f"a proposal must be an object, got {json.dumps(raw)[:60]}")
    name = _direction_name(raw, mine)
    if name != mine.name:
        short = name.removeprefix("mechanism:")
        if short in not_applicable:
            raise ValueError(f"{short} does not apply here: {not_applicable[short]}")
        if name in known or f"mechanism:{name}" in known:
            raise ValueError(f"this agent works {mine.name} this round, not {name}")
        raise ValueError(
            f"unknown direction {name!r}; the directions are {', '.join(sorted(known))}"
        )
    knobs = raw.get("knobs", {})
    if not isinstance(knobs, dict):
        raise ValueError(f"knobs must be an object of knob -> value, got {json.dumps(knobs)[:60]}")
    by_name = {k.name: k for k in mine.params}
    if "k" in raw:
        if "k" not in by_name:
            raise ValueError(f"{mine.name} has no draft length; k belongs to draft-length")
        if "k" in knobs and knobs["k"] != raw["k"]:
            raise ValueError(f"k given twice, as {raw['k']!r} and knobs.k {knobs['k']!r}")
        knobs = {**knobs, "k": raw["k"]}
    extra = sorted(set(knobs) - set(by_name))
    if extra:
        has = ", ".join(by_name) or "none"
        raise ValueError(f"{mine.name} has no knob(s) {', '.join(extra)} (it has: {has})")
    params = {
        k.name: _value(k, knobs[k.name]) if k.name in knobs else k.default for k in mine.params
    }
    params = canonical(mine.params, params)
    config = mine.derive(base, params)
    hypothesis = raw.get("hypothesis", "")
    hypothesis = " ".join(str(hypothesis).split())[:HYPOTHESIS_CHARS]
    return Accepted(params, config, hypothesis)


def parse_answer(
    text: str,
    mine: Direction,
    known: Collection[str],
    not_applicable: Mapping[str, str],
    base: EngineConfig,
    seen: Collection[str],
    n: int,
) -> Parsed:
    """Every proposal in ``text`` for ``mine``, validated; ``seen``: config hashes measured or
    proposed in this run (a repeat is rejected); at most ``n`` are accepted."""
    try:
        value = extract_json(text)
    except ValueError as e:
        return Parsed([], [str(e)])
    if isinstance(value, dict) and "proposals" not in value and "knobs" in value:
        value = {"proposals": [value]}  # one proposal, unwrapped
    if isinstance(value, list):
        value = {"proposals": value}
    if not isinstance(value, dict) or not isinstance(value.get("proposals"), list):
        return Parsed([], ['the answer is JSON but not {"proposals": [...]}'])
    accepted: list[Accepted] = []
    rejected: list[str] = []
    taken = set(seen) | {config_hash(base)}
    for raw in value["proposals"]:
        what = json.dumps(raw, separators=(",", ":"))[:100]
        try:
            a = check_proposal(raw, mine, known, not_applicable, base)
        except (ValueError, TypeError) as e:
            rejected.append(f"{what}: {e}")
            continue
        h = config_hash(a.config)
        if a.config == base:
            rejected.append(f"{what}: that is the current best config itself")
        elif h in taken:
            rejected.append(f"{what}: repeated, this config was already measured or proposed")
        elif len(accepted) >= n:
            rejected.append(f"{what}: beyond the {n} proposals asked for")
        else:
            taken.add(h)
            accepted.append(a)
    if not accepted and not rejected:
        rejected.append("the answer holds no proposal")
    return Parsed(accepted, rejected)


__all__ = ["Accepted", "Parsed", "check_proposal", "extract_json", "parse_answer"]
