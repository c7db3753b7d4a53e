"""In fp32, speculative output equals plain AR output token for token, for every drafter under
every verify plan (``tests/engine_cases.py``), batched (rows of different lengths) and alone, with
stops inside drafts; plus the verify rule's exact cases, the stats convention and refusals."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from conftest import tiny_config, tiny_model
from engine_cases import CASES, CONFIG_IDS, CONFIGS, ar_tokens, repetitive_prompt, tokens
from specpilot.drafters import DraftModelDrafter, NgramDrafter
from specpilot.drafters.simulated import SimulatedAcceptance
from specpilot.drafters.static_tree import StaticTree
from specpilot.engine import Engine, GenerationResult, Request, Scheduler, generate
from specpilot.engine.plans import ChainPlan, PackedPlan, TreePlan
from specpilot.engine.tree_policy import FixedTree
from specpilot.forcing import force_tokens

SEEDS = range(2)
DRAWS = range(1)  # per case and config (5 per case, 165 in all; tests/test_graphs.py adds one
# more per case): seeded draws of prompts, lengths, stops, k and the drafter's weights


@pytest.mark.parametrize("cfg_kw", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("case", list(CASES))
def test_every_drafter_and_plan_equals_ar(case: str, cfg_kw: dict) -> None:
    """Per seed, on one engine: three rows of different lengths in one batch, one of them alone
    (re-opened for batch 1), then the scheduler over two rows; every request equals plain AR,
    and the case must really draft."""
    cfg = tiny_config(**cfg_kw)
    drafted = 0
    for seed in DRAWS:
        rng = random.Random(f"{case}/{cfg.arch}/{cfg.vocab_size}/{seed}")
        target = tiny_model(cfg, seed)
        other = tiny_model(cfg, seed + 1000)  # an unrelated drafter: low acceptance, rollbacks
        prompts = [repetitive_prompt(rng, cfg.vocab_size, rng.randint(1, 40)) for _ in range(3)]
        max_new = rng.randint(16, 48)
        eos = [rng.randrange(cfg.vocab_size)]
        want = ar_tokens(target, prompts, max_new, eos)
        engine = CASES[case](target, other, rng)
        res = generate(engine, prompts, max_new, eos)
        assert tokens(res) == want, f"{case} seed={seed} batched"
        drafted += sum(sum(r.stats.drafted) for r in res)
        for r in res:  # each position is accepted at most as often as it was drafted
            assert all(a <= d for a, d in zip(r.stats.accepted, r.stats.drafted, strict=True))
        row = seed % len(prompts)
        alone = generate(engine, [prompts[row]], max_new, eos)[0]
        assert alone.tokens == want[row], f"{case} seed={seed} row {row} alone"
        # continuous batching: four requests through two rows, prompts fed in segments, so
        # rows are refilled while the other decodes (drafter and plan forget the old sequence)
        sched = Scheduler(engine, slots=2, segment_tokens=rng.choice((5, 16)), max_context=96)
        reqs = [Request(str(i), tuple(p), max_new, frozenset(eos)) for i, p in enumerate(prompts)]
        reqs.append(Request("again", tuple(prompts[0]), max_new, frozenset(eos)))
        got = [r.tokens for r in sched.run(reqs)]
        assert got == [*want, want[0]], f"{case} seed={seed} scheduler"
        if isinstance(engine.drafter, SimulatedAcceptance):
            assert engine.drafter.divergences == 0  # fp32: the verify and the oracle agree
    assert drafted > 0, f"{case} never drafted"


@pytest.mark.parametrize("cfg_kw", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("seed", SEEDS)
def test_plain_ar_rows_are_independent(cfg_kw: dict, seed: int) -> None:
    rng = random.Random(seed)
    cfg = tiny_config(**cfg_kw)
    target = tiny_model(cfg, seed)
    prompts = [repetitive_prompt(rng, cfg.vocab_size, rng.randint(1, 40)) for _ in range(3)]
    eos = [rng.randrange(cfg.vocab_size)]
    batched = ar_tokens(target, prompts, 40, eos)
    assert [ar_tokens(target, [p], 40, eos)[0] for p in prompts] == batched


@pytest.mark.parametrize("seed", range(3))
def test_cpu_gemv_copies_change_no_token(seed: int) -> None:
    """With [in, out] copies for one-row products, AR and speculative outputs stay the same."""
    rng = random.Random(seed)
    cfg = tiny_config(arch="qwen2", vocab=79, tie=True)
    plain, fast = tiny_model(cfg, seed), tiny_model(cfg, seed)
    fast.add_gemv_copies()
    prompts = [repetitive_prompt(rng, cfg.vocab_size, rng.randint(1, 30)) for _ in range(2)]
    want = ar_tokens(plain, prompts, 40)
    assert ar_tokens(fast, prompts, 40) == want
    for drafter in (NgramDrafter(k=5), DraftModelDrafter(fast, k=3)):
        assert tokens(generate(Engine(fast, drafter), prompts, 40)) == want


PERFECT_PLANS = {
    "chain": lambda k: ChainPlan(),
    "packed": lambda k: PackedPlan(None, 4),
    "tree": lambda k: TreePlan(FixedTree(StaticTree.chain(k))),
}


@pytest.mark.parametrize("plan", list(PERFECT_PLANS))
@pytest.mark.parametrize("seed", range(3))
def test_perfect_drafter_eos_and_length_inside_a_draft(plan: str, seed: int) -> None:
    """The target drafting for itself accepts everything, so stops fall inside drafts."""
    cfg = tiny_config(vocab=71)
    target = tiny_model(cfg, seed)
    prompt = [3, 1, 4, 1, 5]
    free = ar_tokens(target, [prompt], 40)[0]

    def run(k: int, max_new: int, eos: list[int]) -> GenerationResult:
        drafter = DraftModelDrafter(target, k=k)
        return generate(
            Engine(target, drafter, plan=PERFECT_PLANS[plan](k)), [prompt], max_new, eos
        )[0]

    for stop_at in (1, 2, 5, 11):  # EOS = the token AR emits at this index (first occurrence)
        eos = free[stop_at]
        want = generate(Engine(target), [prompt], 40, [eos])[0]
        assert want.stop_reason == "eos" and want.tokens[-1] == eos
        for k in (2, 4, 7, 16):
            got = run(k, 40, [eos])
            assert got.tokens == want.tokens and got.stop_reason == "eos", (stop_at, k)
    for max_new in (1, 2, 3, 9, 17):
        for k in (4, 8, 16):
            res = run(k, max_new, [])
            assert res.tokens == free[:max_new] and res.stop_reason == "length", (max_new, k)
    assert run(8, 40, []).stats.mean_accepted_len > 4.0  # it did accept whole drafts


def test_one_token_prompt_and_batch_rows_finishing_at_different_times() -> None:
    cfg = tiny_config(vocab=53)
    target = tiny_model(cfg, 7)
    prompts = [[5], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [9, 9]]
    free = ar_tokens(target, prompts, 30)
    eos = [free[1][4]]  # row 1 stops early
    want = ar_tokens(target, prompts, 30, eos)
    got = generate(Engine(target, DraftModelDrafter(target, k=5)), prompts, 30, eos)
    assert tokens(got) == want
    assert len(want[1]) <= 5 and got[1].stop_reason == "eos"


@pytest.mark.parametrize("seed", range(3))
def test_speculative_outputs_pass_token_forcing_with_zero_near_ties(seed: int) -> None:
    cfg = tiny_config(arch="qwen3", vocab=83)
    target = tiny_model(cfg, seed)
    rng = random.Random(seed)
    prompts = [repetitive_prompt(rng, cfg.vocab_size, 24) for _ in range(2)]
    results = generate(Engine(target, NgramDrafter(k=6)), prompts, 48)
    report = force_tokens(
        target,
        [(str(i), p, r.tokens) for i, (p, r) in enumerate(zip(prompts, results, strict=True))],
    )
    assert report.ok and report.near_ties == 0 and report.matches == 96


def test_drafter_with_another_vocabulary_is_refused() -> None:
    from specpilot.errors import IncompatibleDrafterError

    draft = tiny_model(tiny_config(vocab=50), 0)
    with pytest.raises(IncompatibleDrafterError, match="vocabulary"):
        DraftModelDrafter(draft, k=4, target_vocab_size=51)


def test_bad_requests_are_refused() -> None:
    from specpilot.errors import PromptTooLongError

    target = tiny_model(tiny_config(), 0)
    with pytest.raises(PromptTooLongError, match="context"):
        generate(Engine(target), [[1] * 500], 20)
    with pytest.raises(PromptTooLongError, match="empty"):
        generate(Engine(target), [[1, 2], []], 20)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(Engine(target), [[1, 2]], 0)
    with pytest.raises(ValueError, match="drafter"):
        Engine(target, None, plan=ChainPlan())


class FakeRows:
    """The part of ``DraftRows`` a host drafter reads: contexts, activity, ``write_drafts``."""

    def __init__(self, contexts: list[list[int]]) -> None:
        self.contexts = contexts
        self.active = [True] * len(contexts)
        self.state = SimpleNamespace(batch_size=len(contexts))
        self.written: list[list[int]] = []

    def write_drafts(self, drafts: list[list[int]]) -> list[int]:
        self.written = [list(d) for d in drafts]
        return [len(d) for d in drafts]


def test_ngram_drafter_proposes_the_continuation_of_the_latest_match() -> None:
    d = NgramDrafter(k=3, max_n=2)
    ctx = [1, 2, 3, 4, 9, 1, 2, 7, 8, 1, 2]
    rows = FakeRows([ctx])
    d.bind(rows)  # type: ignore[arg-type]
    assert d.propose(rows, 0) == [3] and rows.written == [[7, 8, 1]]  # type: ignore[arg-type]
    rows.contexts[0] = [*ctx, 7]  # contexts only grow: the index is extended, not rebuilt
    d.propose(rows, 0)  # type: ignore[arg-type]
    assert rows.written == [[8, 1, 2]]  # suffix (2, 7) last seen at 6..7 → continue with 8, 1, 2
    rows.contexts[0] = [5, 6, 5]  # the row takes a new sequence
    d.admitted(rows, [0])  # type: ignore[arg-type]
    assert d.propose(rows, 0) == [2] and rows.written == [[6, 5]]  # type: ignore[arg-type]
    rows.active[0] = False
    assert d.propose(rows, 0) == [0]  # type: ignore[arg-type]


def test_verify_terminology_cases() -> None:
    from specpilot.engine import greedy_verify

    draft = torch.tensor([[5, 6, 7], [5, 6, 7], [5, 6, 7], [1, 0, 0]])
    lens = torch.tensor([3, 3, 3, 1])
    argmax = torch.tensor([[5, 6, 7, 9], [5, 2, 7, 9], [4, 6, 7, 9], [1, 3, 3, 3]])
    out = greedy_verify(draft, lens, argmax)
    assert out.accepted_len.tolist() == [3, 1, 0, 1]
    assert out.bonus.tolist() == [9, 2, 4, 3]
    # padding past a row's draft length is never accepted, even if it matches
    out = greedy_verify(torch.tensor([[5, 6]]), torch.tensor([1]), torch.tensor([[5, 6, 1]]))
    assert out.accepted_len.tolist() == [1] and out.bonus.tolist() == [6]


def test_acceptance_stats_cover_only_drafted_positions() -> None:
    from specpilot.engine import AcceptanceStats

    s = AcceptanceStats()
    s.record(draft_len=3, accepted_len=3, committed=4)
    s.record(draft_len=2, accepted_len=0, committed=1)
    s.record(draft_len=0, accepted_len=0, committed=1)
    assert s.drafted == [2, 2, 1] and s.accepted == [1, 1, 1]
    assert s.acceptance_rates() == [0.5, 0.5, 1.0]
    assert s.accept_hist == [2, 0, 0, 1] and s.mean_accepted_len == 2.0


def test_cut_at_stop_keeps_the_room_and_the_first_stop_token() -> None:
    from specpilot.engine.verify import cut_at_stop

    assert cut_at_stop([5, 6, 7], 10, {9}) == ([5, 6, 7], False)
    assert cut_at_stop([5, 6, 7], 2, {9}) == ([5, 6], False)
    assert cut_at_stop([5, 9, 7, 9], 10, {9}) == ([5, 9], True)
    assert cut_at_stop([5, 6, 9], 2, {9}) == ([5, 6], False)  # the stop token is past the room
    assert cut_at_stop([5, 6], 0, {9}) == ([], False)
