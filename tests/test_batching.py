"""Continuous batching: every request's output equals its own single-request AR output (fp32),
whatever joins, leaves or prefills beside it; segment admission; per-request block length."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import tiny_config, tiny_model
from specpilot.drafters import DraftModelDrafter, NgramDrafter
from specpilot.engine import SpecEngine, VerifyOutcome
from specpilot.engine.batching import BatchScheduler, Request
from specpilot.engine.config import DeploymentSpec, EngineConfig
from specpilot.mechanisms import MECHANISMS
from specpilot.mechanisms.adaptive_block import AdaptiveBlock, BlockState
from test_engine_equivalence import repetitive_prompt

CONFIGS = [
    dict(arch="llama", heads=4, kv_heads=2, tie=True, vocab=101),
    dict(arch="qwen2", heads=4, kv_heads=2, vocab=89),
    dict(arch="qwen3", heads=8, kv_heads=1, hidden=64, vocab=61),
]


def make_requests(rng: random.Random, vocab: int, n: int, target=None) -> list[Request]:
    """Prompts of 1..70 tokens, budgets of 1..40; with ``target``, an EOS id that its greedy
    continuation of the first prompt emits mid-way, so that rows finish by EOS mid-batch."""
    prompts = [tuple(repetitive_prompt(rng, vocab, rng.randint(1, 70))) for _ in range(n)]
    eos: frozenset[int] = frozenset()
    if target is not None:
        cont = SpecEngine(target).generate([list(prompts[0])], 12)[0].tokens
        eos = frozenset([cont[rng.randrange(3, 12)]])
    return [Request(f"r{i}", p, rng.randint(1, 40), eos) for i, p in enumerate(prompts)]


def single_ar(target, req: Request) -> list[int]:
    res = SpecEngine(target).generate([list(req.prompt_ids)], req.max_new_tokens, req.stop_ids)
    return res[0].tokens


@pytest.mark.parametrize("cfg_kw", CONFIGS, ids=[c["arch"] for c in CONFIGS])
@pytest.mark.parametrize("seed", range(2))
def test_every_request_equals_its_single_ar(cfg_kw, seed):
    rng = random.Random(seed)
    cfg = tiny_config(**cfg_kw)
    target = tiny_model(cfg, seed)
    draft = tiny_model(cfg, seed + 1000)  # unrelated: low acceptance, many rollbacks
    reqs = make_requests(rng, cfg.vocab_size, 7, target)
    want = {r.id: single_ar(target, r) for r in reqs}
    assert any(len(want[r.id]) < r.max_new_tokens for r in reqs), "no row stops by EOS"
    cases = [
        (None, 3, 16, None),
        (NgramDrafter(k=1), 2, 5, None),
        (NgramDrafter(k=8, max_n=rng.randint(1, 4)), 4, 7, None),
        (NgramDrafter(k=3), 1, 64, None),
        (DraftModelDrafter(draft, k=3), 3, 9, None),
        (DraftModelDrafter(target, k=6), 5, 3, None),  # perfect drafter: stops inside drafts
        (NgramDrafter(k=8), 3, 11, AdaptiveBlock()),
        (DraftModelDrafter(draft, k=5), 4, 6, AdaptiveBlock(k_min=2, alpha=0.6, slack=0.5)),
    ]
    for drafter, slots, segment, policy in cases:
        order = list(reqs)
        rng.shuffle(order)  # another arrival order for every configuration
        sched = BatchScheduler(
            target, drafter, slots=slots, segment_tokens=segment, block_policy=policy
        )
        got = {r.id: r.tokens for r in sched.run(order)}
        label = f"{drafter and drafter.name} slots={slots} segment={segment} policy={policy}"
        assert got == want, label


@pytest.mark.parametrize("seed", range(3))
def test_requests_join_and_leave_between_steps(seed):
    """Arrivals at random steps and a cancellation mid-run change no other request's tokens."""
    rng = random.Random(seed)
    cfg = tiny_config(vocab=73)
    target = tiny_model(cfg, seed)
    reqs = make_requests(rng, cfg.vocab_size, 9, target)
    want = {r.id: single_ar(target, r) for r in reqs}
    sched = BatchScheduler(target, NgramDrafter(k=4), slots=3, segment_tokens=6)
    pending = list(reqs)
    victim = reqs[rng.randrange(len(reqs))].id
    got: dict[str, list[int]] = {}
    step = 0
    while pending or sched.has_work:
        while pending and rng.random() < 0.4:
            sched.submit(pending.pop(0))
        if step == 6:
            cancelled = sched.cancel(victim)
            if cancelled is not None:
                assert cancelled.stop_reason == "cancelled"
                assert cancelled.tokens == want[victim][: len(cancelled.tokens)]
                got[victim] = want[victim]
        for res in sched.step().finished:
            got[res.id] = res.tokens
        step += 1
    assert got == want
    assert sched.running == 0 and sched.waiting == 0


def test_segment_admission_keeps_running_decodes_going():
    """A long prompt goes in over ceil(L / segment) steps while a running row commits every step."""
    cfg = tiny_config(vocab=67)
    target = tiny_model(cfg, 3)
    rng = random.Random(3)
    short = Request("short", tuple(repetitive_prompt(rng, 67, 5)), 40)
    long = Request("long", tuple(repetitive_prompt(rng, 67, 100)), 5)
    sched = BatchScheduler(target, None, slots=2, segment_tokens=16)
    sched.submit(short)
    sched.step()  # short's prompt goes in: it is decoding from the next step on
    sched.submit(long)
    admitted = sched.steps
    results = {}
    while sched.has_work:
        before = sched.steps
        report = sched.step()
        committed = dict(report.committed)
        if before < admitted + 7:  # long is in prefill for 7 steps (100 = 6 x 16 + 4)
            assert report.rows_prefilling == 1
            assert len(committed["short"]) == 1  # the running decode was not stalled
        for res in report.finished:
            results[res.id] = res
    assert results["long"].first_token_step == admitted + 6
    assert results["long"].tokens == single_ar(target, long)
    assert results["short"].tokens == single_ar(target, short)


def test_a_lone_request_runs_one_row_not_every_slot():
    """Slots above the highest occupied one do not run: a single request in a 4-slot scheduler
    costs a one-row forward, and a second request (lowest free slot) makes it two rows."""
    cfg = tiny_config(vocab=67)
    target = tiny_model(cfg, 3)
    rng = random.Random(4)
    a = Request("a", tuple(repetitive_prompt(rng, 67, 6)), 12)
    b = Request("b", tuple(repetitive_prompt(rng, 67, 6)), 12)
    sched = BatchScheduler(target, NgramDrafter(k=3), slots=4, segment_tokens=8)
    sched.submit(a)
    assert sched.step().forward_tokens == 6  # one row: its 6-token prompt
    widths = [sched.step().forward_tokens for _ in range(3)]
    assert all(w <= 4 for w in widths)  # one row: pending + at most 3 drafts
    sched.submit(b)
    assert sched.step().forward_tokens == 2 * 6  # two rows, padded to b's prompt
    results = {}
    while sched.has_work:
        for res in sched.step().finished:
            results[res.id] = res
    assert results["a"].tokens == single_ar(target, a)
    assert results["b"].tokens == single_ar(target, b)


def test_a_faulty_verifier_is_caught():
    """Accepting every drafted token commits tokens AR would not: the equality test can fail."""

    def accept_all(drafts, lens, argmax) -> VerifyOutcome:
        return VerifyOutcome(accepted_len=lens, bonus=argmax.gather(1, lens[:, None])[:, 0])

    cfg = tiny_config(vocab=59)
    target, draft = tiny_model(cfg, 0), tiny_model(cfg, 1)
    reqs = make_requests(random.Random(0), cfg.vocab_size, 4)
    sched = BatchScheduler(target, DraftModelDrafter(draft, k=4), slots=2, verify_fn=accept_all)
    got = [r.tokens for r in sched.run(reqs)]
    assert got != [single_ar(target, r) for r in reqs]


def test_adaptive_block_follows_each_requests_acceptance():
    policy = AdaptiveBlock(k_min=2, alpha=0.5, slack=1.0)
    st = policy.new_state(8)
    assert isinstance(st, BlockState) and policy.block(st, 8) == 8
    for _ in range(10):
        policy.update(st, policy.block(st, 8), 0)
    assert policy.block(st, 8) == 2  # nothing accepted: down to k_min
    for _ in range(10):
        policy.update(st, policy.block(st, 8), policy.block(st, 8))
    assert policy.block(st, 8) == 8  # everything accepted: back up to k
    with pytest.raises(ValueError):
        AdaptiveBlock(k_min=0)


def test_adaptive_block_drafts_less_where_nothing_is_accepted():
    """Same tokens as the fixed block, fewer drafted tokens verified for an unrelated drafter."""
    cfg = tiny_config(vocab=83)
    target, draft = tiny_model(cfg, 5), tiny_model(cfg, 6)
    reqs = make_requests(random.Random(5), cfg.vocab_size, 6)

    def run(policy):
        sched = BatchScheduler(target, DraftModelDrafter(draft, k=8), slots=3, block_policy=policy)
        res = sched.run(reqs)
        return [r.tokens for r in res], res

    fixed_tokens, fixed = run(None)
    adapt_tokens, adapt = run(AdaptiveBlock())
    assert adapt_tokens == fixed_tokens == [single_ar(target, r) for r in reqs]
    fixed_cost = sum(sum(r.stats.drafted) for r in fixed)
    adapt_cost = sum(sum(r.stats.drafted) for r in adapt)
    assert adapt_cost < fixed_cost


def test_adaptive_block_is_registered_for_batched_mode_only():
    mech = MECHANISMS["adaptive-block"]
    assert mech.plug_point == "drafter_schedule"
    assert mech.applies.allows("cpu", "fp32", "ngram", "batched", "llama")
    assert not mech.applies.allows("cpu", "fp32", "ngram", "single", "llama")
    cfg = EngineConfig(
        DeploymentSpec(target="x", mode="batched"), mechanisms={"adaptive-block": {"k_min": 2}}
    )
    assert mech.resolve_knobs(cfg.mechanisms["adaptive-block"])["k_min"] == 2


def test_bad_scheduler_input_gets_one_sentence():
    cfg = tiny_config(vocab=31)
    sched = BatchScheduler(tiny_model(cfg, 0), slots=2, max_context=64)
    from specpilot.errors import PromptTooLongError

    with pytest.raises(PromptTooLongError, match="context of 64"):
        sched.submit(Request("a", tuple(range(30)), 40))
    with pytest.raises(PromptTooLongError, match="empty"):
        sched.submit(Request("b", (), 4))
    with pytest.raises(ValueError):
        Request("c", (1,), 0)
    assert torch.equal(sched.cache.lengths, torch.zeros(2, dtype=torch.int64))


def test_bench_batched_end_to_end(tmp_path, capsys):
    """The command: two concurrencies, Poisson arrivals, adaptive-block from an engine config;
    every output token-forced and equal to the AR-batched output."""
    import json

    from specpilot.cli import main
    from test_cli import tiny_dir

    model = tiny_dir(tmp_path / "model")
    engine = tmp_path / "engine.json"
    EngineConfig(
        DeploymentSpec(target=str(model), drafter="ngram", device="cpu", mode="batched"),
        k=4,
        drafter_knobs={"max_n": 3, "min_n": 1},
        mechanisms={"adaptive-block": {}},
    ).save(engine)
    out = tmp_path / "runs.jsonl"
    argv = ["bench", "--mode", "batched", "--engine", str(engine), "--concurrency", "2,3"]
    argv += ["--requests", "5", "--limit", "3", "--max-new-tokens", "12", "--arrival-rate", "200"]
    code = main([*argv, "--segment-tokens", "7", "--json", "--out", str(out)])
    result = json.loads(capsys.readouterr().out)
    assert code == 0
    assert [lv["concurrency"] for lv in result["levels"]] == [2, 3]
    assert result["identical_to_ar"] == "10/10"
    assert result["forcing"]["ok"] and result["forcing"]["mismatches"] == 0
    assert result["mechanisms"] == {"adaptive-block": {}}
    lines = out.read_text().splitlines()
    assert len(lines) == 20  # 2 concurrencies x 2 engines x 5 requests
    lv = result["levels"][0]
    assert lv["spec_latency_s"]["p50"] <= lv["spec_latency_s"]["p99"]
