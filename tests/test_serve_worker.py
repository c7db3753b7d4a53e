"""The server's engine thread without HTTP (no fastapi needed, so it also runs on the GPU
machine): jobs in, tokens out, equal to plain AR; a failed step re-opens the same engine's rows;
on CUDA the worker thread runs the scheduler on CUDA graphs."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from specpilot.cli import build_parser
from specpilot.commands.serve import build_worker
from specpilot.engine import Engine, generate
from specpilot.engine.config import DeploymentSpec, EngineConfig
from specpilot.serve.worker import EngineWorker, Job


def worker_for(model_dir: Path, device: str, *flags: str) -> tuple[EngineWorker, dict]:
    args = build_parser().parse_args(
        ["serve", "--target", str(model_dir), "--device", device, "--max-context", "512", *flags]
    )
    return build_worker(args)


class Jobs:
    """Jobs handed to a worker from this thread, their answers read from a private loop."""

    def __init__(self, worker: EngineWorker) -> None:
        self.worker = worker
        self.loop = asyncio.new_event_loop()

    def submit(self, prompt: list[int], max_tokens: int) -> Job:
        job = Job(prompt, max_tokens, [], self.loop, asyncio.Queue())
        self.worker.submit(job)
        return job

    def outcome(self, job: Job) -> tuple[str, object]:
        """``("done", Outcome)`` or ``("error", message)``; deltas are skipped."""
        while True:
            kind, payload = self.loop.run_until_complete(asyncio.wait_for(job.out.get(), 120))
            if kind != "delta":
                return kind, payload

    def close(self) -> None:
        self.worker.stop()
        self.loop.close()


@pytest.fixture
def jobs_of() -> Iterator:
    made: list[Jobs] = []

    def make(worker: EngineWorker) -> Jobs:
        made.append(Jobs(worker))
        return made[-1]

    yield make
    for j in made:
        j.close()


def ar_tokens(worker: EngineWorker, prompt: list[int], max_tokens: int) -> list[int]:
    """Plain AR, eager, one request alone: what the worker must return (fp32)."""
    target = worker.scheduler.engine.target
    engine = Engine(target, graphs=False)
    return generate(engine, [prompt], max_tokens, worker.eos_ids)[0].tokens


def test_a_failed_step_fails_running_requests_and_reuses_the_engine(model_dir, jobs_of):
    """A step that raises fails the request in the row, keeps the waiting one queued, and
    re-opens the rows of the same engine (no second KV cache); the next requests are exact."""
    worker, _ = worker_for(model_dir, "cpu", "-k", "4", "--max-concurrency", "1")
    tok = worker.tokenizer
    engine, cache = worker.scheduler.engine, worker.scheduler.engine.cache
    real_step = engine.step

    def boom(*_args: object) -> None:
        engine.step = real_step  # fail once
        raise RuntimeError("injected")

    engine.step = boom
    jobs = jobs_of(worker)
    prompts = [tok.encode("hello world"), tok.encode("world hi")]
    queued = [jobs.submit(p, 12) for p in prompts]  # before the thread: the second one waits
    worker.start()
    kind, msg = jobs.outcome(queued[0])
    assert kind == "error" and "injected" in str(msg)
    kind, done = jobs.outcome(queued[1])
    assert kind == "done" and done.tokens == ar_tokens(worker, prompts[1], 12)
    kind, done = jobs.outcome(jobs.submit(prompts[0], 12))
    assert kind == "done" and done.tokens == ar_tokens(worker, prompts[0], 12)
    assert worker.restarts == 1 and worker.metrics.value("specpilot_failed_requests_total") == 1
    assert worker.scheduler.engine is engine and engine.cache is cache


def _engine_flags(tmp_path: Path, model_dir: Path, mechanisms: dict) -> list[str]:
    path = tmp_path / "engine.json"
    dep = DeploymentSpec(target=str(model_dir), drafter="ngram", device="cuda", mode="batched")
    EngineConfig(dep, k=4, drafter_knobs={"max_n": 3, "min_n": 1}, mechanisms=mechanisms).save(path)
    return ["--engine", str(path)]


CUDA_CASES = {
    "ar": lambda tmp, model: ["--drafter", "none"],
    "ngram": lambda tmp, model: ["-k", "4"],
    "sim": lambda tmp, model: ["-k", "4", "--simulate-acceptance", "tau=3,block=5"],
    "tree": lambda tmp, model: _engine_flags(
        tmp, model, {"tree-verify": {"depth": 4, "width": 2, "max_nodes": 6}}
    ),
    "tiered": lambda tmp, model: _engine_flags(tmp, model, {"tiered-budget": {"budget": 2.5}}),
}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("case", list(CUDA_CASES))
def test_worker_runs_on_cuda_graphs(case, model_dir, tmp_path, jobs_of):
    """The worker thread captures and replays graphs (the default on CUDA); every answer equals
    eager plain AR on the same weights (fp32), with more jobs than rows and short segments."""
    flags = CUDA_CASES[case](tmp_path, model_dir)
    worker, card = worker_for(
        model_dir, "cuda", "--max-concurrency", "3", "--segment-tokens", "5", *flags
    )
    assert card["runner"] == "cuda-graphs"
    tok = worker.tokenizer
    texts = [
        "hello world hello world",
        "hi",
        "world hello hi",
        "user hello",
        "hello hello",
        "hi world",
    ]
    prompts = [tok.encode(t) for t in texts]
    jobs = jobs_of(worker)
    worker.start()
    queued = [jobs.submit(p, 40) for p in prompts]
    for job, p in zip(queued, prompts, strict=True):
        kind, done = jobs.outcome(job)
        assert kind == "done" and done.tokens == ar_tokens(worker, p, 40), case
    runner = worker.scheduler.engine.runner
    assert runner.use_graphs and runner.captures > 0


def test_time_to_first_token_and_text_are_observed_once_per_request(model_dir, jobs_of):
    """Each request adds one time-to-first-token sample, and one time-to-first-text sample
    when it showed text at all, never earlier than its first token; a step that fed a prompt
    adds a prefill-step sample."""
    worker, _ = worker_for(model_dir, "cpu", "-k", "4", "--max-concurrency", "2")
    tok, jobs = worker.tokenizer, jobs_of(worker)
    worker.start()
    queued = [jobs.submit(tok.encode(p), 8) for p in ("hello world", "world hi", "hi")]
    outcomes = [jobs.outcome(j)[1] for j in queued]
    answered = sum(time.perf_counter() - j.submitted for j in queued)  # an upper bound
    value = worker.metrics.value
    assert value("specpilot_time_to_first_token_seconds_count") == 3
    with_text = sum(bool(o.text) for o in outcomes)  # type: ignore[attr-defined]
    assert value("specpilot_time_to_first_text_seconds_count") == with_text
    first_token = value("specpilot_time_to_first_token_seconds_sum")
    assert 0 < first_token < answered
    if with_text == 3:
        assert value("specpilot_time_to_first_text_seconds_sum") >= first_token
    assert value("specpilot_prefill_step_seconds_count") >= 2  # two rows: at least two steps
