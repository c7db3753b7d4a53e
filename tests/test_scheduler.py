"""Continuous batching on the one engine (``engine/scheduler.py``): in fp32 every request's
tokens equal its own single-request AR output, whatever runs beside it, for every drafter and
verify plan; rows refilled, prompts entering segment by segment while other rows decode, requests
that end on their first token or inside a draft, cancel, clear errors, and per-row policy state
that starts afresh when a row takes a new request. Runs eagerly on the CPU; the CUDA-graph case
is skipped without CUDA."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from conftest import tiny_config, tiny_model
from engine_cases import repetitive_prompt
from specpilot.drafters import BlockDrafter, Drafter, DraftModelDrafter, NgramDrafter
from specpilot.drafters.simulated import AcceptanceProfile, SimulatedAcceptance
from specpilot.drafters.static_tree import StaticTree, build_static_tree
from specpilot.drafters.tree import TreeShape
from specpilot.engine import Engine, Request, RequestResult, Scheduler, generate
from specpilot.engine.accept import commit_block
from specpilot.engine.plans import ChainPlan, PackedPlan, TreePlan
from specpilot.engine.rows import RowState
from specpilot.engine.tree_policy import FixedTree, RaggedTrees
from specpilot.engine.view import VerifyPlan
from specpilot.engine.widths import RowBlockLength, TieredBudget
from specpilot.errors import PromptTooLongError
from specpilot.mechanisms.adaptive_block import AdaptiveBlock
from specpilot.models.transformer import Transformer

CONFIGS = [
    dict(arch="llama", heads=4, kv_heads=2, tie=True, vocab=101),
    dict(arch="qwen3", heads=8, kv_heads=1, hidden=64, vocab=61),
]
K = 4


def single_ar(target: Transformer, req: Request) -> list[int]:
    """The request alone, in plain AR: what it must get whatever runs beside it."""
    res = generate(Engine(target), [list(req.prompt_ids)], req.max_new_tokens, req.stop_ids)
    return res[0].tokens


def make_requests(rng: random.Random, target: Transformer, n: int) -> list[Request]:
    """Prompts of 1..40 tokens, budgets of 1..30, and an EOS id that the first prompt's greedy
    continuation emits mid-way, so that some rows finish by EOS mid-batch."""
    vocab = target.cfg.vocab_size
    prompts = [tuple(repetitive_prompt(rng, vocab, rng.randint(1, 40))) for _ in range(n)]
    cont = generate(Engine(target), [list(prompts[0])], 12)[0].tokens
    eos = frozenset([cont[rng.randrange(3, 12)]])
    return [Request(f"r{i}", p, rng.randint(1, 30), eos) for i, p in enumerate(prompts)]


def sim(inner: Drafter, tau: float = 3.0, seed: int = 0, **kw: float) -> SimulatedAcceptance:
    profile = AcceptanceProfile.parse(f"tau={tau},block={inner.k + 1}")
    return SimulatedAcceptance(inner, profile, seed=seed, **kw)  # type: ignore[arg-type]


def block_drafter(target: Transformer, seed: int) -> BlockDrafter:
    block = BlockDrafter(target, num_layers=1, block=K + 1, num_context_layers=2)
    block.weights.init_random(seed + 3)
    return block


TREE = TreeShape.uniform(depth=K, width=2, max_nodes=6)

Case = tuple[str, Callable[[Transformer, Transformer, int], Engine], int, int | None]
"""(label, engine factory (target, unrelated draft model, seed), slots, segment_tokens)."""

CASES: list[Case] = [
    ("ar", lambda t, d, s: Engine(t), 3, 16),
    ("ngram k=1", lambda t, d, s: Engine(t, NgramDrafter(k=1)), 2, 5),
    ("ngram", lambda t, d, s: Engine(t, NgramDrafter(k=6, max_n=1 + s % 3)), 4, 7),
    ("ngram one slot", lambda t, d, s: Engine(t, NgramDrafter(k=3)), 1, None),
    ("draft-model", lambda t, d, s: Engine(t, DraftModelDrafter(d, k=3)), 3, 9),
    # the target drafting for itself: every draft accepted, stop tokens fall inside drafts
    ("perfect draft-model", lambda t, d, s: Engine(t, DraftModelDrafter(t, k=6)), 5, 3),
    ("sim block", lambda t, d, s: Engine(t, sim(block_drafter(t, s), seed=s)), 3, 6),
    (
        "chain adaptive-block",
        lambda t, d, s: Engine(t, NgramDrafter(k=6), plan=ChainPlan(AdaptiveBlock())),
        3,
        11,
    ),
    (
        "packed adaptive-block",
        lambda t, d, s: Engine(
            t,
            DraftModelDrafter(d, k=5),
            plan=PackedPlan(AdaptiveBlock(k_min=2, alpha=0.6, slack=0.5), bucket=4),
        ),
        4,
        6,
    ),
    (
        "packed tiered-budget",
        lambda t, d, s: Engine(t, NgramDrafter(k=6), plan=PackedPlan(TieredBudget(2.5), 4)),
        3,
        8,
    ),
    (
        "packed row-block-len sim",
        lambda t, d, s: Engine(
            t, sim(DraftModelDrafter(d, k=K), 3.5, s), plan=PackedPlan(RowBlockLength(0.4), 4)
        ),
        3,
        5,
    ),
    ("ngram tree", lambda t, d, s: Engine(t, NgramDrafter(k=6), plan=TreePlan(shape=TREE)), 3, 5),
    (
        "draft-model tree",
        lambda t, d, s: Engine(
            t, DraftModelDrafter(d, k=K), plan=TreePlan(FixedTree(build_static_tree(TREE)))
        ),
        2,
        None,
    ),
    (
        "sim block ragged trees",
        lambda t, d, s: Engine(
            t,
            sim(block_drafter(t, s), 3.0, s, p_sibling=0.5),
            plan=TreePlan(RaggedTrees(StaticTree.chain(K), build_static_tree(TREE), 5.0), bucket=8),
        ),
        3,
        7,
    ),
]


@pytest.mark.parametrize("cfg_kw", CONFIGS, ids=[c["arch"] for c in CONFIGS])
@pytest.mark.parametrize("seed", range(2))
def test_every_request_equals_its_single_ar(cfg_kw, seed):
    """More requests than rows (rows refilled), each arrival order shuffled, prompts entering
    in segments: every plan and drafter gives every request its own AR output."""
    rng = random.Random(seed)
    cfg = tiny_config(**cfg_kw)
    target = tiny_model(cfg, seed)
    draft = tiny_model(cfg, seed + 1000)  # unrelated: low acceptance, many rollbacks
    reqs = make_requests(rng, target, 7)
    want = {r.id: single_ar(target, r) for r in reqs}
    assert any(len(want[r.id]) < r.max_new_tokens for r in reqs), "no row stops by EOS"
    for label, make, slots, segment in CASES:
        order = list(reqs)
        rng.shuffle(order)  # another arrival order for every case
        engine = make(target, draft, seed)
        sched = Scheduler(engine, slots=slots, segment_tokens=segment, max_context=80)
        done = sched.run(order)
        got = {r.id: r.tokens for r in done}
        assert got == want, f"{label} slots={slots} segment={segment}"
        for r in done:
            assert r.stop_reason == ("eos" if want[r.id][-1] in r_stop(reqs, r.id) else "length")
            hits = zip(r.stats.accepted, r.stats.drafted, strict=True)
            assert all(a <= d for a, d in hits), f"{label}: more accepted than drafted"
        assert not sched.has_work and int(engine.state.active.sum()) == 0
        if isinstance(engine.drafter, SimulatedAcceptance):
            assert engine.drafter.divergences == 0  # fp32: the oracle is the AR output
            stats = [r.stats for r in done]
            tau = sum(s.committed for s in stats) / sum(s.cycles for s in stats)
            assert tau > 1.5, f"{label}: refilled rows stopped accepting ({tau:.2f})"


def r_stop(reqs: list[Request], rid: str) -> frozenset[int]:
    return next(r.stop_ids for r in reqs if r.id == rid)


@pytest.mark.parametrize("seed", range(3))
def test_requests_join_and_leave_between_steps(seed):
    """Arrivals at random steps and a cancellation mid-run change no other request's tokens."""
    rng = random.Random(seed)
    target = tiny_model(tiny_config(vocab=73), seed)
    reqs = make_requests(rng, target, 9)
    want = {r.id: single_ar(target, r) for r in reqs}
    drafter = NgramDrafter(k=4) if seed != 1 else sim(block_drafter(target, seed), seed=seed)
    sched = Scheduler(Engine(target, drafter), slots=3, segment_tokens=6, max_context=80)
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
        assert step < 2000, "the scheduler made no progress"
    assert got == want
    assert sched.running == 0 and sched.waiting == 0


@pytest.mark.parametrize("drafter", ["ar", "ngram"])
def test_segment_admission_keeps_running_decodes_going(drafter):
    """A long prompt goes in over ceil(L / segment) steps while a running row commits every step."""
    target = tiny_model(tiny_config(vocab=67), 3)
    rng = random.Random(3)
    short = Request("short", tuple(repetitive_prompt(rng, 67, 5)), 40)
    long = Request("long", tuple(repetitive_prompt(rng, 67, 100)), 5)
    engine = Engine(target, NgramDrafter(k=3) if drafter == "ngram" else None)
    sched = Scheduler(engine, slots=2, segment_tokens=16, max_context=120)
    sched.submit(short)
    sched.step()  # short's prompt goes in: it decodes from now on
    sched.submit(long)
    admitted = sched.steps
    results: dict[str, RequestResult] = {}
    while sched.has_work:
        before = sched.steps
        report = sched.step()
        committed = dict(report.committed)
        if before < admitted + 7:  # long is in prefill for 7 steps (100 = 6 x 16 + 4)
            assert report.rows_prefilling == 1
            # its last segment's step commits its first token and runs its first cycle
            assert report.rows_decoding == (2 if before == admitted + 6 else 1)
            assert len(committed["short"]) >= 1  # the running decode was not stalled
            if drafter == "ar":
                assert len(committed["short"]) == 1  # one AR step per scheduler step on the CPU
        for res in report.finished:
            results[res.id] = res
    assert results["long"].admitted_step == admitted
    assert results["long"].first_token_step == admitted + 6
    assert results["long"].tokens == single_ar(target, long)
    assert results["short"].tokens == single_ar(target, short)


def test_requests_that_end_on_their_first_token():
    """A budget of one token, or a first token that is a stop token: the request leaves in the
    step its prompt went in, and the rows beside it are untouched."""
    target = tiny_model(tiny_config(vocab=71), 5)
    rng = random.Random(5)
    prompts = [tuple(repetitive_prompt(rng, 71, n)) for n in (9, 14, 3, 20)]
    first = generate(Engine(target), [list(prompts[1])], 1)[0].tokens[0]
    reqs = [
        Request("one", prompts[0], 1),
        Request("stop-first", prompts[1], 20, frozenset([first])),
        Request("long-a", prompts[2], 25),
        Request("long-b", prompts[3], 25),
    ]
    for drafter in (None, NgramDrafter(k=4), DraftModelDrafter(target, k=4)):
        sched = Scheduler(Engine(target, drafter), slots=2, segment_tokens=4, max_context=60)
        done = {r.id: r for r in sched.run(reqs)}
        for r in reqs:
            assert done[r.id].tokens == single_ar(target, r), r.id
        assert done["one"].tokens == single_ar(target, reqs[0]) and len(done["one"].tokens) == 1
        assert done["stop-first"].tokens == [first] and done["stop-first"].stop_reason == "eos"
        for rid in ("one", "stop-first"):
            assert done[rid].finished_step == done[rid].first_token_step
            assert done[rid].stats.cycles == 0


def test_stop_tokens_inside_drafts():
    """The target drafting for itself accepts whole drafts, so stop tokens and length limits
    fall inside them: the request is cut at the stop token, nothing after it is kept."""
    target = tiny_model(tiny_config(vocab=53), 7)
    rng = random.Random(7)
    prompts = [tuple(repetitive_prompt(rng, 53, rng.randint(4, 20))) for _ in range(5)]
    cuts = 0
    for i, p in enumerate(prompts):
        cont = generate(Engine(target), [list(p)], 30)[0].tokens
        stop = frozenset([cont[5 + i]])
        req = Request(f"s{i}", p, 30, stop)
        others = [Request(f"o{i}{j}", q, 17 + j) for j, q in enumerate(prompts) if q != p]
        for plan in (None, TreePlan(FixedTree(build_static_tree(TREE)))):
            engine = Engine(
                target, DraftModelDrafter(target, k=6 if plan is None else K), plan=plan
            )
            sched = Scheduler(engine, slots=3, max_context=60)
            done = {r.id: r for r in sched.run([req, *others])}
            want = single_ar(target, req)
            assert done[req.id].tokens == want and want[-1] in stop
            assert done[req.id].stop_reason == "eos"
            for o in others:
                assert done[o.id].tokens == single_ar(target, o)
                assert len(done[o.id].tokens) == o.max_new_tokens  # cut inside a draft
            cuts += done[req.id].stats.mean_accepted_len > 1.0
    assert cuts == 2 * len(prompts)  # drafts were accepted: the stops fell inside them


def test_cancel_running_and_waiting():
    target = tiny_model(tiny_config(vocab=89), 1)
    draft = tiny_model(tiny_config(vocab=89), 2)
    sched = Scheduler(Engine(target, DraftModelDrafter(draft, k=3)), slots=2, max_context=64)
    rng = random.Random(2)
    reqs = [Request(f"c{i}", tuple(rng.randrange(89) for _ in range(9)), 30) for i in range(5)]
    for r in reqs:
        sched.submit(r)
    finished = [res for _ in range(2) for res in sched.step().finished]
    assert not finished and sched.running == 2 and sched.waiting == 3
    assert sched.waiting_ids == ["c2", "c3", "c4"]
    running = sched.cancel("c0")
    assert running is not None and running.stop_reason == "cancelled"
    assert 0 < len(running.tokens) < 30
    assert running.tokens == single_ar(target, reqs[0])[: len(running.tokens)]
    waiting = sched.cancel("c3")
    assert waiting is not None and waiting.tokens == [] and waiting.stop_reason == "cancelled"
    assert sched.cancel("nobody") is None and sched.cancel("c0") is None
    while sched.has_work:
        finished += sched.step().finished
    assert sorted(r.id for r in finished) == ["c1", "c2", "c4"]
    for res in finished:
        assert res.tokens == single_ar(target, reqs[int(res.id[1:])])


def test_bad_input_gets_one_sentence():
    target = tiny_model(tiny_config(vocab=31), 0)
    sched = Scheduler(Engine(target), slots=2, max_context=64)
    with pytest.raises(PromptTooLongError, match="exceeds the context of 64"):
        sched.submit(Request("a", tuple(range(30)), 40))
    with pytest.raises(PromptTooLongError, match="empty"):
        sched.submit(Request("b", (), 4))
    with pytest.raises(PromptTooLongError, match="empty"):
        sched.check_fits(0, 4)
    sched.check_fits(24, 40)  # exactly the context: fits
    with pytest.raises(ValueError, match="max_new_tokens"):
        Request("c", (1,), 0)
    assert sched.waiting == 0 and not sched.has_work
    with pytest.raises(PromptTooLongError, match="exceeds the model's context"):
        Scheduler(Engine(target), slots=2, max_context=100_000)
    with pytest.raises(ValueError, match="slots"):
        Scheduler(Engine(target), slots=0)
    with pytest.raises(ValueError, match="segment_tokens"):
        Scheduler(Engine(target), slots=1, segment_tokens=0)


def test_a_faulty_accept_is_caught(monkeypatch):
    """Accepting every drafted token commits tokens AR would not: the equality test can fail."""

    def accept_all(state: RowState, k: int, abstain: torch.Tensor | None = None) -> None:
        lens = torch.minimum(state.draft_lens, state.cut).clamp(max=k)  # [B]
        block = state.verify_argmax[:, : k + 1].clone()  # [B, k+1]
        keep = torch.arange(k, device=block.device)[None, :] < lens[:, None]
        block[:, :k] = torch.where(keep, state.drafts[:, :k], block[:, :k])
        commit_block(state, block, lens * state.active, abstain)

    monkeypatch.setattr("specpilot.engine.steps.accept_and_commit", accept_all)
    cfg = tiny_config(vocab=59)
    target, draft = tiny_model(cfg, 0), tiny_model(cfg, 1)
    reqs = make_requests(random.Random(0), target, 4)
    sched = Scheduler(Engine(target, DraftModelDrafter(draft, k=4)), slots=2, max_context=80)
    got = [r.tokens for r in sched.run(reqs)]
    monkeypatch.undo()
    assert got != [single_ar(target, r) for r in reqs]


# ------------------------------------------------------------------ per-row policy state
class _Recorder:
    """Snapshots of one row's policy state each time the plan asks the policy for a cycle."""

    def __init__(self) -> None:
        self.snaps: list[object] = []


def _recording(policy: object, method: str, state: Callable[[], object], rec: _Recorder) -> None:
    """Make ``policy.<method>`` record ``state()`` before answering (a subclass, so that
    slotted dataclass policies can be wrapped too)."""
    base = type(policy)
    inner = getattr(base, method)

    def wrapped(self, active):
        rec.snaps.append(state())
        return inner(self, active)

    policy.__class__ = type(
        f"Recording{base.__name__}", (base,), {method: wrapped, "__slots__": ()}
    )


POLICIES: dict[str, Callable[[], tuple[VerifyPlan, object, str, Callable[[object], object]]]] = {
    "adaptive-block": lambda: (lambda p: (ChainPlan(p), p, "widths", lambda q: q.ema[0]))(
        AdaptiveBlock(k_min=1, alpha=0.6, slack=0.0)
    ),
    "tiered-budget": lambda: (
        lambda p: (PackedPlan(p, 4), p, "widths", lambda q: list(q.ema.rates[0]))
    )(TieredBudget(3.0, decay=0.5)),
    "row-block-len": lambda: (
        lambda p: (ChainPlan(p), p, "widths", lambda q: list(q.ema.rates[0]))
    )(RowBlockLength(0.3, decay=0.5)),
    "ragged-trees": lambda: (lambda p: (TreePlan(p), p, "trees", lambda q: list(q.ema.rates[0])))(
        RaggedTrees(StaticTree.chain(K), build_static_tree(TREE), 6.0, decay=0.5)
    ),
}


@pytest.mark.parametrize("name", list(POLICIES))
def test_width_policy_state_is_reset_when_a_row_takes_a_new_request(name):
    """One row, three requests in turn, an unrelated drafter (nothing accepted): the policy's
    state for the row moves during a request and is back at its start value for the next."""
    plan, policy, method, state = POLICIES[name]()
    rec = _Recorder()
    _recording(policy, method, lambda: state(policy), rec)
    cfg = tiny_config(vocab=97)
    target, draft = tiny_model(cfg, 4), tiny_model(cfg, 5)
    engine = Engine(target, DraftModelDrafter(draft, k=K), plan=plan)
    sched = Scheduler(engine, slots=1, max_context=80)
    rng = random.Random(4)
    reqs = [Request(f"p{i}", tuple(repetitive_prompt(rng, 97, 12)), 24) for i in range(3)]
    for r in reqs:
        sched.submit(r)
    firsts, lasts, seen = [], [], set()
    done: dict[str, list[int]] = {}
    while sched.has_work:
        start = len(rec.snaps)
        report = sched.step()
        ids = [rid for rid, _ in report.committed]
        if len(rec.snaps) > start and ids and ids[0] not in seen:  # a request's first cycle
            seen.add(ids[0])
            firsts.append(rec.snaps[start])
        for res in report.finished:
            lasts.append(rec.snaps[-1])
            done[res.id] = res.tokens
    assert len(firsts) == 3 and firsts[0] == firsts[1] == firsts[2]
    assert all(last != firsts[0] for last in lasts), "the state never moved: the test is blind"
    assert done == {r.id: single_ar(target, r) for r in reqs}


# ------------------------------------------------------------------ mechanisms on the scheduler
def test_adaptive_block_follows_each_requests_acceptance():
    policy = AdaptiveBlock(k_min=2, alpha=0.5, slack=1.0)
    policy.reset(2, 8, 1)
    assert policy.widths([True, True]) == [9, 9]
    for _ in range(10):
        policy.observe(0, policy.block(0), 0)
        policy.observe(1, policy.block(1), policy.block(1))
    assert policy.widths([True, True, False][:2]) == [3, 9]  # row 0 down to k_min, row 1 at k
    policy.reset_row(0)
    assert policy.block(0) == 8
    with pytest.raises(ValueError):
        AdaptiveBlock(k_min=0)


def test_adaptive_block_drafts_less_where_nothing_is_accepted():
    """Same tokens as the fixed block, fewer drafted tokens verified for an unrelated drafter."""
    cfg = tiny_config(vocab=83)
    target, draft = tiny_model(cfg, 5), tiny_model(cfg, 6)
    reqs = make_requests(random.Random(5), target, 6)

    def run(plan: VerifyPlan | None) -> tuple[list[list[int]], int]:
        engine = Engine(target, DraftModelDrafter(draft, k=8), plan=plan)
        res = Scheduler(engine, slots=3, max_context=80).run(reqs)
        return [r.tokens for r in res], sum(sum(r.stats.drafted) for r in res)

    fixed_tokens, fixed_cost = run(None)
    for plan in (ChainPlan(AdaptiveBlock()), PackedPlan(AdaptiveBlock(), 4)):
        tokens, cost = run(plan)
        assert tokens == fixed_tokens == [single_ar(target, r) for r in reqs]
        assert cost < fixed_cost


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("kind", ["sim-block", "draft-model-tree", "ar", "ngram-packed"])
def test_cuda_graphs_every_request_equals_its_single_ar(kind: str) -> None:
    """The same on CUDA with graphs (fp32): refilled rows replay the graphs captured earlier."""
    from specpilot.synthetic import build_block_drafter, build_target

    rng = random.Random(11)
    model = build_target("tiny-llama", "cuda", torch.float32, seed=2, max_positions=1024)
    drafter: Drafter | None = None
    plan: VerifyPlan | None = None
    if kind == "sim-block":
        drafter = sim(build_block_drafter(model, "tiny-block"), 3.0)
    elif kind == "draft-model-tree":
        draft = build_target("tiny-llama", "cuda", torch.float32, seed=5, max_positions=1024)
        drafter, plan = DraftModelDrafter(draft, k=K), TreePlan(FixedTree(build_static_tree(TREE)))
    elif kind == "ngram-packed":
        drafter, plan = NgramDrafter(k=6), PackedPlan(TieredBudget(3.0), 8)
    reqs = make_requests(rng, model, 12)
    arrival = sorted(rng.randrange(15) for _ in reqs)
    arrival[0] = 0
    engine = Engine(model, drafter, plan=plan, graphs=True, attn_bucket=32, sync_every=4)
    sched = Scheduler(engine, slots=4, segment_tokens=8, max_context=80)
    done: dict[str, RequestResult] = {}
    step = 0
    while len(done) < len(reqs):
        for req, at in zip(reqs, arrival, strict=True):
            if at == step:
                sched.submit(req)
        for res in sched.step().finished:
            done[res.id] = res
        step += 1
        assert step < 2000
    for req in reqs:
        want = generate(
            Engine(model, graphs=False), [list(req.prompt_ids)], req.max_new_tokens, req.stop_ids
        )
        assert done[req.id].tokens == want[0].tokens, req.id
    assert engine.runner.captures > 0
