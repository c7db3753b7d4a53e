"""What a proposer hands the search loop: a candidate config, and how it is told the result."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from specpilot.engine.config import EngineConfig

if TYPE_CHECKING:
    from specpilot.memory.store import TrialRow
    from specpilot.tune.space import Direction


@dataclass(slots=True)
class Proposal:
    explorer: str
    params: dict[str, Any]
    config: EngineConfig
    trial_number: int


class Proposer(Protocol):
    """Anything that proposes candidate engine configs around a base and learns from results.

    The TPE ``Explorer`` below is one; an LLM coding agent can be another (returning configs, or
    configs that name a mechanism its patch registers): every proposal goes through the same
    evaluator and token-forcing gate, so a proposer needs no trust.
    """

    @property
    def name(self) -> str: ...

    def propose(self, base: EngineConfig, n: int) -> list[Proposal]: ...

    def tell(self, trial_number: int, speedup: float) -> None: ...


class RoundPlanner(Protocol):
    """Explorers that plan a round together before any of them proposes (the LLM agents of
    ``tune/agent_team.py``: their calls for the round's directions go out in parallel, and each
    direction's explorer then takes its agent's answer). The loop tells it each round's
    directions; it knows nothing else of the loop."""

    def explorer(self, direction: Direction, fallback: Proposer) -> Proposer:
        """The explorer of ``direction``; ``fallback`` (TPE) proposes where the agent does not."""
        ...

    def start_round(
        self,
        round_: int,
        picked: Sequence[Direction],
        best: EngineConfig,
        rows: Sequence[TrialRow],
        deadline: float,
    ) -> None:
        """A round starts: its directions, the config they start from, this run's trials so far,
        and the budget's deadline (``time.perf_counter()`` seconds)."""
        ...
