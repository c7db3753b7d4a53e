"""Where candidates are evaluated: in this process (default) or on a Ray cluster.

Each worker owns an :class:`Evaluator` (the stock target, the prompts, its own AR baseline), so
every speedup is a ratio measured in one process. With Ray, one actor per GPU (``num_gpus=1``),
or ``workers`` CPU actors on a CPU-only cluster.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from specpilot.engine.config import EngineConfig
from specpilot.tune.evaluate import Evaluator, TrialResult
from specpilot.tune.evaluate_batched import BatchedEvaluator, BatchedStream


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

    def map(self, configs: Sequence[EngineConfig]) -> list[TrialResult]:
        return self.evaluator.evaluate_many(configs)

    def close(self) -> None:
        pass


class RayExecutor:
    """Spread evaluations over a Ray cluster (``address=None`` starts a local one)."""

    def __init__(
        self,
        base: EngineConfig,
        prompts: Sequence[list[int]],
        max_new_tokens: int,
        address: str | None = None,
        workers: int | None = None,
        stream: BatchedStream | None = None,
        graphs: bool | None = None,
        rounds: int = 3,
    ) -> None:
        import ray

        if not ray.is_initialized():
            ray.init(
                address=address,
                include_dashboard=False,
                log_to_driver=False,
                ignore_reinit_error=True,
            )
        gpus = int(ray.cluster_resources().get("GPU", 0))
        n = workers or max(1, gpus)
        actor_cls: Any = (
            ray.remote(num_gpus=1)(_EvalActor) if gpus else ray.remote(num_cpus=1)(_EvalActor)
        )
        self._actors = [
            actor_cls.remote(base, list(prompts), max_new_tokens, stream, graphs, rounds)
            for _ in range(n)
        ]
        self._ray = ray
        self.width = n
        """Candidates evaluated at once (the loop checks its budget between such chunks)."""
        self.ar_tok_s = sum(ray.get([a.ar_tok_s.remote() for a in self._actors])) / n

    def map(self, configs: Sequence[EngineConfig]) -> list[TrialResult]:
        refs = [
            self._actors[i % len(self._actors)].evaluate.remote(c) for i, c in enumerate(configs)
        ]
        return list(self._ray.get(refs))

    def close(self) -> None:
        for a in self._actors:
            self._ray.kill(a)


class _EvalActor:
    def __init__(
        self,
        base: EngineConfig,
        prompts: list[list[int]],
        max_new_tokens: int,
        stream: BatchedStream | None,
        graphs: bool | None,
        rounds: int,
    ) -> None:
        import torch

        torch.set_num_threads(1)
        self.evaluator = make_evaluator(base, prompts, max_new_tokens, stream, graphs, rounds)

    def ar_tok_s(self) -> float:
        return self.evaluator.ar_tok_s

    def evaluate(self, config: EngineConfig) -> Any:
        return self.evaluator.evaluate(config)
