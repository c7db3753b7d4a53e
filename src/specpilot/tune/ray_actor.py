"""The worker side of the Ray executor (``tune/ray_executor.py``): one actor, its own evaluator.

The actor loads the target once, in its constructor (which Ray runs again, with the same
arguments, when it restarts the actor after a death), measures its own AR baseline, and reuses
both for every trial it is given. It holds no memory store, nor its path: it returns each
:class:`TrialResult`, stamped with its name and the seconds it spent on it, and the driver writes.
"""

from __future__ import annotations

import os
import time
from typing import Any

from specpilot.engine.config import EngineConfig
from specpilot.tune.evaluate import TrialResult
from specpilot.tune.evaluate_batched import BatchedStream
from specpilot.tune.executors import make_evaluator, target_shape


class EvalActor:
    """One worker: its own evaluator (target loaded once, its own AR baseline), no memory store.
    Plain Python: ``RayExecutor`` makes it a Ray actor class (``ray.remote``)."""

    def __init__(
        self,
        name: str,
        base: EngineConfig,
        prompts: list[list[int]],
        max_new_tokens: int,
        stream: BatchedStream | None,
        graphs: bool | None,
        rounds: int,
    ) -> None:
        import torch

        torch.set_num_threads(1)
        self.name = name
        self.evaluator = make_evaluator(base, prompts, max_new_tokens, stream, graphs, rounds)

    def ready(self) -> dict[str, Any]:
        """Who it is and what it measured (also the ping after a restart)."""
        arch, num_layers = target_shape(self.evaluator)
        return {
            "pid": os.getpid(),
            "ar_tok_s": self.evaluator.ar_tok_s,
            "arch": arch,
            "num_layers": num_layers,
        }

    def evaluate(self, config: EngineConfig) -> TrialResult:
        t0 = time.perf_counter()
        r = self.evaluator.evaluate(config)
        r.worker, r.busy_seconds = self.name, time.perf_counter() - t0
        return r
