"""Engines side by side on the same prompts: one generation, a warm-up, interleaved rounds,
records and token forcing. What ``generate``, ``bench`` and ``compare`` share."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from specpilot.bench.protocol import Measurement, Sample, interleave, timed
from specpilot.bench.records import RunRecord, make_record
from specpilot.engine import AcceptanceStats, Engine, GenerationResult, generate
from specpilot.forcing import ForcingReport, force_tokens
from specpilot.models.transformer import Transformer
from specpilot.progress import QUIET, Progress

Encoded = Sequence[tuple[str, list[int]]]
"""(prompt id, token ids) of a prompt set."""


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
    """One generation and its wall time, device synchronised before both clock reads (the
    reference runs of simulated acceptance taken out)."""
    dev = engine.target.device
    synchronize(dev)
    skip0 = engine.times.excluded
    t0 = time.perf_counter()
    result = generate(engine, [prompt_ids], max_new_tokens, eos_ids, on_commit)[0]
    synchronize(dev)
    return result, time.perf_counter() - t0 - (engine.times.excluded - skip0)


@dataclass(slots=True)
class PromptRun:
    """One prompt's generation by one engine in one round."""

    id: str
    prompt_ids: list[int]
    result: GenerationResult
    seconds: float


def run_prompts(
    engine: Engine,
    encoded: Encoded,
    max_new_tokens: int,
    eos_ids: Sequence[int],
    on_prompt: Callable[[], None] | None = None,
) -> Sample:
    """Every prompt once, one request at a time; the payload is the list of :class:`PromptRun`."""

    def run() -> tuple[int, list[PromptRun]]:
        out = []
        for pid, ids in encoded:
            res, secs = timed_generate(engine, ids, max_new_tokens, eos_ids)
            out.append(PromptRun(pid, list(ids), res, secs))
            if on_prompt is not None:
                on_prompt()
        return sum(len(r.result.tokens) for r in out), out

    return timed(engine.target.device, run, lambda: engine.times.excluded)


def warm_up(
    engines: Sequence[Engine], encoded: Encoded, max_new_tokens: int, eos_ids: Sequence[int]
) -> None:
    """Keep graph capture, autotune and allocation out of every timed region: on CUDA graphs
    the whole workload once (every graph it needs is captured), eagerly a short run."""
    for e in engines:
        if e.runner.use_graphs:
            run_prompts(e, encoded, max_new_tokens, eos_ids)
        else:
            generate(e, [encoded[0][1][-16:]], 8, eos_ids)


def side_by_side(
    engines: Mapping[str, Engine],
    encoded: Encoded,
    max_new_tokens: int,
    eos_ids: Sequence[int],
    rounds: int = 3,
    deadline: float | None = None,
    on_round: Callable[[int, dict[str, Sample]], None] | None = None,
    progress: Progress = QUIET,
) -> Measurement:
    """Warm every engine up, then run the prompt set with each, interleaved in ``rounds``
    (each engine's turn in a round reported to ``progress`` as a timed phase, prompt by
    prompt)."""
    progress.phase(f"warming up {', '.join(engines)}")
    warm_up(list(engines.values()), encoded, max_new_tokens, eos_ids)
    turns = dict.fromkeys(engines, 0)

    def turn(name: str, engine: Engine) -> Sample:
        turns[name] += 1
        progress.timed_phase(f"round {turns[name]}/{rounds}: {name}, {len(encoded)} prompts")
        done = 0

        def tick() -> None:
            nonlocal done
            done += 1
            progress.detail(f"prompt {done}/{len(encoded)}")

        return run_prompts(engine, encoded, max_new_tokens, eos_ids, on_prompt=tick)

    arms = {name: (lambda n=name, e=e: turn(n, e)) for name, e in engines.items()}
    return interleave(arms, rounds, warmup=0, deadline=deadline, on_round=on_round)


def records_of(
    sample: Sample, kind: str, meta: dict[str, str], k: int = 0
) -> tuple[list[RunRecord], AcceptanceStats]:
    """Run records of one sample (``kind``: ``ar``/``spec``) and its merged acceptance stats."""
    records, stats = [], AcceptanceStats()
    for run in sample.payload:
        r = run.result
        records.append(
            make_record(
                run.id,
                kind,
                meta,
                run.prompt_ids,
                r.tokens,
                r.stop_reason,
                run.seconds,
                k=k,
                stats=r.stats.to_dict(),
            )
        )
        stats.merge(r.stats)
    return records, stats


def force_records(
    target: Transformer, records: Sequence[RunRecord], progress: Callable[[], None] | None = None
) -> ForcingReport:
    return force_tokens(
        target, [(f"{r.id}:{r.engine}", r.prompt_ids, r.tokens) for r in records], progress
    )
