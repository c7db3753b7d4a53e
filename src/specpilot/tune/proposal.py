"""What a proposer hands the search loop: a candidate config, and how it is told the result."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from specpilot.engine.config import EngineConfig


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
