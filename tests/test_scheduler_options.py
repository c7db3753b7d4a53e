"""Per-request options of the scheduler: a draft cap (0: no speculation) changes the speed only,
never a token; logprobs come from the verify forward and equal a direct forward's log-softmax;
windows of AR steps end early for a first token and when the caller interrupts them."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import tiny_config, tiny_model
from engine_cases import repetitive_prompt
from specpilot.drafters import DraftModelDrafter, NgramDrafter
from specpilot.engine import Engine, Request, Scheduler, generate
from specpilot.engine.plans import ChainPlan, PackedPlan
from specpilot.models.transformer import Transformer

K = 6


def target() -> Transformer:
    return tiny_model(tiny_config(arch="llama", heads=4, kv_heads=2, tie=True, vocab=101), seed=3)


def prompts(n: int, seed: int, vocab: int = 101) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    return [tuple(repetitive_prompt(rng, vocab, rng.randint(2, 30))) for _ in range(n)]


def ar_tokens(t: Transformer, prompt: tuple[int, ...], n: int) -> list[int]:
    return generate(Engine(t), [list(prompt)], n)[0].tokens


@pytest.mark.parametrize("plan", ["chain", "packed"])
def test_draft_caps_change_speed_never_tokens(plan):
    t = target()
    ps = prompts(6, seed=1)
    caps = [None, 0, 1, 3, 0, None]
    # the target drafting for itself: every draft is accepted, so only a cap bounds a cycle
    eng = Engine(
        t, DraftModelDrafter(t, k=K), plan=ChainPlan() if plan == "chain" else PackedPlan()
    )
    sched = Scheduler(eng, slots=3, segment_tokens=8)
    reqs = [
        Request(f"r{i}", p, 24, draft_cap=c) for i, (p, c) in enumerate(zip(ps, caps, strict=True))
    ]
    results = sched.run(reqs)
    for p, res, cap in zip(ps, results, caps, strict=True):
        assert res.tokens == ar_tokens(t, p, 24)
        s = res.stats
        most = max(n for n, c in enumerate(s.accept_hist) if c)  # most drafts one cycle accepted
        if cap is None:
            assert most == K  # uncapped, a perfect drafter's cycle takes all K
        else:
            assert most <= cap and len(s.drafted) <= cap  # never drafted past the cap
            assert most == cap  # and the cap is reached (perfect drafts)


def test_all_rows_off_run_ar_windows_and_the_drafter_catches_up():
    t = target()
    ps = prompts(4, seed=2)
    eng = Engine(t, DraftModelDrafter(t, k=3))
    sched = Scheduler(eng, slots=2)
    # two requests without speculation run alone first (AR windows), then drafting ones join
    reqs = [Request(f"r{i}", p, 20, draft_cap=0 if i < 2 else None) for i, p in enumerate(ps)]
    for res, p in zip(sched.run(reqs), ps, strict=True):
        assert res.tokens == ar_tokens(t, p, 20)
    assert all(r.stats.mean_accepted_len == 1.0 for r in sched.run(reqs[:2]))


@pytest.mark.parametrize("drafter", ["none", "ngram", "perfect"])
def test_logprobs_equal_a_direct_forward(drafter):
    t = target()
    d = {"none": None, "ngram": NgramDrafter(k=4), "perfect": DraftModelDrafter(t, k=4)}[drafter]
    eng = Engine(t, d, sync_every=4)  # AR windows of 4 steps unless a row wants logprobs
    sched = Scheduler(eng, slots=3, segment_tokens=5)
    ps = prompts(5, seed=4)
    tops = [5, None, 0, 20, 3]
    reqs = [
        Request(f"r{i}", p, 16, logprobs=k) for i, (p, k) in enumerate(zip(ps, tops, strict=True))
    ]
    for p, res, top in zip(ps, sched.run(reqs), tops, strict=True):
        assert res.tokens == ar_tokens(t, p, 16)
        if top is None:
            assert res.logprobs == []
            continue
        seq = torch.tensor([list(p) + res.tokens], dtype=torch.int64)
        cache = t.allocate_cache(1, seq.shape[1] + 1)
        logits = t.forward(seq, cache).logits[0].float()  # [T, V]
        want = torch.log_softmax(logits, -1)[len(p) - 1 : -1]  # the position before each token
        assert [lp.token for lp in res.logprobs] == res.tokens
        got = torch.tensor([lp.logprob for lp in res.logprobs])
        ref = want.gather(1, torch.tensor(res.tokens)[:, None])[:, 0]
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
        for lp, row in zip(res.logprobs, want, strict=True):
            assert len(lp.top) == top
            if top:
                vals, idx = row.topk(top)
                assert [i for i, _ in lp.top][:1] == idx.tolist()[:1] == [lp.token]
                torch.testing.assert_close(
                    torch.tensor([v for _, v in lp.top]), vals, atol=1e-4, rtol=0
                )


def counts(report) -> dict[str, int]:
    """Tokens each request committed in a step (its first token and its decode step apart)."""
    out: dict[str, int] = {}
    for rid, toks in report.committed:
        out[rid] = out.get(rid, 0) + len(toks)
    return out


def test_a_first_token_cuts_the_window_and_interrupt_ends_it():
    t = target()
    eng = Engine(t, sync_every=8)
    sched = Scheduler(eng, slots=2)
    a, b = prompts(2, seed=5)
    sched.submit(Request("a", a, 40))
    assert counts(sched.step()) == {"a": 2}  # its first token, then one AR step, not eight
    assert counts(sched.step()) == {"a": 8}  # a full window
    asked = []

    def interrupt() -> bool:
        asked.append(1)
        return len(asked) >= 3  # "a request waits" before the fourth step

    assert counts(sched.step(interrupt)) == {"a": 3}
    sched.submit(Request("b", b, 10))
    assert counts(sched.step()) == {"a": 1, "b": 2}  # b's first token cuts a's window too
    done = {}
    while sched.has_work:
        done |= {r.id: r.tokens for r in sched.step().finished}
    assert done["a"] == ar_tokens(t, a, 40) and done["b"] == ar_tokens(t, b, 10)


def test_a_window_cap_bounds_every_step_and_keeps_the_tokens():
    """``Scheduler(window=3)`` (``serve --stream-window``): no step commits more than 3 tokens a
    row though the engine's windows are 8, and the tokens are plain AR's."""
    t = target()
    sched = Scheduler(Engine(t, sync_every=8), slots=1, window=3)
    (a,) = prompts(1, seed=7)
    sched.submit(Request("a", a, 20))
    sizes, done = [], {}
    while sched.has_work:
        report = sched.step()
        sizes.append(counts(report).get("a", 0))
        done |= {r.id: r.tokens for r in report.finished}
    assert sizes[0] == 2 and max(sizes[1:]) == 3  # first token + one step, then windows of 3
    assert done["a"] == ar_tokens(t, a, 20)
    with pytest.raises(ValueError, match="window"):
        Scheduler(Engine(t), window=0)
