"""Held-out τ of a drafter in training, measured by the real engine (the one the commands run).

``TauMeter`` keeps one engine with the recipe's drafter (a copy of the network in the target's
dtype) and one scheduler over it, so that CUDA graphs captured on the first measurement replay on
every later one; ``measure`` copies the training weights in (``sync``) and decodes every held-out
prompt greedily. τ is committed tokens per verify forward, bonus included.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from specpilot.drafters.base import Drafter
from specpilot.engine import Engine, Request, Scheduler
from specpilot.engine.stats import AcceptanceStats
from specpilot.models.transformer import Transformer


class TauMeter:
    def __init__(
        self,
        target: Transformer,
        drafter: Drafter,
        sets: Mapping[str, Sequence[Sequence[int]]],
        max_new: int,
        eos: Sequence[int],
        batch: int,
        graphs: bool,
    ) -> None:
        self.sets = {name: [list(p) for p in prompts] for name, prompts in sets.items() if prompts}
        self.max_new = max_new
        self.stop = frozenset(eos)
        longest = max((len(p) for ps in self.sets.values() for p in ps), default=1)
        need = longest + max_new
        margin = Engine(target, drafter, graphs=graphs).context_margin()
        engine = Engine(target, drafter, graphs=graphs, capacity=need + margin + 8)
        self.scheduler = Scheduler(engine, slots=max(1, batch), max_context=need)

    def measure(self, sync: Callable[[], None] = lambda: None) -> dict[str, float]:
        """τ per held-out set (and ``all``), after ``sync`` brought the drafter's weights."""
        sync()
        out: dict[str, float] = {}
        total = AcceptanceStats()
        for name, prompts in self.sets.items():
            reqs = [
                Request(f"{name}/{i}", tuple(p), self.max_new, self.stop)
                for i, p in enumerate(prompts)
            ]
            stats = AcceptanceStats()
            for res in self.scheduler.run(reqs):
                stats.merge(res.stats)
            out[name] = stats.mean_accepted_len
            total.merge(stats)
        out["all"] = total.mean_accepted_len
        return out
