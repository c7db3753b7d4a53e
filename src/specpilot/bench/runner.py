"""Side-by-side runs of our stock AR path and the speculative engine on the same prompts."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from specpilot.bench.records import RunRecord, make_record
from specpilot.engine import AcceptanceStats, Engine, GenerationResult, generate
from specpilot.forcing import ForcingReport, force_tokens
from specpilot.models.transformer import Transformer


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_generate(
    engine: Engine,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    eos_ids: Sequence[int],
    on_commit: Callable[[int, list[int]], None] | None = None,
) -> tuple[GenerationResult, float]:
    """One generation and its wall time, device synchronised before both clock reads."""
    dev = engine.target.device
    synchronize(dev)
    t0 = time.perf_counter()
    result = generate(engine, [prompt_ids], max_new_tokens, eos_ids, on_commit)[0]
    synchronize(dev)
    return result, time.perf_counter() - t0


def warm_up(
    engines: Sequence[Engine], prompt_ids: Sequence[int], eos_ids: Sequence[int]
) -> None:
    """Keep allocation, kernel selection and first-call costs out of the timings."""
    for e in engines:
        generate(e, [prompt_ids], 8, eos_ids)


@dataclass(slots=True)
class BenchSummary:
    ar_tokens: int = 0
    ar_seconds: float = 0.0
    spec_tokens: int = 0
    spec_seconds: float = 0.0
    identical: int = 0
    """Prompts whose speculative tokens equal the AR tokens exactly."""
    prompts: int = 0
    stats: AcceptanceStats = field(default_factory=AcceptanceStats)
    forcing: ForcingReport | None = None

    @property
    def ar_tok_s(self) -> float:
        return self.ar_tokens / self.ar_seconds if self.ar_seconds else 0.0

    @property
    def spec_tok_s(self) -> float:
        return self.spec_tokens / self.spec_seconds if self.spec_seconds else 0.0

    @property
    def speedup(self) -> float:
        return self.spec_tok_s / self.ar_tok_s if self.ar_tok_s else 0.0

    def add(self, ar: RunRecord, spec: RunRecord, stats: AcceptanceStats) -> None:
        self.prompts += 1
        self.ar_tokens += len(ar.tokens)
        self.ar_seconds += ar.seconds
        self.spec_tokens += len(spec.tokens)
        self.spec_seconds += spec.seconds
        self.identical += int(ar.tokens == spec.tokens)
        self.stats.merge(stats)


def run_pair(
    ar_engine: Engine,
    spec_engine: Engine,
    prompt_id: str,
    prompt_ids: list[int],
    max_new_tokens: int,
    eos_ids: Sequence[int],
    meta: dict[str, str],
) -> tuple[RunRecord, RunRecord, AcceptanceStats]:
    """AR then speculative on one prompt; two records (``meta``: target, dtype, device, drafter)."""
    records = []
    stats = AcceptanceStats()
    for name, engine in (("ar", ar_engine), ("spec", spec_engine)):
        result, seconds = timed_generate(engine, prompt_ids, max_new_tokens, eos_ids)
        records.append(
            make_record(
                prompt_id,
                name,
                meta,
                list(prompt_ids),
                result.tokens,
                result.stop_reason,
                seconds,
                k=engine.k,
                stats=result.stats.to_dict(),
            )
        )
        if name == "spec":
            stats = result.stats
    return records[0], records[1], stats


def force_records(
    target: Transformer, records: Sequence[RunRecord], progress: Callable[[], None] | None = None
) -> ForcingReport:
    return force_tokens(
        target, [(f"{r.id}:{r.engine}", r.prompt_ids, r.tokens) for r in records], progress
    )
