"""Token forcing: check that every committed token is the stock target's own argmax."""

from specpilot.forcing.check import ForcingReport, SequenceVerdict, force_tokens
from specpilot.forcing.tolerance import near_tie_tolerance

__all__ = ["ForcingReport", "SequenceVerdict", "force_tokens", "near_tie_tolerance"]
