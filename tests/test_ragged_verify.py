"""Batched mechanisms of the static engine on the CPU: packed ragged verify against the padded
static forward, the width policies, and the engine with ragged widths token for token against
the stock AR loop (fp32), including heterogeneous simulated acceptance."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from conftest import run_interpreted
from specpilot.drafters.block_drafter import BlockDrafter
from specpilot.drafters.simulated import AcceptanceProfile, SimulatedAcceptance
from specpilot.engine.build import EngineBuild
from specpilot.engine.loop import SpecEngine
from specpilot.engine.static_engine import StaticEngine
from specpilot.engine.widths import FixedWidths, RowBlockLength, TieredBudget, WidthPolicy
from specpilot.errors import SpecPilotError
from specpilot.forcing import force_tokens
from specpilot.mechanisms import MECHANISMS
from specpilot.models.packed_forward import PackedLayout, PackedVerify, bucket_rows
from specpilot.models.static_forward import StaticForward
from specpilot.synthetic import init_random_on_device
from test_gpu_path import PROMPTS, tiny, toks

BATCH_PROMPTS = [*PROMPTS, [5, 6, 7, 8, 9, 10, 11, 12, 13], [1], [40, 41, 42]]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_packed_verify_matches_padded_forward(arch: str, seed: int) -> None:
    """Argmax and K/V of every real token equal the padded static forward's; padding rows and
    unverified positions leave every other committed slot untouched."""
    model = tiny(arch, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    b, w, s = 4, 5, 64
    start = torch.randint(0, 20, (b,), generator=gen)
    block = torch.randint(0, 101, (b, w), generator=gen)
    widths = [int(x) for x in torch.randint(0, w + 1, (b,), generator=gen)]
    widths[0] = w  # at least one full row
    prefix = torch.randint(0, 101, (b, 24), generator=gen)
    ref_cache, cache = model.allocate_cache(b, s), model.allocate_cache(b, s)
    fwd = StaticForward(model)
    zero = torch.zeros(b, dtype=torch.int64)
    for c in (ref_cache, cache):  # same committed prefix in both caches
        fwd(prefix, c, zero, 32)
    before_k = [kc.clone() for kc in cache.k]
    ref = fwd(block, ref_cache, start, 32).argmax(dim=-1)  # [B, W]
    layout = PackedLayout.allocate(b, w, torch.device("cpu"))
    rows = min(bucket_rows(sum(widths), 4), b * w)
    layout.fill(widths, rows)
    got = torch.full((b, w), -1, dtype=torch.int64)
    PackedVerify(fwd)(block, layout, rows, cache, start, 32, got)
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
    assert layout.data[3, :b].tolist() == [max(x - 1, 0) for x in widths]


def test_layout_rejects_bad_widths() -> None:
    layout = PackedLayout.allocate(2, 4, torch.device("cpu"))
    with pytest.raises(ValueError, match="widths"):
        layout.fill([5, 1], 16)
    with pytest.raises(ValueError, match="cannot hold"):
        layout.fill([4, 4], 4)


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


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("seed", [0, 3])
def test_ragged_engine_equals_ar(arch: str, policy: str, seed: int) -> None:
    """Heterogeneous simulated acceptance, ragged widths: tokens equal the stock AR loop, no
    oracle divergence (fp32), and stop at EOS like AR."""
    model = tiny(arch, seed=seed + 1)
    ref = SpecEngine(model).generate(BATCH_PROMPTS, 40)
    profiles = [AcceptanceProfile.parse(t) for t in ("tau=1.5,block=8", "tau=6,block=8")]
    sim = SimulatedAcceptance(
        _block(model), profiles[0], seed=seed, row_profiles=[profiles[0], profiles[1]]
    )
    eng = StaticEngine(model, sim, attn_bucket=16, width_policy=POLICIES[policy](), packed_bucket=4)
    got = eng.generate(BATCH_PROMPTS, 40)
    assert toks(got) == toks(ref)
    assert sim.divergences == 0
    eos = ref[2].tokens[7]
    ref = SpecEngine(model).generate(BATCH_PROMPTS, 40, eos_ids=[eos])
    got = eng.generate(BATCH_PROMPTS, 40, eos_ids=[eos])
    assert toks(got) == toks(ref)
    assert [r.stop_reason for r in got] == [r.stop_reason for r in ref]


def test_ragged_engine_real_drafter_and_forcing() -> None:
    """A real (random) block drafter, no simulation, tiered widths: tokens equal AR and token
    forcing is clean with zero near-ties."""
    model = tiny("qwen2", seed=4)
    eng = StaticEngine(model, _block(model, 6), attn_bucket=16, width_policy=TieredBudget(3.0))
    got = eng.generate(BATCH_PROMPTS, 30)
    assert toks(got) == toks(SpecEngine(model).generate(BATCH_PROMPTS, 30))
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
        eng = StaticEngine(
            model, sim, attn_bucket=32, width_policy=POLICIES[name](), packed_bucket=4
        )
        res = eng.generate(BATCH_PROMPTS[:4], 96)
        committed = sum(len(r.tokens) for r in res)
        runs[name] = (eng.rows_verified / committed, [r.stats.mean_accepted_len for r in res])
    fixed_rows, fixed_tau = runs["fixed"]
    tiered_rows, _ = runs["tiered-4"]
    assert fixed_tau[0] < 2.5 < 4.5 < fixed_tau[1]
    assert tiered_rows < 0.8 * fixed_rows


def test_width_policy_needs_drafter() -> None:
    with pytest.raises(ValueError, match="drafter"):
        StaticEngine(tiny("llama"), None, width_policy=FixedWidths())


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

    model = tiny("qwen3", seed=5)
    sim = SimulatedAcceptance(_block(model), AcceptanceProfile.parse("tau=5,block=8"), seed=2)
    eng = StaticEngine(model, sim, attn_bucket=16, width_policy=RandomWidths(), packed_bucket=8)
    assert toks(eng.generate(BATCH_PROMPTS, 50)) == toks(
        SpecEngine(model).generate(BATCH_PROMPTS, 50)
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_packed_graphs_on_cuda() -> None:
    """Packed verify captured as CUDA graphs equals the eager packed path (and AR in fp32)."""
    from specpilot.synthetic import build_block_drafter, build_target

    for dtype in (torch.float32, torch.bfloat16):
        model = build_target("tiny-qwen3", "cuda", dtype, max_positions=1024)
        ref = SpecEngine(model).generate(BATCH_PROMPTS, 64)
        outs = []
        for use_graphs in (False, True):
            sim = SimulatedAcceptance(
                build_block_drafter(model, "tiny-block"),
                AcceptanceProfile.parse("tau=3,block=9"),
                row_profiles=[
                    AcceptanceProfile.parse(t) for t in ("tau=1.5,block=9", "tau=6,block=9")
                ],
            )
            eng = StaticEngine(model, sim, use_graphs=use_graphs, width_policy=TieredBudget(4.0))
            outs.append(toks(eng.generate(BATCH_PROMPTS, 64)))
        assert outs[1] == outs[0]
        if dtype == torch.float32:
            assert outs[0] == toks(ref)


@pytest.mark.slow
def test_batched_gpu_bench_tiny(tmp_path: Path) -> None:
    """The H200 script end to end on tiny CPU shapes: every variant lossless, labelled."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "bench" / "batched_gpu.py"
    spec = importlib.util.spec_from_file_location("batched_gpu", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    args = ["--out", str(tmp_path), "--tiny", "--concurrency", "3", "--new-tokens", "16"]
    result = mod.main([*args, "--budgets", "3"])
    saved = json.loads((tmp_path / "batched_gpu.json").read_text())
    assert "simulated acceptance" in saved["label"] and saved["runs"] == result["runs"]
    names = [r["variant"] for r in saved["runs"]]
    assert names == ["ar", "spec-stock", "ragged-fixed", "tiered-b3", "rowlen-t0.25"]
    for r in saved["runs"]:
        assert r["mismatches"] == 0 and r["rows_equal_ar"] == 3, r


PACKED_KERNEL_CHECK = """
import sys, torch
sys.path.insert(0, "tests")
from test_gpu_path import tiny
from specpilot.models.packed_forward import PackedLayout, PackedVerify
from specpilot.models.static_forward import StaticForward
for arch in ("llama", "qwen3"):
    model = tiny(arch, seed=3)
    fused, ref = StaticForward(model), StaticForward(model, use_triton=False)
    assert fused._k is not None and ref._k is None
    b, w = 3, 4
    gen = torch.Generator().manual_seed(0)
    block = torch.randint(0, 101, (b, w), generator=gen)
    start = torch.tensor([5, 0, 9])
    widths = [4, 0, 2]
    outs = []
    for fwd in (fused, ref):
        cache = model.allocate_cache(b, 32)
        fwd(torch.randint(0, 101, (b, 12), generator=torch.Generator().manual_seed(1)), cache, torch.zeros(b, dtype=torch.int64), 16)
        layout = PackedLayout.allocate(b, w, torch.device("cpu"))
        layout.fill(widths, 8)
        got = torch.full((b, w), -1, dtype=torch.int64)
        PackedVerify(fwd)(block, layout, 8, cache, start, 16, got)
        outs.append((got, cache))
    (g1, c1), (g2, c2) = outs
    for row, wb in enumerate(widths):
        assert g1[row, :wb].tolist() == g2[row, :wb].tolist(), (arch, row)
    for i in range(model.cfg.num_layers):
        torch.testing.assert_close(c1.k[i][:, :, :31], c2.k[i][:, :, :31])
        torch.testing.assert_close(c1.v[i][:, :, :31], c2.v[i][:, :, :31])
print("packed kernel ok")
"""


def test_packed_triton_kernel_in_interpreter() -> None:
    """The fused packed RoPE + K/V write + query scatter (Triton, interpreted) gives the same
    argmax and cache as the torch reference path."""
    assert "packed kernel ok" in run_interpreted(["-c", PACKED_KERNEL_CHECK], timeout=300)


def test_policy_must_cover_active_rows() -> None:
    """An active row given width 0 would commit an unverified token: the engine refuses it."""

    class Starve(FixedWidths):
        def widths(self, active: list[bool]) -> list[int]:  # type: ignore[override]
            return [0 for _ in active]

    model = tiny("llama")
    eng = StaticEngine(model, _block(model), attn_bucket=16, width_policy=Starve())
    with pytest.raises(ValueError, match="every active row"):
        eng.generate(PROMPTS, 8)
