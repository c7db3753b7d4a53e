"""Graph warm-up (``engine/warmup.py``): every step shape a scheduler can meet, captured before
its first request.

On the CPU under emulated graphs (``test_graphs.emulated_graphs``: each key's first recording is
replayed after, attention buckets of 16): the warm-up captures exactly the keys it claims, which
are every (rows, attention bucket) AR verify and accept, every chain-cycle width and every
prefill width; serving afterwards captures nothing more; and a warmed engine commits the same
tokens as an unwarmed one and as single-request AR (fp32), with arrivals between steps, EOS,
segments and lookahead. The rows come back as ``open`` leaves them. On CUDA the same with real
graphs.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable

import pytest
import torch

from conftest import tiny_config, tiny_model
from engine_cases import make_requests, single_ar
from specpilot.drafters import NgramDrafter
from specpilot.engine import Engine, Request, Scheduler
from specpilot.engine.warmup import attention_buckets, warm_graphs
from specpilot.models.transformer import Transformer
from test_graphs import emulated_graphs, guarded  # noqa: F401  (fixtures)

WIDTHS = (4, 8, 16, 32)
MAX_CONTEXT = 120


def _drive(sched: Scheduler, reqs: list[Request], seed: int) -> dict[str, list[int]]:
    """Requests arriving at seeded random steps; the tokens of each."""
    rng, pending, got, step = random.Random(seed), list(reqs), {}, 0
    while pending or sched.has_work:
        while pending and rng.random() < 0.5:
            sched.submit(pending.pop(0))
        for res in sched.step().finished:
            got[res.id] = res.tokens
        step += 1
        assert step < 3000, "the scheduler made no progress"
    return got


def _scheduler(
    target: Transformer,
    drafter: NgramDrafter | None,
    slots: int,
    window: int,
    segment: int | None,
    as_graphs: Callable[[Engine], None] | None,
) -> Scheduler:
    engine = Engine(target, drafter, sync_every=4)
    if as_graphs is not None:
        as_graphs(engine)
    engine.prefill_widths = WIDTHS
    return Scheduler(
        engine,
        slots=slots,
        segment_tokens=segment,
        max_context=MAX_CONTEXT,
        window=window,
        lookahead=drafter is None,
    )


def _buckets(engine: Engine) -> list[int]:
    """The attention buckets of 16 covering every need up to the rows' context and margin."""
    top = MAX_CONTEXT + engine.context_margin()
    return list(range(16, -(-top // 16) * 16 + 1, 16))


def _expected_keys(engine: Engine, slots: int) -> set[Hashable]:
    """What the warm-up claims to capture, enumerated from the engine's shape."""
    buckets = _buckets(engine)
    keys: set[Hashable] = {("prefill", w) for w in WIDTHS}
    if engine.drafter is None:
        counts = sorted({min(slots, 1 << (t - 1).bit_length()) for t in range(1, slots + 1)})
    else:
        counts = [slots]
    for n in counts:
        step_keys: list[Hashable] = [("verify", 1, a, False) for a in buckets] + [("accept", 0)]
        keys |= {k if n == slots else (k, ("rows", n)) for k in step_keys}
    if engine.drafter is not None:  # the chain cycle: powers of two up to k + 1
        for w in (1, 2, 4):
            keys |= {("verify", w, a, False) for a in buckets} | {("accept", w - 1)}
    return keys


@pytest.mark.parametrize(
    ("drafter", "slots", "window", "segment", "seed"),
    [(None, 4, 4, None, 0), (None, 3, 2, 8, 1), (None, 1, 4, None, 2), ("ngram", 3, 4, 16, 3)],
)
def test_warmed_engine_captures_what_it_claims_and_commits_the_same_tokens(
    emulated_graphs: Callable[[Engine], None],  # noqa: F811
    drafter: str | None,
    slots: int,
    window: int,
    segment: int | None,
    seed: int,
) -> None:
    target = tiny_model(tiny_config(vocab=73), seed)
    reqs = make_requests(random.Random(seed), target.cfg.vocab_size, 8, target)
    want = {r.id: single_ar(target, r) for r in reqs}

    def draft() -> NgramDrafter | None:
        return None if drafter is None else NgramDrafter(k=3)

    cold = _scheduler(target, draft(), slots, window, segment, emulated_graphs)
    assert _drive(cold, reqs, seed) == want

    sched = _scheduler(target, draft(), slots, window, segment, emulated_graphs)
    engine = sched.engine
    report = warm_graphs(sched)
    assert attention_buckets(engine, MAX_CONTEXT + engine.context_margin()) == _buckets(engine)
    assert len(report.keys) == len(set(report.keys)) == engine.runner.captures
    assert set(report.keys) == set(engine.runner.keys) == _expected_keys(engine, slots)
    assert report.left == () and report.seconds >= 0
    captured = engine.runner.captures
    assert _drive(sched, reqs, seed) == want
    assert engine.runner.captures == captured, "serving met a shape the warm-up left out"
    assert set(cold.engine.runner.keys) <= set(engine.runner.keys)


def test_warm_up_leaves_the_rows_as_open_does(
    emulated_graphs: Callable[[Engine], None],  # noqa: F811
) -> None:
    target = tiny_model(tiny_config(vocab=73), 4)
    sched = _scheduler(target, None, 4, 4, None, emulated_graphs)
    fresh = _scheduler(target, None, 4, 4, None, None)
    warm_graphs(sched)
    a, b = sched.engine.state, fresh.engine.state
    for name in a.__dataclass_fields__:
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert sched.engine.host == fresh.engine.host and not sched.engine.ahead


def test_warm_up_needs_idle_rows_and_graphs(
    emulated_graphs: Callable[[Engine], None],  # noqa: F811
) -> None:
    target = tiny_model(tiny_config(vocab=73), 5)
    eager = _scheduler(target, None, 2, 4, None, None)
    report = warm_graphs(eager)
    assert report.keys == () and eager.engine.runner.keys == [] and report.left
    sched = _scheduler(target, None, 2, 4, None, emulated_graphs)
    sched.submit(Request("a", (1, 2, 3), 4, frozenset()))
    with pytest.raises(ValueError, match="before the first request"):
        warm_graphs(sched)
    assert sched.engine.runner.captures == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_warmed_graphs_equal_cold_ones() -> None:
    """Real CUDA graphs, fp32: a warmed engine's tokens equal a cold one's and plain AR's, and
    serving captures nothing more."""
    cfg = tiny_config(arch="qwen3", vocab=113, layers=3)
    target = Transformer(cfg, dtype=torch.float32, device="cuda")
    target.init_random(6, std=0.15)
    reqs = make_requests(random.Random(6), cfg.vocab_size, 8, target)
    want = {r.id: single_ar(target, r) for r in reqs}
    got = []
    for warm in (False, True):
        sched = _scheduler(target, None, 4, 4, None, None)
        assert sched.engine.runner.use_graphs
        if warm:
            report = warm_graphs(sched)
            assert report.keys and sched.engine.runner.captures == len(report.keys)
        captured = sched.engine.runner.captures
        got.append(_drive(sched, reqs, 6))
        if warm:
            assert sched.engine.runner.captures == captured
    assert got[0] == got[1] == want
