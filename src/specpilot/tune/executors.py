"""Where candidates are evaluated: in this process (default) or on a Ray cluster
(``tune/ray_executor.py``).

Each worker owns an :class:`Evaluator` (the stock target, the prompts, its own AR baseline), so
every speedup is a ratio measured in one process. Every executor stamps each result with the
worker that measured it and its busy seconds, and keeps their sum per worker (``usage``,
``tune/usage.py``); workers never open the memory store: the loop, in this process, is its one
writer.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from specpilot.engine.config import EngineConfig
from specpilot.tune.evaluate import Evaluator, TrialResult
from specpilot.tune.evaluate_batched import BatchedEvaluator, BatchedStream
from specpilot.tune.usage import Usage


def make_evaluator(
    base: EngineConfig,
    prompts: Sequence[list[int]],
    max_new_tokens: int,
    stream: BatchedStream | None = None,
    graphs: bool | None = None,
    rounds: int = 3,
) -> Evaluator:
    """The evaluator of the deployment's mode: one request at a time (``single``), or a request
    stream through the continuous-batching scheduler (``batched``; ``stream`` or its defaults)."""
    if base.deployment.mode == "batched":
        stream = stream or BatchedStream()
        return BatchedEvaluator(base, prompts, max_new_tokens, stream, graphs=graphs, rounds=rounds)
    return Evaluator(base, prompts, max_new_tokens, graphs=graphs, rounds=rounds)


class Executor(Protocol):
    ar_tok_s: float

    def map(self, configs: Sequence[EngineConfig]) -> list[TrialResult]: ...

    def close(self) -> None: ...


@runtime_checkable
class StreamingExecutor(Executor, Protocol):
    """Hands trials to its workers one by one as they free up (the loop then records each result
    as it arrives, and the budget is checked before every trial instead of every chunk)."""

    def stream(
        self,
        configs: Sequence[EngineConfig],
        admit: Callable[[], bool] | None = None,
        on_result: Callable[[TrialResult], None] | None = None,
    ) -> list[TrialResult]:
        """Results of the configs that ran, in the order given. ``admit()`` is asked once before
        each config first starts, in the order given (a re-run after a worker's death is not
        asked again); once it says no, no later one starts. ``on_result`` is told of each
        result as it comes back."""
        ...


def target_shape(evaluator: Evaluator) -> tuple[str, int]:
    """(architecture, layers) of the evaluator's stock target (the directions depend on them)."""
    cfg = evaluator.stock.model.cfg
    return cfg.arch, cfg.num_layers


class LocalExecutor:
    """Evaluates in this process; a chunk of ``width`` candidates shares its AR rounds."""

    shares_rounds = True
    """A chunk's candidates are measured in the same interleaved rounds (head to head)."""

    def __init__(
        self,
        base: EngineConfig,
        prompts: Sequence[list[int]],
        max_new_tokens: int,
        stream: BatchedStream | None = None,
        graphs: bool | None = None,
        rounds: int = 3,
        width: int = 3,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        self.evaluator = make_evaluator(base, prompts, max_new_tokens, stream, graphs, rounds)
        self.evaluator.progress = progress
        self.ar_tok_s = self.evaluator.ar_tok_s
        self.width = width
        """Candidates evaluated at once (the loop checks its budget between such chunks)."""
        self.arch, self.num_layers = target_shape(self.evaluator)
        self.usage = Usage.of("local", self.evaluator.device.type, ["local"])

    def map(self, configs: Sequence[EngineConfig]) -> list[TrialResult]:
        t0 = time.perf_counter()
        out = self.evaluator.evaluate_many(configs)
        # The chunk's trials shared its AR rounds: its time is split in proportion to theirs.
        spent, total = time.perf_counter() - t0, sum(r.wall_seconds for r in out)
        for r in out:
            r.worker = "local"
            r.busy_seconds = spent * (r.wall_seconds / total if total > 0 else 1 / len(out))
            self.usage.record(r)
        return out

    def close(self) -> None:
        pass
