"""One explorer per direction: proposes parameter values with Optuna's TPE sampler.

``make_explorer`` picks it when Optuna is installed, else the seeded local search of
``local_search.py`` (no dependency), and says which.

The first proposal of a direction is its defaults (so "just enable the mechanism" is always
tried), then its seeds (points measured better on this device, ``Direction.seeds``); later ones
come from TPE, which learns from every result told back, failed gates included (told as speedup
0, so the sampler moves away from them). A knob that does nothing for the other knobs' values
(``Knob.when``) is held at its default, and no point is proposed twice, nor one that derives the
base config itself (both explorers alike).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specpilot.engine.config import EngineConfig
from specpilot.mechanisms import Knob, canonical
from specpilot.tune.proposal import Proposal, Proposer
from specpilot.tune.space import Direction

__all__ = ["Explorer", "Proposal", "Proposer", "make_explorer", "optuna_available"]


def _distribution(knob: Knob) -> Any:
    import optuna

    if knob.choices:
        return optuna.distributions.CategoricalDistribution(list(knob.choices))
    assert knob.low is not None and knob.high is not None
    if isinstance(knob.default, (bool, int)):
        return optuna.distributions.IntDistribution(int(knob.low), int(knob.high))
    return optuna.distributions.FloatDistribution(float(knob.low), float(knob.high))


@dataclass
class Explorer:
    direction: Direction
    seed: int = 0
    _study: Any = field(default=None, init=False, repr=False)
    _pending: dict[int, Any] = field(default_factory=dict, init=False, repr=False)
    _done: set[str] = field(default_factory=set, init=False, repr=False)
    """Every point proposed so far (canonical), across calls of ``propose``."""

    @property
    def name(self) -> str:
        return self.direction.name

    def _ensure_study(self) -> Any:
        if self._study is None:
            import optuna

            optuna.logging.set_verbosity(optuna.logging.WARNING)
            sampler = optuna.samplers.TPESampler(seed=self.seed, n_startup_trials=3)
            self._study = optuna.create_study(direction="maximize", sampler=sampler)
            if self.direction.params:
                self._study.enqueue_trial({k.name: k.default for k in self.direction.params})
                for seed in self.direction.seeds:
                    self._study.enqueue_trial(dict(seed))
        return self._study

    def propose(self, base: EngineConfig, n: int) -> list[Proposal]:
        import optuna

        study = self._ensure_study()
        dists = {k.name: _distribution(k) for k in self.direction.params}
        out: list[Proposal] = []
        for _ in range(n if dists else 1):
            trial = study.ask(dists)
            # knobs that do nothing for the others' values (``Knob.when``) at their defaults
            params = canonical(self.direction.params, trial.params)
            key = repr(sorted(params.items()))
            cfg = self.direction.derive(base, params)
            # TPE repeats itself: never evaluate a point twice, nor the base (the loop's best)
            if key in self._done or cfg == base:
                study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                continue
            self._done.add(key)
            self._pending[trial.number] = trial
            out.append(Proposal(self.name, params, cfg, trial.number))
        return out

    def tell(self, trial_number: int, speedup: float) -> None:
        trial = self._pending.pop(trial_number, None)
        if trial is not None:
            self._study.tell(trial, speedup)


def optuna_available() -> bool:
    try:
        import optuna  # noqa: F401
    except ImportError:
        return False
    return True


def make_explorer(direction: Direction, seed: int = 0, kind: str = "auto") -> Proposer:
    """The explorer of ``direction``: ``tpe`` (Optuna), ``local`` (no dependency) or ``auto``
    (TPE when Optuna is installed)."""
    if kind == "auto":
        kind = "tpe" if optuna_available() else "local"
    if kind == "tpe":
        return Explorer(direction, seed=seed)
    if kind == "local":
        from specpilot.tune.local_search import LocalSearchExplorer

        return LocalSearchExplorer(direction, seed=seed)
    raise ValueError(f"Unknown explorer kind '{kind}'; choose auto, tpe or local.")
