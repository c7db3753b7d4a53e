"""What the search loop (``tune/loop.py``) is given and gives back: its settings, every trial
it ran, and the outcome of a search."""

from __future__ import annotations

from dataclasses import dataclass, field

from specpilot.tune.agent_price import AgentPrice, AgentRecord
from specpilot.tune.evaluate import TrialResult
from specpilot.tune.usage import Usage


@dataclass(frozen=True, slots=True)
class TuneSettings:
    rounds: int = 3
    """Most search rounds after round 0."""
    trials_per_direction: int = 3
    directions_per_round: int = 3
    budget_seconds: float = 1800.0
    min_gain: float = 0.02
    """A winner must beat the best by more than both spreads and by this fraction of it."""
    seed: int = 0
    explorer: str = "auto"
    """Knob proposer: ``tpe`` (Optuna), ``local`` (local search, no dependency), ``auto``."""
    patience: int = 1
    """Rounds a direction may go without a winner (since the last improvement) before it counts
    as exhausted; the loop stops when every direction is exhausted."""


@dataclass(slots=True)
class Trial:
    round: int
    explorer: str
    result: TrialResult
    reused_from: str | None = None
    elapsed: float = 0.0
    """Seconds since the loop started when this trial finished (0 for one reused on resume)."""


@dataclass(slots=True)
class TuneOutcome:
    stock: TrialResult
    best: TrialResult
    ar_tok_s: float
    trials: list[Trial] = field(default_factory=list)
    reused: list[str] = field(default_factory=list)
    wall_seconds: float = 0.0
    device_seconds: float = 0.0
    rounds_run: int = 0
    unexplored: list[str] = field(default_factory=list)
    """Directions the budget ran out before (never measured), for the log and the report."""
    usage: Usage = field(default_factory=lambda: Usage("local", "cpu"))
    """Workers and the busy seconds summed over them (the executor's, ``tune/usage.py``)."""
    agent: AgentPrice | None = None
    """What the LLM agents cost (``tune --agent``); None without agents."""
    agent_records: list[AgentRecord] = field(default_factory=list)
    """The agents' proposals that passed validation, with their hypotheses."""
