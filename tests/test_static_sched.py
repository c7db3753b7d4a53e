"""Continuous batching on the static engine (``StaticScheduler``, ``engine/static_rows.py``):
every request's tokens equal its own single-request AR output (fp32) whatever runs beside it,
with more requests than rows arriving at different steps, rows reused many times, cancel, and
clear errors. Runs eagerly on the CPU; the CUDA-graph case is skipped without CUDA."""

from __future__ import annotations

import importlib.util
import json
import random
from collections import Counter
from pathlib import Path

import pytest
import torch

from specpilot.drafters.block_drafter import BlockDrafter
from specpilot.drafters.simulated import AcceptanceProfile, SimulatedAcceptance
from specpilot.drafters.static_base import StaticDrafter
from specpilot.drafters.static_draft_model import StaticDraftModel
from specpilot.drafters.static_tree import StaticTree
from specpilot.engine.batching import Request, RequestResult
from specpilot.engine.batching.static_scheduler import StaticScheduler
from specpilot.engine.loop import SpecEngine
from specpilot.engine.static_engine import StaticEngine
from specpilot.engine.tree_policy import FixedTree
from specpilot.engine.widths import FixedWidths
from specpilot.errors import PromptTooLongError
from specpilot.models.transformer import Transformer
from specpilot.synthetic import init_random_on_device
from test_gpu_path import tiny

K = 3
DRAFTERS = ["ar", "draft-model", "sim-draft-model", "sim-block"]


def make_drafter(kind: str, model: Transformer, seed: int) -> StaticDrafter | None:
    profile = AcceptanceProfile.parse(f"tau=2.5,block={K + 1}")
    if kind == "ar":
        return None
    if kind.endswith("draft-model"):
        draft = tiny("llama", seed=seed + 7, hidden_size=32, num_layers=1, num_heads=2)
        inner: StaticDrafter = StaticDraftModel(draft, k=K)
    else:
        block = BlockDrafter(model, num_layers=1, block=K + 1, num_context_layers=2)
        init_random_on_device(block.weights, seed + 3)
        inner = block
    return SimulatedAcceptance(inner, profile, seed=seed) if kind.startswith("sim") else inner


def make_requests(rng: random.Random, model: Transformer, n: int) -> list[Request]:
    """Prompts of 1..30 tokens, budgets of 1..40; an EOS id that the first request's greedy
    continuation emits mid-way, so that some rows finish by EOS."""
    vocab = model.cfg.vocab_size
    prompts = [tuple(rng.randrange(vocab) for _ in range(rng.randint(1, 30))) for _ in range(n)]
    cont = SpecEngine(model).generate([list(prompts[0])], 12)[0].tokens
    eos = frozenset([cont[rng.randrange(3, 12)]])
    return [Request(f"r{i}", p, rng.randint(1, 40), eos) for i, p in enumerate(prompts)]


def single_ar(model: Transformer, req: Request) -> list[int]:
    res = SpecEngine(model).generate([list(req.prompt_ids)], req.max_new_tokens, req.stop_ids)
    return res[0].tokens


def serve(
    sched: StaticScheduler, reqs: list[Request], arrival: list[int]
) -> dict[str, RequestResult]:
    """Submit each request at its arrival step; step until every request is done."""
    done: dict[str, RequestResult] = {}
    step = 0
    while len(done) < len(reqs):
        for req, at in zip(reqs, arrival, strict=True):
            if at == step:
                sched.submit(req)
        for res in sched.step().finished:
            done[res.id] = res
        step += 1
        assert step < 2000, "the scheduler made no progress"
    return done


def count_fills(engine: StaticEngine) -> Counter[int]:
    """Count the requests started per row (wraps the engine's ``fill_rows``); key -1 holds the
    most rows admitted by one batched prefill."""
    fills: Counter[int] = Counter()
    fill = engine.fill_rows

    def counted(rows: list[int], prompts: list[list[int]], max_news: list[int]) -> list[int]:
        fills.update(rows)
        fills[-1] = max(fills[-1], len(rows))
        return fill(rows, prompts, max_news)

    engine.fill_rows = counted  # type: ignore[method-assign]
    return fills


@pytest.mark.parametrize("kind", DRAFTERS)
@pytest.mark.parametrize("seed", range(3))
def test_every_request_equals_its_single_ar(kind: str, seed: int) -> None:
    rng = random.Random(seed)
    model = tiny("qwen3" if seed % 2 else "llama", seed=seed + 1)
    reqs = make_requests(rng, model, 10)
    arrival = sorted(rng.randrange(12) for _ in reqs)
    arrival[0] = 0
    drafter = make_drafter(kind, model, seed)
    engine = StaticEngine(model, drafter, attn_bucket=16, sync_every=5)
    sched = StaticScheduler(engine, slots=3, max_context=80)
    fills = count_fills(engine)
    done = serve(sched, reqs, arrival)
    for req in reqs:
        want = single_ar(model, req)
        assert done[req.id].tokens == want, req.id
        assert done[req.id].stop_reason == ("eos" if want[-1] in req.stop_ids else "length")
    assert any(r.stop_reason == "eos" for r in done.values()), "no row stopped by EOS"
    assert max(n for row, n in fills.items() if row >= 0) >= 3, f"no row reused 3 times: {fills}"
    assert fills[-1] >= 2, "no step admitted two rows in one batched prefill"
    assert not sched.has_work and sched.running == 0
    assert engine.state is not None and int(engine.state.active.sum()) == 0
    if isinstance(drafter, SimulatedAcceptance):
        assert drafter.divergences == 0  # fp32: the oracle of a refilled row is its AR output
        cycles = sum(r.stats.cycles for r in done.values())
        committed = sum(r.stats.committed for r in done.values())
        assert committed / cycles > 1.5  # refilled rows keep accepting drafts


def test_a_row_reused_many_times_alone() -> None:
    """One row, eight requests back to back: each equals its AR output (nothing stale leaks)."""
    model = tiny("llama")
    drafter = make_drafter("sim-draft-model", model, 0)
    sched = StaticScheduler(StaticEngine(model, drafter, attn_bucket=16), slots=1, max_context=70)
    rng = random.Random(4)
    reqs = [
        Request(f"q{i}", tuple(rng.randrange(101) for _ in range(rng.randint(1, 40))), 30)
        for i in range(8)
    ]
    got = sched.run(reqs)
    assert [r.tokens for r in got] == [single_ar(model, r) for r in reqs]


def test_cancel_running_and_waiting() -> None:
    model = tiny("llama")
    engine = StaticEngine(model, make_drafter("draft-model", model, 1), attn_bucket=16)
    sched = StaticScheduler(engine, slots=2, max_context=64)
    rng = random.Random(2)
    reqs = [Request(f"c{i}", tuple(rng.randrange(101) for _ in range(9)), 30) for i in range(5)]
    for r in reqs:
        sched.submit(r)
    finished = [res for _ in range(2) for res in sched.step().finished]
    assert not finished and sched.running == 2 and sched.waiting == 3
    running = sched.cancel("c0")
    assert running is not None and running.stop_reason == "cancelled"
    assert 0 < len(running.tokens) < 30
    assert running.tokens == single_ar(model, reqs[0])[: len(running.tokens)]
    waiting = sched.cancel("c3")
    assert waiting is not None and waiting.tokens == [] and waiting.stop_reason == "cancelled"
    assert sched.cancel("nobody") is None
    while sched.has_work:
        finished += sched.step().finished
    assert sorted(r.id for r in finished) == ["c1", "c2", "c4"]
    for res in finished:
        assert res.tokens == single_ar(model, reqs[int(res.id[1:])])


def test_clear_errors() -> None:
    model = tiny("llama")
    sched = StaticScheduler(StaticEngine(model, attn_bucket=16), slots=2, max_context=50)
    with pytest.raises(PromptTooLongError, match="exceeds the scheduler's context of 50"):
        sched.submit(Request("long", tuple(range(45)), 10))
    with pytest.raises(PromptTooLongError, match="empty"):
        sched.submit(Request("empty", (), 10))
    with pytest.raises(PromptTooLongError, match="exceeds the model's context"):
        StaticScheduler(StaticEngine(model), slots=2, max_context=5000)
    engine = sched.engine
    with pytest.raises(PromptTooLongError, match="each row was opened for"):
        engine.fill_row(0, list(range(60)), 40)
    draft = StaticDraftModel(tiny("llama", seed=3), k=K)
    with pytest.raises(ValueError, match="chain verify only"):
        StaticScheduler(StaticEngine(model, draft, width_policy=FixedWidths()), slots=2)
    block = BlockDrafter(model, num_layers=1, block=K + 1, num_context_layers=2)
    with pytest.raises(ValueError, match="chain verify only"):
        StaticScheduler(
            StaticEngine(model, block, tree_policy=FixedTree(StaticTree.chain(K))), slots=2
        )

    class NoRefill:
        name, k, hidden_layers = "no-refill", K, ()

    with pytest.raises(ValueError, match="'no-refill' cannot restart one row"):
        StaticScheduler(StaticEngine(model, NoRefill()), slots=2)  # type: ignore[arg-type]


def test_static_sched_gpu_bench_tiny(tmp_path: Path) -> None:
    """The H200 script end to end on tiny CPU shapes: continuous equals static batches and AR
    per request, fewer cycles than static batches (rows are refilled), labelled."""
    path = Path(__file__).resolve().parents[1] / "bench" / "static_sched_gpu.py"
    spec = importlib.util.spec_from_file_location("static_sched_gpu", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    result = mod.main(["--out", str(tmp_path), "--tiny"])
    saved = json.loads((tmp_path / "static_sched_gpu.json").read_text())
    assert "simulated acceptance" in saved["label"] and saved["runs"] == result["runs"]
    runs = {r["variant"]: r for r in saved["runs"]}
    assert list(runs) == ["AR static batches", "static batches", "continuous"]
    cont = runs["continuous"]
    for check in (cont["vs_static"], cont["vs_ar"], runs["static batches"]["vs_ar"]):
        assert check["rows_equal_ar"] == check["rows"] == 12
    assert cont["cycles"] < runs["static batches"]["cycles"]
    assert cont["oracle_divergences"] == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("kind", ["sim-block", "draft-model", "ar"])
def test_cuda_graphs_every_request_equals_its_single_ar(kind: str) -> None:
    """The same on CUDA with graphs (fp32): refilled rows replay the graphs captured earlier."""
    from specpilot.synthetic import build_block_drafter, build_target

    rng = random.Random(11)
    model = build_target("tiny-llama", "cuda", torch.float32, seed=2, max_positions=1024)
    drafter: StaticDrafter | None = None
    if kind == "sim-block":
        profile = AcceptanceProfile.parse("tau=3,block=9")
        drafter = SimulatedAcceptance(build_block_drafter(model, "tiny-block"), profile)
    elif kind == "draft-model":
        draft = build_target("tiny-llama", "cuda", torch.float32, seed=5, max_positions=1024)
        drafter = StaticDraftModel(draft, k=4)
    reqs = make_requests(rng, model, 12)
    arrival = sorted(rng.randrange(15) for _ in reqs)
    arrival[0] = 0
    engine = StaticEngine(model, drafter, use_graphs=True, attn_bucket=32, sync_every=4)
    sched = StaticScheduler(engine, slots=4, max_context=80)
    fills = count_fills(engine)
    done = serve(sched, reqs, arrival)
    for req in reqs:
        assert done[req.id].tokens == single_ar(model, req), req.id
    assert max(n for row, n in fills.items() if row >= 0) >= 3
    assert engine.runner.captures > 0
