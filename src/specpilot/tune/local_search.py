"""A proposer that needs no Optuna: seeded local search over a direction's knobs.

Used when Optuna is not installed (e.g. a GPU machine without the ``tune`` extra). The first
proposals are the direction's defaults and seeds, like the TPE explorer; later ones are neighbours of the best
parameters told back so far (one knob moved one step: the next choice, or ±1 on an int range, ±10%
of the range on a float), then random unvisited points once the neighbourhood is exhausted. It
never proposes a point it has already proposed. It is a plain hill climber, not a model-based
sampler: on a small space it is honest and cheap, on a large one TPE should do better.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from specpilot.engine.config import EngineConfig
from specpilot.mechanisms import Knob, canonical
from specpilot.tune.proposal import Proposal
from specpilot.tune.space import Direction


def _neighbours(knob: Knob, value: Any) -> list[Any]:
    """Values one step from ``value`` along ``knob``."""
    if knob.choices:
        ch = list(knob.choices)
        if value not in ch:
            return ch
        i = ch.index(value)
        return [ch[j] for j in (i - 1, i + 1) if 0 <= j < len(ch)]
    assert knob.low is not None and knob.high is not None
    if isinstance(knob.default, (bool, int)):
        return [v for v in (int(value) - 1, int(value) + 1) if knob.low <= v <= knob.high]
    step = (knob.high - knob.low) / 10
    return [min(max(float(value) + d, knob.low), knob.high) for d in (-step, step)]


def _random_value(knob: Knob, rng: random.Random) -> Any:
    if knob.choices:
        return rng.choice(list(knob.choices))
    assert knob.low is not None and knob.high is not None
    if isinstance(knob.default, (bool, int)):
        return rng.randint(int(knob.low), int(knob.high))
    return rng.uniform(float(knob.low), float(knob.high))


@dataclass
class LocalSearchExplorer:
    direction: Direction
    seed: int = 0
    _rng: random.Random = field(init=False, repr=False)
    _proposed: dict[int, dict[str, Any]] = field(default_factory=dict, init=False, repr=False)
    _scores: dict[int, float] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    @property
    def name(self) -> str:
        return self.direction.name

    def _key(self, params: dict[str, Any]) -> str:
        return repr(sorted(params.items()))

    def _candidates(self) -> list[dict[str, Any]]:
        """Unvisited neighbours of the best told point (or of the defaults), best first."""
        knobs = self.direction.params
        if self._scores:
            best = self._proposed[max(self._scores, key=lambda n: self._scores[n])]
        else:
            best = {k.name: k.default for k in knobs}
        out = []
        for knob in knobs:
            for v in _neighbours(knob, best[knob.name]):
                out.append({**best, knob.name: v})
        self._rng.shuffle(out)
        return out

    def propose(self, base: EngineConfig, n: int) -> list[Proposal]:
        """Up to ``n`` unvisited points: the defaults and the seeds first, then neighbours of the best told
        point, then random ones. A point that derives ``base`` itself (already measured: the
        loop's best) is skipped."""
        knobs = self.direction.params
        seen = {self._key(p) for p in self._proposed.values()}
        pool: list[dict[str, Any]] = []
        if not self._proposed:
            pool.append({k.name: k.default for k in knobs})
            pool += [dict(seed) for seed in self.direction.seeds]
        if knobs:
            pool += self._candidates()
            pool += [
                {k.name: _random_value(k, self._rng) for k in knobs} for _ in range(50 * max(n, 1))
            ]
        out: list[Proposal] = []
        for params in pool:
            if len(out) >= n:
                break
            params = canonical(knobs, params)  # knobs that do nothing here at their defaults
            key = self._key(params)
            if key in seen:
                continue
            seen.add(key)
            cfg = self.direction.derive(base, params)
            if cfg == base:
                continue
            number = len(self._proposed)
            self._proposed[number] = params
            out.append(Proposal(self.name, params, cfg, number))
        return out

    def tell(self, trial_number: int, speedup: float) -> None:
        if trial_number in self._proposed:
            self._scores[trial_number] = speedup
