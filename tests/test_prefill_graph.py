"""The graphed (packed) prefill (``engine/prefill_graph.py``): the segments of several rows from
slot 0 packed end to end, padded to a width bucket, run over a scratch cache under a
block-diagonal causal mask and put into their rows; on the CPU the same step runs eagerly.

Every request must decode exactly as plain AR with eager prefills (fp32), whatever row it lands
in, whether its prompt fits a bucket, spans several segments or arrives with others (a wave of
arrivals is one forward per token budget, never one per row); the step
never reads the device on the host (the graph-safety guard of ``test_graphs.py``) and replays
correctly from its first recording (emulated graphs); on CUDA, the captured graphs give eager's
tokens in fp32 and pass token forcing in bf16.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from typing import Any

import pytest
import torch

from conftest import tiny_config, tiny_model
from engine_cases import CONFIGS, ar_tokens, repetitive_prompt, tokens
from specpilot.drafters import NgramDrafter
from specpilot.engine import Engine, Request, Scheduler, generate
from specpilot.engine.prefill_graph import PrefillGraph
from specpilot.forcing import force_tokens
from specpilot.models.transformer import Transformer
from test_graphs import emulated_graphs, guarded  # noqa: F401  (fixtures)

WIDTHS = (4, 8, 16, 32)
LENGTHS = (1, 3, 4, 5, 9, 16, 17, 31, 33, 47)  # bucket edges, and longer than every bucket


@pytest.fixture
def graphed(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int]]:
    """Records ``(row, tokens, width)`` of every segment a graphed prefill fed."""
    real = PrefillGraph.run
    calls: list[tuple[int, int, int]] = []

    def run(self: PrefillGraph, *args: Any) -> object:
        rows, segments, w = args[-3:]
        calls.extend((row, len(ids), w) for row, ids in zip(rows, segments, strict=True))
        return real(self, *args)

    monkeypatch.setattr(PrefillGraph, "run", run)
    return calls


def _requests(rng: random.Random, vocab: int) -> list[Request]:
    lengths = list(LENGTHS)
    rng.shuffle(lengths)
    return [
        Request(str(i), tuple(repetitive_prompt(rng, vocab, n)), rng.randint(1, 20), frozenset())
        for i, n in enumerate(lengths)
    ]


def _serve(
    engine: Engine, reqs: list[Request], slots: int, seg: int | None
) -> dict[str, list[int]]:
    sched = Scheduler(engine, slots=slots, segment_tokens=seg, max_context=80)
    return {r.id: r.tokens for r in sched.run(reqs)}


@pytest.mark.parametrize("cfg_kw", [CONFIGS[1], CONFIGS[2], CONFIGS[4]], ids=["gqa", "mqa", "c4"])
@pytest.mark.parametrize("drafter", [False, True], ids=["ar", "ngram"])
def test_graphed_prefill_equals_ar(
    cfg_kw: dict, drafter: bool, graphed: list[tuple[int, int, int]]
) -> None:
    cfg = tiny_config(**cfg_kw)
    target = tiny_model(cfg, 5)
    reqs = _requests(random.Random(f"prefill/{cfg_kw}"), cfg.vocab_size)
    want = {r.id: ar_tokens(target, [list(r.prompt_ids)], r.max_new_tokens)[0] for r in reqs}
    assert not graphed  # eager on the CPU by default
    for slots, seg in ((1, None), (2, None), (3, 6), (4, 40)):
        engine = Engine(target, NgramDrafter(k=3) if drafter else None)
        engine.prefill_widths = WIDTHS
        graphed.clear()
        assert _serve(engine, reqs, slots, seg) == want, f"slots {slots}, segments {seg}"
        assert graphed, "no prefill took the graphed path"
        assert all(n <= w and w in WIDTHS for _, n, w in graphed)
        assert slots == 1 or seg or any(r > 0 for r, _, _ in graphed)  # not only row 0
        if seg is None:  # the prompts longer than every bucket ran eagerly
            assert max(n for _, n, _ in graphed) <= WIDTHS[-1] < max(LENGTHS)


def test_graphed_prefill_writes_only_its_rows() -> None:
    """Two rows packed in one forward: the K/V of their real tokens equal the eager prefill's
    (two forwards: the rows are not contiguous); other rows, and their rows' slots past the
    prompt up to the last (where the padding goes, never read), are untouched; the first
    tokens and the hidden states the logprobs read agree."""
    cfg = tiny_config(**CONFIGS[1])
    target = tiny_model(cfg, 2)
    rng = random.Random(0)
    prompts = [repetitive_prompt(rng, cfg.vocab_size, n) for n in (11, 5)]
    rows = [1, 3]
    engines = {}
    for graph in (False, True):
        engine = Engine(target)
        engine.prefill_widths = WIDTHS if graph else ()
        engine.open(4, 64)
        assert engine.cache is not None
        with torch.inference_mode():
            for t in [*engine.cache.k, *engine.cache.v]:
                t.normal_(generator=torch.Generator().manual_seed(1))
        before = [t.clone() for t in [*engine.cache.k, *engine.cache.v]]
        first = engine.prefill(rows, prompts, [0, 0], [len(p) for p in prompts], [4, 4])
        engines[graph] = (engine, first, before)
    (eager, f0, _), (graphed, f1, before) = engines[False], engines[True]
    assert f0 == f1
    assert (eager.prefill_forwards, graphed.prefill_forwards) == (2, 1)
    assert eager.cache is not None and graphed.cache is not None
    last = graphed.capacity - 1
    caches = [*eager.cache.k, *eager.cache.v], [*graphed.cache.k, *graphed.cache.v]
    pairs = zip(*caches, before, strict=True)
    for i, (a, b, old) in enumerate(pairs):
        assert torch.equal(b[[0, 2]], old[[0, 2]]), f"cache {i}: another row written"
        for row, p in zip(rows, prompts, strict=True):
            n = len(p)
            torch.testing.assert_close(b[row, :, :n], a[row, :, :n], rtol=1e-5, atol=1e-6)
            assert torch.equal(b[row, :, n:last], old[row, :, n:last]), "written past the prompt"
    for row, p, first in zip(rows, prompts, f1, strict=True):
        torch.testing.assert_close(graphed.final_hidden[row, 0], eager.final_hidden[row, 0])
        assert graphed.state.tokens[row, : len(p) + 1].tolist() == [*p, first]


@pytest.mark.parametrize("drafter", [False, True], ids=["ar", "ngram"])
def test_a_wave_of_arrivals_is_packed(drafter: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests submitted together are admitted in one step by as few forwards as the token
    budget (the widest bucket, 32 here) allows, each pack filled in row order, a prompt longer
    than the budget eagerly; every request still decodes exactly as plain AR (a mask that let
    packed prompts see each other would change their tokens)."""
    packs: list[list[int]] = []
    real = PrefillGraph.run

    def run(self: PrefillGraph, *args: Any) -> object:
        packs.append([len(ids) for ids in args[-2]])
        return real(self, *args)

    monkeypatch.setattr(PrefillGraph, "run", run)
    cfg = tiny_config(**CONFIGS[1])
    target = tiny_model(cfg, 7)
    rng = random.Random("wave")
    reqs = [
        Request(str(i), tuple(repetitive_prompt(rng, cfg.vocab_size, n)), rng.randint(1, 12))
        for i, n in enumerate([3, 9, 1, 17, 6, 12, 31, 7, 40, 2])
    ]
    lengths = [len(r.prompt_ids) for r in reqs]
    want = {r.id: ar_tokens(target, [list(r.prompt_ids)], r.max_new_tokens)[0] for r in reqs}
    engine = Engine(target, NgramDrafter(k=3) if drafter else None)
    engine.prefill_widths = WIDTHS
    sched = Scheduler(engine, slots=len(reqs), max_context=80)
    for r in reqs:
        sched.submit(r)
    report = sched.step()
    budget = WIDTHS[-1]
    assert report.rows_prefilling == len(reqs)
    assert report.prefill_forwards == len(packs) + 1  # the 40-token prompt: one eager forward
    assert len(packs) < len(reqs) - 1
    assert sorted(n for p in packs for n in p) == sorted(n for n in lengths if n <= budget)
    assert all(sum(p) <= budget for p in packs)
    assert all(sum(a) + b[0] > budget for a, b in itertools.pairwise(packs))  # full
    got: dict[str, list[int]] = {}
    while True:
        for rid, toks in report.committed:
            got.setdefault(rid, []).extend(toks)
        if not sched.has_work:
            break
        report = sched.step()
    assert got == want


def test_graphed_prefill_never_syncs(guarded: set[str]) -> None:  # noqa: F811
    cfg = tiny_config(**CONFIGS[1])
    target = tiny_model(cfg, 3)
    reqs = _requests(random.Random(1), cfg.vocab_size)
    engine = Engine(target)
    engine.prefill_widths = WIDTHS
    want = {r.id: ar_tokens(target, [list(r.prompt_ids)], r.max_new_tokens)[0] for r in reqs}
    assert _serve(engine, reqs, 2, None) == want
    assert "prefill" in guarded


def test_emulated_graph_replay_of_prefills(
    emulated_graphs: Callable[[Engine], None],  # noqa: F811
    graphed: list[tuple[int, int, int]],
) -> None:
    """Each width's first recording replayed for later prompts and rows: nothing of one call
    (its tokens, length, row) is frozen into the step."""
    cfg = tiny_config(**CONFIGS[4])
    target = tiny_model(cfg, 4)
    reqs = _requests(random.Random(2), cfg.vocab_size) * 2
    reqs = [Request(f"{i}", r.prompt_ids, r.max_new_tokens, r.stop_ids) for i, r in enumerate(reqs)]
    want = {r.id: ar_tokens(target, [list(r.prompt_ids)], r.max_new_tokens)[0] for r in reqs}
    engine = Engine(target)
    emulated_graphs(engine)
    engine.prefill_widths = WIDTHS
    assert _serve(engine, reqs, 3, None) == want
    widths = [w for _, _, w in graphed]
    assert any(widths.count(w) > 1 for w in widths)  # some widths were replayed
    assert engine.replays["n"] > engine.runner.captures  # type: ignore[attr-defined]


def test_prefill_widths_are_checked() -> None:
    engine = Engine(tiny_model(tiny_config(), 0))
    engine.open(1, 32)
    for bad in ((8, 4), (0, 4), (4, 4)):
        engine.prefill_widths = bad
        with pytest.raises(ValueError, match="increasing and positive"):
            engine.prefill_graph()


# ---------------------------------------------------------------------- CUDA graphs (GPU only)
def _cuda_model(seed: int, dtype: torch.dtype) -> Transformer:
    model = Transformer(tiny_config(arch="qwen3", vocab=113, layers=3), dtype=dtype, device="cuda")
    model.init_random(seed, std=0.15)
    return model


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphed_prefill_equals_eager(graphed: list[tuple[int, int, int]]) -> None:
    """On CUDA graphs the default widths serve single-row prefills (captured once per width,
    replayed after); fp32 tokens equal eager AR, bf16 pass token forcing."""
    for dtype in (torch.float32, torch.bfloat16):
        target = _cuda_model(0, dtype)
        reqs = _requests(random.Random(9), target.cfg.vocab_size) * 2
        reqs = [
            Request(f"{i}", r.prompt_ids, r.max_new_tokens, frozenset()) for i, r in enumerate(reqs)
        ]
        eager = Engine(target, graphs=False)
        want = {
            r.id: generate(eager, [list(r.prompt_ids)], r.max_new_tokens)[0].tokens for r in reqs
        }
        engine = Engine(target, graphs=True)
        graphed.clear()
        got = _serve(engine, reqs, 4, None)  # arrivals packed in fours
        keys = [k for k in engine.runner._graphs if isinstance(k, tuple) and k[0] == "prefill"]
        assert graphed and keys, "no prefill ran from a graph"
        assert len(graphed) > len(keys)  # replays, not only captures
        if dtype == torch.float32:
            assert got == want
            continue
        records = [(r.id, list(r.prompt_ids), got[r.id]) for r in reqs]
        report = force_tokens(target, records)
        assert report.mismatches == 0, report.first_mismatch()
    assert tokens(generate(engine, [[1, 2, 3]], 4))  # the engine still serves after re-opening


def test_a_head_that_is_not_graph_safe_keeps_the_eager_prefill(
    graphed: list[tuple[int, int, int]],
) -> None:
    """An LM-head plug without ``graph_safe`` (it may read the device on the host) is never put
    inside the prefill step; the answer is the same."""
    cfg = tiny_config(**CONFIGS[1])
    target = tiny_model(cfg, 6)
    reqs = _requests(random.Random(3), cfg.vocab_size)[:4]
    want = {r.id: ar_tokens(target, [list(r.prompt_ids)], r.max_new_tokens)[0] for r in reqs}

    class Head:
        def __call__(self, h: torch.Tensor) -> torch.Tensor:  # [1, M, hidden] -> [1, M]
            return torch.nn.functional.linear(h, target.lm_head).argmax(-1)

    target.argmax_head = Head()  # type: ignore[assignment]
    try:
        engine = Engine(target)
        engine.prefill_widths = WIDTHS
        assert _serve(engine, reqs, 1, None) == want
        assert not graphed
        target.argmax_head.graph_safe = True  # type: ignore[union-attr]
        engine = Engine(target)
        engine.prefill_widths = WIDTHS
        assert _serve(engine, reqs, 1, None) == want
        assert graphed
    finally:
        target.argmax_head = None
