"""What the agents cost and what they proposed, for ``tune``'s report and ``run.json``.

:class:`AgentPrice` adds up every call of every agent (calls, failures, prompt and completion
tokens as the endpoint reported them, seconds waited, and of those the seconds the search stood
still); the report prints it beside the device-seconds and the break-even. :class:`AgentRecord`
is one proposal the agents made that passed validation, with its hypothesis, so the report can
put its measured verdict beside it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields
from typing import Any

from specpilot.tune.agent_client import AgentFailure, AgentReply


@dataclass(slots=True)
class AgentRecord:
    round: int
    direction: str
    config: str
    """``space.describe`` of the proposed config."""
    config_hash: str
    hypothesis: str


@dataclass(slots=True)
class AgentPrice:
    """What the agents cost in one tune: every figure summed over calls and agents."""

    model: str
    url: str
    agents: int
    calls: int = 0
    failed_calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    calls_without_usage: int = 0
    """Answered calls whose endpoint reported no token counts (not in the sums)."""
    wait_seconds: float = 0.0
    """Seconds from request to answer, summed over calls (parallel calls overlap)."""
    blocked_seconds: float = 0.0
    """Seconds the search stood still waiting for an agent (the rest overlapped measuring)."""
    proposals: int = 0
    """Proposals the agents made; ``rejected`` of them failed validation, ``measured`` ran."""
    rejected: int = 0
    measured: int = 0
    kernels: int = 0
    """Kernel sources proposed to the kernel sandbox (``tune/kernel_agent.py``)."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record(self, outcome: AgentReply | AgentFailure) -> None:
        with self._lock:
            self.calls += 1
            self.wait_seconds += outcome.seconds
            if isinstance(outcome, AgentFailure):
                self.failed_calls += 1
            elif outcome.prompt_tokens is None or outcome.completion_tokens is None:
                self.calls_without_usage += 1
            else:
                self.prompt_tokens += outcome.prompt_tokens
                self.completion_tokens += outcome.completion_tokens

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}

    def summary(self) -> str:
        tokens = f"{self.prompt_tokens:,} prompt + {self.completion_tokens:,} completion tokens"
        if self.calls_without_usage:
            tokens += f" ({self.calls_without_usage} calls reported none)"
        return (
            f"agent {self.model} at {self.url} ({self.agents} in parallel): {self.calls} calls "
            f"({self.failed_calls} failed), {tokens}; {self.wait_seconds:.1f} s waiting on the "
            f"agent, {self.blocked_seconds:.1f} s of it with the search standing still; "
            f"{self.proposals} proposals, {self.rejected} rejected by validation, "
            f"{self.measured} measured"
            + (f"; {self.kernels} kernel source(s) judged in the sandbox" if self.kernels else "")
        )


__all__ = ["AgentPrice", "AgentRecord"]
