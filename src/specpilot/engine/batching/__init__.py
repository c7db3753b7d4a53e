"""Continuous batching: requests join and leave a running batch of slots between steps."""

from specpilot.engine.batching.block import BlockPolicy
from specpilot.engine.batching.prefilter import DraftPrefilter
from specpilot.engine.batching.request import Request, RequestResult, StepReport
from specpilot.engine.batching.scheduler import BatchScheduler
from specpilot.engine.batching.static_scheduler import StaticScheduler

__all__ = [
    "BatchScheduler",
    "BlockPolicy",
    "DraftPrefilter",
    "Request",
    "RequestResult",
    "StaticScheduler",
    "StepReport",
]
