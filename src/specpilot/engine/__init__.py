"""The decode loop: propose → verify → accept → commit. Plain AR decoding is its k = 0 case."""

from specpilot.engine.loop import GenerationResult, SpecEngine
from specpilot.engine.stats import AcceptanceStats
from specpilot.engine.verify import VerifyOutcome, greedy_verify

__all__ = ["AcceptanceStats", "GenerationResult", "SpecEngine", "VerifyOutcome", "greedy_verify"]
