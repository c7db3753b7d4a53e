"""The one engine: rows, the propose → verify → accept → commit cycle (plain AR is its k = 0
case), verify plans, the runner (eager or CUDA graphs) and the scheduler over requests."""

from specpilot.engine.engine import Engine
from specpilot.engine.requests import Request, RequestResult, StepReport
from specpilot.engine.scheduler import Scheduler, generate
from specpilot.engine.stats import AcceptanceStats
from specpilot.engine.types import CycleTimes, GenerationResult, RowCommit
from specpilot.engine.verify import VerifyOutcome, greedy_verify

__all__ = [
    "AcceptanceStats",
    "CycleTimes",
    "Engine",
    "GenerationResult",
    "Request",
    "RequestResult",
    "RowCommit",
    "Scheduler",
    "StepReport",
    "VerifyOutcome",
    "generate",
    "greedy_verify",
]
