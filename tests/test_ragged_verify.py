"""Ragged verify on the CPU: the packed forward against the dense one, the width policies, and
the engine under the packed plan (and the chain plan with a width policy) token for token against
plain AR (fp32), including heterogeneous simulated acceptance. The packed layout against the stock
forward and under Triton: ``tests/test_gpu_path.py``; under CUDA graphs: ``tests/test_graphs.py``."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from specpilot.drafters import NgramDrafter
from specpilot.drafters.block_drafter import BlockDrafter
from specpilot.drafters.simulated import AcceptanceProfile, SimulatedAcceptance
from specpilot.engine import Engine, generate
from specpilot.engine.build import EngineBuild
from specpilot.engine.plans import ChainPlan, PackedPlan
from specpilot.engine.widths import FixedWidths, RowBlockLength, TieredBudget, WidthPolicy
from specpilot.errors import SpecPilotError
from specpilot.forcing import force_tokens
from specpilot.mechanisms import MECHANISMS
from specpilot.models.forward import Forward
from specpilot.models.layout import PackedRows
from specpilot.synthetic import init_random_on_device
from test_gpu_path import PROMPTS, packed_argmax, stock_ar, tiny, toks

BATCH_PROMPTS = [*PROMPTS, [5, 6, 7, 8, 9, 10, 11, 12, 13], [1], [40, 41, 42]]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_packed_verify_matches_dense_forward(arch: str, seed: int) -> None:
    """Argmax and K/V of every real token equal the dense forward's; padding rows and unverified
    positions leave every other slot untouched."""
    model = tiny(arch, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    b, w, s = 4, 5, 64
    start = torch.randint(0, 20, (b,), generator=gen)
    block = torch.randint(0, 101, (b, w), generator=gen)
    widths = [int(x) for x in torch.randint(0, w + 1, (b,), generator=gen)]
    widths[0] = w  # at least one full row
    prefix = torch.randint(0, 101, (b, 24), generator=gen)
    ref_cache, cache = model.allocate_cache(b, s), model.allocate_cache(b, s)
    fwd = Forward(model, use_triton=False)
    zero = torch.zeros(b, dtype=torch.int64)
    for c in (ref_cache, cache):  # same committed prefix in both caches
        fwd.dense(prefix, c, zero, 32)
    before_k = [kc.clone() for kc in cache.k]
    ref = fwd.argmax(fwd.dense(block, ref_cache, start, 32)).view(b, w)
    got = packed_argmax(fwd, cache, block, start, widths, bucket=4)
    for row, wb in enumerate(widths):
        assert got[row, :wb].tolist() == ref[row, :wb].tolist()
        st = int(start[row])
        for i in range(model.cfg.num_layers):
            real = slice(st, st + wb)
            torch.testing.assert_close(cache.k[i][row, :, real], ref_cache.k[i][row, :, real])
            torch.testing.assert_close(cache.v[i][row, :, real], ref_cache.v[i][row, :, real])
            untouched = torch.ones(s, dtype=torch.bool)
            untouched[real] = False
            untouched[s - 1] = False  # the padding rows' scratch slot
            assert torch.equal(cache.k[i][row, :, untouched], before_k[i][row, :, untouched])
    rows = PackedRows.allocate(b, w, torch.device("cpu"))
    rows.fill(widths, 20)
    assert rows.data[3, :b].tolist() == [max(x - 1, 0) for x in widths]
    assert rows.data[2].sum() == sum(widths)  # real rows; the rest of the bucket is padding


def test_layout_rejects_bad_widths() -> None:
    rows = PackedRows.allocate(2, 4, torch.device("cpu"))
    with pytest.raises(ValueError, match="widths"):
        rows.fill([5, 1], 8)
    with pytest.raises(ValueError, match="cannot hold"):
        rows.fill([4, 4], 4)


def _policy_rows(policy: WidthPolicy, rates: list[list[int]], cycles: int = 60) -> list[int]:
    """Feed a policy rows that accept ``rates[b]`` patterns; return the last widths."""
    b = len(rates)
    policy.reset(b, 7, 8)
    widths = [0] * b
    for c in range(cycles):
        widths = policy.widths([True] * b)
        for row in range(b):
            pattern = rates[row]
            policy.observe(row, widths[row] - 1, min(pattern[c % len(pattern)], widths[row] - 1))
    return widths


def test_tiered_budget_gives_tokens_to_the_likely_rows() -> None:
    pol = TieredBudget(budget=4.0, decay=0.3, prior=0.8, min_draft=1)
    widths = _policy_rows(pol, [[7], [0], [3], [1, 2]])
    assert sum(widths) == 16 and all(w >= 2 for w in widths)  # budget 4 x 4 rows, min_draft 1
    assert widths[0] == max(widths) and widths[1] == 2  # always-accept row gets most, never: least
    assert widths[0] > widths[2] > widths[1]
    pol.reset(3, 7, 16)  # rounds the budget up to the packed bucket, capped at the full width
    assert sum(pol.widths([True, True, False])) == 16
    assert pol.widths([False, False, False]) == [0, 0, 0]
    big = TieredBudget(budget=32.0)
    big.reset(3, 7, 16)
    assert big.widths([True] * 3) == [8, 8, 8]


def test_row_block_length_follows_acceptance() -> None:
    pol = RowBlockLength(threshold=0.5, decay=0.3, prior=0.8, min_draft=1)
    widths = _policy_rows(pol, [[7], [0], [2]])
    assert widths[0] == 8 and widths[1] == 2 and 2 <= widths[2] <= 4
    fixed = FixedWidths()
    fixed.reset(2, 7, 16)
    assert fixed.widths([True, False]) == [8, 0]


def _block(model: Any, block: int = 8) -> BlockDrafter:
    drafter = BlockDrafter(model, num_layers=1, block=block, num_context_layers=2)
    init_random_on_device(drafter.weights, 3)
    return drafter


POLICIES = {
    "fixed": lambda: FixedWidths(),
    "tiered-2": lambda: TieredBudget(2.0, min_draft=0),
    "tiered-4": lambda: TieredBudget(4.0),
    "rowlen": lambda: RowBlockLength(0.4),
}
PLANS = {
    "packed": lambda policy: PackedPlan(policy, bucket=4),
    "chain": lambda policy: ChainPlan(policy),
}


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("seed", [0, 3])
def test_ragged_engine_equals_ar(plan: str, arch: str, policy: str, seed: int) -> None:
    """Heterogeneous simulated acceptance, per-row widths (packed, or capped drafts in the dense
    chain): tokens equal plain AR, no oracle divergence (fp32), and stop at EOS like AR."""
    model = tiny(arch, seed=seed + 1)
    ref = generate(Engine(model), BATCH_PROMPTS, 40)
    profiles = [AcceptanceProfile.parse(t) for t in ("tau=1.5,block=8", "tau=6,block=8")]
    sim = SimulatedAcceptance(
        _block(model), profiles[0], seed=seed, row_profiles=[profiles[0], profiles[1]]
    )
    eng = Engine(model, sim, plan=PLANS[plan](POLICIES[policy]()), attn_bucket=16)
    got = generate(eng, BATCH_PROMPTS, 40)
    assert toks(got) == toks(ref)
    assert sim.divergences == 0
    eos = ref[2].tokens[7]
    ref = generate(Engine(model), BATCH_PROMPTS, 40, eos_ids=[eos])
    got = generate(eng, BATCH_PROMPTS, 40, eos_ids=[eos])
    assert toks(got) == toks(ref)
    assert [r.stop_reason for r in got] == [r.stop_reason for r in ref]


@pytest.mark.parametrize("plan", list(PLANS))
def test_ragged_engine_real_drafter_and_forcing(plan: str) -> None:
    """A real (random) block drafter, no simulation, tiered widths: tokens equal AR and token
    forcing is clean with zero near-ties."""
    model = tiny("qwen2", seed=4)
    eng = Engine(model, _block(model, 6), plan=PLANS[plan](TieredBudget(3.0)), attn_bucket=16)
    got = generate(eng, BATCH_PROMPTS, 30)
    assert toks(got) == stock_ar(model, BATCH_PROMPTS, 30)
    report = force_tokens(
        model,
        [(str(i), p, r.tokens) for i, (p, r) in enumerate(zip(BATCH_PROMPTS, got, strict=True))],
    )
    assert report.ok and report.near_ties == 0


def test_tiered_budget_spends_fewer_rows_on_heterogeneous_rows() -> None:
    """With rows at τ 1.5 and 6 (simulated acceptance), the tiered budget verifies fewer packed
    rows per committed token than fixed widths, and the τ of each row follows its profile."""
    model = tiny("llama", seed=2)
    profiles = [AcceptanceProfile.parse(t) for t in ("tau=1.5,block=8", "tau=6,block=8")]
    runs = {}
    for name in ("fixed", "tiered-4"):
        sim = SimulatedAcceptance(_block(model), profiles[0], seed=1, row_profiles=profiles)
        plan = PackedPlan(POLICIES[name](), bucket=4)
        res = generate(Engine(model, sim, plan=plan, attn_bucket=32), BATCH_PROMPTS[:4], 96)
        committed = sum(len(r.tokens) for r in res)
        runs[name] = (plan.rows_verified / committed, [r.stats.mean_accepted_len for r in res])
    fixed_rows, fixed_tau = runs["fixed"]
    tiered_rows, _ = runs["tiered-4"]
    assert fixed_tau[0] < 2.5 < 4.5 < fixed_tau[1]
    assert tiered_rows < 0.8 * fixed_rows


def test_width_policy_needs_drafter() -> None:
    for plan in (PackedPlan(FixedWidths()), ChainPlan(FixedWidths())):
        with pytest.raises(ValueError, match="drafter"):
            Engine(tiny("llama"), None, plan=plan)
    with pytest.raises(ValueError, match="bucket"):
        PackedPlan(FixedWidths(), bucket=0)


def test_mechanisms_registered_and_applied() -> None:
    for name in ("ragged-verify", "tiered-budget", "row-block-len"):
        mech = MECHANISMS[name]
        assert mech.applies.allows("cuda", "bf16", "block", "batched", "llama")
        assert not mech.applies.allows("cuda", "bf16", "block", "single", "llama")
        assert "committed" in mech.lossless
    build = EngineBuild(config=SimpleNamespace(), target=None, draft_model=None, drafter=None)  # type: ignore[arg-type]
    tiered = MECHANISMS["tiered-budget"]
    tiered.apply(build, tiered.resolve_knobs({"budget": 5.0}))
    assert isinstance(build.width_policy, TieredBudget) and build.packed_bucket == 16
    ragged = MECHANISMS["ragged-verify"]
    ragged.apply(build, ragged.resolve_knobs({"bucket": 32}))
    assert build.packed_bucket == 32
    rowlen = MECHANISMS["row-block-len"]
    with pytest.raises(SpecPilotError, match="one width policy"):
        rowlen.apply(build, rowlen.resolve_knobs({}))
    with pytest.raises(ValueError, match="budget"):
        tiered.resolve_knobs({"budget": 0.5})
    assert build.plan() is None  # no drafter: plain AR
    build.drafter = NgramDrafter(k=3)
    plan = build.plan()
    assert isinstance(plan, PackedPlan) and plan.bucket == 32
    assert plan.caps.policy is build.width_policy
    build.packed_bucket = 0
    assert isinstance(build.plan(), ChainPlan)  # a width policy alone caps the dense chain


def test_random_widths_fuzz() -> None:
    """A policy drawing random widths every cycle (including 0 and 1) never changes a token."""

    class RandomWidths:
        name = "random"

        def __init__(self) -> None:
            self.rng = random.Random(0)
            self.k = 0

        def reset(self, batch: int, k: int, bucket: int) -> None:
            self.k = k

        def widths(self, active: list[bool]) -> list[int]:
            return [self.rng.randint(1, self.k + 1) if a else 0 for a in active]

        def observe(self, row: int, drafted: int, accepted: int) -> None:
            return None

        def reset_row(self, row: int) -> None:
            return None

    model = tiny("qwen3", seed=5)
    want = stock_ar(model, BATCH_PROMPTS, 50)
    for plan in (PackedPlan(RandomWidths(), bucket=8), ChainPlan(RandomWidths())):
        sim = SimulatedAcceptance(_block(model), AcceptanceProfile.parse("tau=5,block=8"), seed=2)
        assert (
            toks(generate(Engine(model, sim, plan=plan, attn_bucket=16), BATCH_PROMPTS, 50)) == want
        )


def test_a_starving_policy_still_commits_ar_tokens() -> None:
    """A policy giving active rows width 0: each still verifies its pending token (the plans
    clamp an active row's width to at least 1), so it decodes as plain AR, one token a cycle."""

    class Starve(FixedWidths):
        def widths(self, active: list[bool]) -> list[int]:  # type: ignore[override]
            return [0 for _ in active]

    model = tiny("llama")
    want = stock_ar(model, BATCH_PROMPTS, 12)
    for plan in (PackedPlan(Starve(), bucket=4), ChainPlan(Starve())):
        got = generate(Engine(model, _block(model), plan=plan), BATCH_PROMPTS, 12)
        assert toks(got) == want
        assert all(r.stats.drafted == [] and r.stats.cycles == 11 for r in got)
