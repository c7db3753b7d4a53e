"""In fp32, speculative output equals plain AR output token for token, for every drafter."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import tiny_config, tiny_model
from specpilot.drafters import DraftModelDrafter, NgramDrafter
from specpilot.engine import SpecEngine
from specpilot.forcing import force_tokens

CONFIGS = [
    dict(arch="llama", heads=4, kv_heads=4, tie=False, vocab=97),  # MHA, untied
    dict(arch="llama", heads=4, kv_heads=2, tie=True, vocab=101),  # GQA 2:1, tied, odd vocab
    dict(arch="llama", heads=8, kv_heads=1, hidden=64, vocab=61),  # MQA
    dict(arch="qwen2", heads=4, kv_heads=2, vocab=89),  # qkv bias
    dict(arch="qwen3", heads=4, kv_heads=2, vocab=113),  # q/k RMSNorm
]


def repetitive_prompt(rng: random.Random, vocab: int, length: int) -> list[int]:
    """Prompts with repeated spans, so that n-gram lookup finds something to propose."""
    base = [rng.randrange(vocab) for _ in range(max(1, length // 3))]
    out = (base * 4)[:length]
    for _ in range(length // 8):
        out[rng.randrange(length)] = rng.randrange(vocab)
    return out


def ar_tokens(target, prompts, max_new, eos):
    return [r.tokens for r in SpecEngine(target).generate(prompts, max_new, eos)]


@pytest.mark.parametrize(
    "cfg_kw", CONFIGS, ids=[f"{c['arch']}-h{c['heads']}kv{c['kv_heads']}" for c in CONFIGS]
)
@pytest.mark.parametrize("seed", range(4))
def test_spec_equals_ar_all_drafters(cfg_kw, seed):
    rng = random.Random(seed)
    cfg = tiny_config(**cfg_kw)
    target = tiny_model(cfg, seed)
    draft = tiny_model(cfg, seed + 1000)  # an unrelated drafter: low acceptance, many rollbacks
    prompts = [repetitive_prompt(rng, cfg.vocab_size, rng.randint(1, 40)) for _ in range(3)]
    max_new = rng.randint(20, 60)
    eos = [rng.randrange(cfg.vocab_size)]
    want = ar_tokens(target, prompts, max_new, eos)
    for k in (1, 3, 8, 16):
        for drafter in (NgramDrafter(k=k, max_n=rng.randint(1, 4)), DraftModelDrafter(draft, k=k)):
            # batch of three rows of different lengths, and each prompt alone
            got = [r.tokens for r in SpecEngine(target, drafter).generate(prompts, max_new, eos)]
            assert got == want, f"{drafter.name} k={k} batched"
            single = [
                SpecEngine(target, drafter).generate([p], max_new, eos)[0].tokens for p in prompts
            ]
            assert single == want, f"{drafter.name} k={k} single"


@pytest.mark.parametrize("seed", range(3))
def test_cpu_gemv_copies_change_no_token(seed):
    """With [in, out] copies for one-row products, AR and speculative outputs stay the same."""
    rng = random.Random(seed)
    cfg = tiny_config(arch="qwen2", vocab=79, tie=True)
    plain, fast = tiny_model(cfg, seed), tiny_model(cfg, seed)
    fast.add_gemv_copies()
    prompts = [repetitive_prompt(rng, cfg.vocab_size, rng.randint(1, 30)) for _ in range(2)]
    want = ar_tokens(plain, prompts, 40, [])
    assert ar_tokens(fast, prompts, 40, []) == want
    for drafter in (NgramDrafter(k=5), DraftModelDrafter(fast, k=3)):
        got = [r.tokens for r in SpecEngine(fast, drafter).generate(prompts, 40)]
        assert got == want


@pytest.mark.parametrize("seed", range(3))
def test_perfect_drafter_eos_and_length_inside_a_draft(seed):
    """The target drafting for itself accepts everything, so stops fall inside drafts."""
    cfg = tiny_config(vocab=71)
    target = tiny_model(cfg, seed)
    prompt = [3, 1, 4, 1, 5]
    free = SpecEngine(target).generate([prompt], 40)[0].tokens
    for stop_at in (1, 2, 5, 11):  # EOS = the token AR emits at this index (first occurrence)
        eos = free[stop_at]
        want = SpecEngine(target).generate([prompt], 40, [eos])[0]
        assert want.stop_reason == "eos" and want.tokens[-1] == eos
        for k in (2, 4, 7, 16):
            got = SpecEngine(target, DraftModelDrafter(target, k=k)).generate([prompt], 40, [eos])[
                0
            ]
            assert got.tokens == want.tokens and got.stop_reason == "eos"
    for max_new in (1, 2, 3, 9, 17):
        want_tokens = free[:max_new]
        for k in (4, 8, 16):
            res = SpecEngine(target, DraftModelDrafter(target, k=k)).generate([prompt], max_new)[0]
            assert res.tokens == want_tokens and res.stop_reason == "length"
    res = SpecEngine(target, DraftModelDrafter(target, k=8)).generate([prompt], 40)[0]
    assert res.stats.mean_accepted_len > 4.0  # it did accept whole drafts


def test_one_token_prompt_and_batch_rows_finishing_at_different_times():
    cfg = tiny_config(vocab=53)
    target = tiny_model(cfg, 7)
    prompts = [[5], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [9, 9]]
    free = ar_tokens(target, prompts, 30, [])
    eos = [free[1][4]]  # row 1 stops early
    want = ar_tokens(target, prompts, 30, eos)
    got = [
        r.tokens
        for r in SpecEngine(target, DraftModelDrafter(target, k=5)).generate(prompts, 30, eos)
    ]
    assert got == want
    assert len(want[1]) <= 5


@pytest.mark.parametrize("seed", range(3))
def test_speculative_outputs_pass_token_forcing_with_zero_near_ties(seed):
    cfg = tiny_config(arch="qwen3", vocab=83)
    target = tiny_model(cfg, seed)
    rng = random.Random(seed)
    prompts = [repetitive_prompt(rng, cfg.vocab_size, 24) for _ in range(2)]
    results = SpecEngine(target, NgramDrafter(k=6)).generate(prompts, 48)
    report = force_tokens(
        target,
        [(str(i), p, r.tokens) for i, (p, r) in enumerate(zip(prompts, results, strict=True))],
    )
    assert report.ok and report.near_ties == 0 and report.matches == 96


def test_drafter_with_another_vocabulary_is_refused():
    from specpilot.errors import IncompatibleDrafterError

    draft = tiny_model(tiny_config(vocab=50), 0)
    with pytest.raises(IncompatibleDrafterError, match="vocabulary"):
        DraftModelDrafter(draft, k=4, target_vocab_size=51)


def test_prompt_longer_than_context_is_refused():
    from specpilot.errors import PromptTooLongError

    target = tiny_model(tiny_config(), 0)
    with pytest.raises(PromptTooLongError, match="context"):
        SpecEngine(target).generate([[1] * 500], 20)


def test_ngram_drafter_proposes_the_continuation_of_the_latest_match():
    d = NgramDrafter(k=3, max_n=2)
    ctx = [1, 2, 3, 4, 9, 1, 2, 7, 8, 1, 2]
    d.start([ctx])
    prop = d.propose([ctx], [3])
    assert prop.lengths == [3] and prop.tokens[0].tolist() == [7, 8, 1]
    ctx2 = [*ctx, 7]
    prop = d.propose([ctx2], [5])  # suffix (2, 7) last seen at 6..7 → continue with 8, 1, 2
    assert prop.tokens[0].tolist() == [8, 1, 2]
    assert d.propose([[5, 6]], [3]).lengths == [0] or True  # fresh rows need start()


def test_verify_terminology_cases():
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


def test_acceptance_stats_cover_only_drafted_positions():
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
