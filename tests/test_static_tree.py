"""Static trees on the CPU (fp32): the topology builder, the tree policies (one tree for every
row, or ragged per row), simulated siblings, and the engine verifying static trees filled from a
drafter's candidates — tokens equal plain AR; the compacted K/V equals a fresh prefill; a broken
accept is caught by token forcing; the Triton RoPE/K-V write keeps positions and slots apart under
the interpreter. The tree rule itself and n-gram tries: ``tests/test_tree_verify.py``."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from conftest import run_interpreted
from specpilot.drafters.block_drafter import BlockDrafter
from specpilot.drafters.simulated import AcceptanceProfile, SimulatedAcceptance
from specpilot.drafters.static_tree import StaticTree, build_static_tree, parse_tree
from specpilot.drafters.tree import TreeShape
from specpilot.engine import Engine, generate
from specpilot.engine import accept as accept_mod
from specpilot.engine.build import EngineBuild
from specpilot.engine.plans import TreePlan
from specpilot.engine.tree_policy import FixedTree, RaggedTrees, TreePolicy
from specpilot.errors import SpecPilotError
from specpilot.forcing import force_tokens
from specpilot.mechanisms import MECHANISMS
from specpilot.models.forward import Forward
from specpilot.synthetic import init_random_on_device
from test_gpu_path import PROMPTS, stock_ar, tiny, toks

BATCH_PROMPTS = [*PROMPTS, [5, 6, 7, 8, 9, 10, 11, 12, 13], [1], [40, 41, 42]]
TREES = {
    "chain7": StaticTree.chain(7),
    "wide12": parse_tree("nodes=12,depth=7,width=3,branch=2"),
    "bushy10": parse_tree("nodes=10,depth=4,width=4,branch=3"),
}


def _block(model: Any, block: int = 8, seed: int = 3) -> BlockDrafter:
    drafter = BlockDrafter(model, num_layers=1, block=block, num_context_layers=2)
    init_random_on_device(drafter.weights, seed)
    return drafter


def _sim(model: Any, p_sibling: float = 0.6, seed: int = 1, **kw: Any) -> SimulatedAcceptance:
    prof = AcceptanceProfile.parse("tau=3,block=8")
    return SimulatedAcceptance(_block(model), prof, seed=seed, p_sibling=p_sibling, **kw)


def _engine(model: Any, drafter: Any, policy: TreePolicy, bucket: int = 16) -> Engine:
    return Engine(model, drafter, plan=TreePlan(policy, bucket=bucket), attn_bucket=16)


# ---------------------------------------------------------------------- topology
def test_static_tree_builder() -> None:
    shape = TreeShape(depth=5, widths=(3, 2, 2, 1, 1), max_nodes=8, branch=3)
    tree = build_static_tree(shape)
    assert tree.nodes == 8 and tree.depth == 5
    assert tree.parents[:5] == (-1, 0, 1, 2, 3) and tree.ranks[:5] == (0,) * 5  # chain first
    for d, w in enumerate(shape.widths, start=1):
        assert sum(1 for x in tree.depths if x == d) <= w
    assert StaticTree.chain(4).label() == "chain4" and tree.label() == "tree8d5"
    assert parse_tree("chain3") == StaticTree.chain(3)
    with pytest.raises(ValueError, match="Bad tree"):
        parse_tree("nodes=3")
    with pytest.raises(ValueError, match="DFS"):
        StaticTree(parents=(-1, 2, 0), depths=(1, 2, 2), ranks=(0, 0, 1))


# ---------------------------------------------------------------------- engine == AR
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("tree", list(TREES))
@pytest.mark.parametrize("seed", [0, 1])
def test_tree_engine_equals_ar(arch: str, tree: str, seed: int) -> None:
    """GQA / qwen2 bias / qwen3 qk-norm, several tree shapes and seeds, batch 1 and B > 1:
    tokens equal plain AR, no oracle divergence, and siblings are accepted."""
    model = tiny(arch, seed=seed + 1)
    ref = stock_ar(model, BATCH_PROMPTS, 40)
    for prompts, want in ((BATCH_PROMPTS[:1], ref[:1]), (BATCH_PROMPTS, ref)):
        sim = _sim(model, seed=seed)
        got = generate(_engine(model, sim, FixedTree(TREES[tree])), prompts, 40)
        assert toks(got) == want
        assert sim.divergences == 0
        assert all(r.stats.mean_accepted_len > 1.5 for r in got)


def test_tree_engine_stops_at_eos_mid_tree() -> None:
    model = tiny("qwen3", seed=2)
    eos = stock_ar(model, BATCH_PROMPTS, 40)[0][9]
    ref = generate(Engine(model), BATCH_PROMPTS, 40, eos_ids=[eos])
    got = generate(
        _engine(model, _sim(model), FixedTree(TREES["wide12"])), BATCH_PROMPTS, 40, [eos]
    )
    assert toks(got) == toks(ref)
    assert [r.stop_reason for r in got] == [r.stop_reason for r in ref]
    assert "eos" in {r.stop_reason for r in got}


def test_siblings_add_accepted_tokens() -> None:
    """With simulated p_sibling, a tree commits more per verify than the chain of equal depth,
    and with p_sibling = 0 about as much (the chain profile is the tree's first branch)."""
    model = tiny("llama", seed=3)
    taus = {}
    for name, tree, p_sib in (
        ("chain", StaticTree.chain(7), 0.8),
        ("tree", parse_tree("nodes=20,depth=7,width=3,branch=2"), 0.8),
        ("tree0", parse_tree("nodes=20,depth=7,width=3,branch=2"), 0.0),
    ):
        eng = _engine(model, _sim(model, p_sib), FixedTree(tree))
        eng.attn_bucket = 32
        res = generate(eng, BATCH_PROMPTS[:2], 120)
        taus[name] = sum(r.stats.committed for r in res) / sum(r.stats.cycles for r in res)
    assert taus["tree"] > taus["chain"] + 0.3
    assert taus["tree0"] == pytest.approx(taus["chain"], abs=0.35)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_simulated_tree_tau_matches_the_profile(seed: int) -> None:
    """Six prompts one after another on one engine: the committed tokens per verify of a tree
    (and of the chain) land on ``AcceptanceProfile.tree_tau``, the profile's expectation for that
    topology, within 6% for every seed (until 2026-12-05 each prompt replayed one stretch of draws:
    seed 1 gave 5.26 for an expected 4.24)."""
    model = tiny("llama", seed=3)
    for tree, p_sib in (
        (StaticTree.chain(7), 0.8),
        (parse_tree("nodes=20,depth=7,width=3,branch=2"), 0.8),
        (parse_tree("nodes=10,depth=4,width=4,branch=3"), 0.5),
    ):
        sim = _sim(model, p_sib, seed=seed)
        eng = _engine(model, sim, FixedTree(tree))
        eng.attn_bucket = 32
        committed = cycles = 0
        for i in range(6):
            st = generate(eng, [BATCH_PROMPTS[i % len(BATCH_PROMPTS)]], 120)[0].stats
            committed, cycles = committed + st.committed, cycles + st.cycles
        want = AcceptanceProfile(sim.profile.rates, p_sib).tree_tau(tree)
        assert committed / cycles == pytest.approx(want, rel=0.06), (tree.label(), p_sib)
    assert AcceptanceProfile((0.8, 0.5), 0.5).tree_tau(
        StaticTree(parents=(-1, 0, -1, 2), depths=(1, 2, 1, 2), ranks=(0, 0, 1, 0))
    ) == pytest.approx(1 + 0.8 + 0.8 * 0.5 + 0.1 + 0.1 * 0.5)


def test_best_tree_tau_is_the_best_prefix_closed_tree() -> None:
    """``best_tree_tau(n)`` against every prefix-closed set of n paths of ranks 0 / 1 (depth 3:
    14 nodes), and the cap against the whole set; the tune's scope line quotes them."""
    from itertools import combinations, product

    from specpilot.commands.tune_scope import tree_ceiling

    p = AcceptanceProfile((0.8, 0.6, 0.7), 0.5)
    paths = [q for d in (1, 2, 3) for q in product((0, 1), repeat=d)]  # 14 nodes
    hit = [(r, (1 - r) * 0.5) for r in p.rates]

    def tau(chosen: tuple[tuple[int, ...], ...]) -> float:
        total = 1.0
        for q in chosen:
            prob = 1.0
            for d, rank in enumerate(q):
                prob *= hit[d][rank]
            total += prob
        return total

    for n in (1, 2, 3, 5, 8):
        closed = (c for c in combinations(paths, n) if all(q[:-1] in c for q in c if len(q) > 1))
        assert p.best_tree_tau(n) == pytest.approx(max(tau(c) for c in closed)), n
    assert p.best_tree_tau() == pytest.approx(tau(tuple(paths)))
    assert p.best_tree_tau(3) == pytest.approx(p.tau)  # three nodes: the chain is best here
    assert p.best_tree_tau(100) == pytest.approx(p.best_tree_tau())
    eagle = AcceptanceProfile.parse("rates=0.8,block=8,sibling=0.5")
    assert eagle.best_tree_tau(48) >= eagle.tree_tau(
        parse_tree("nodes=48,depth=7,width=7,branch=2")
    )
    (line,) = tree_ceiling("rates=0.8,block=8,sibling=0.5")
    assert "τ 4.16" in line and "τ 5.70 (1.37x" in line
    assert tree_ceiling("tau=6.5,block=16") == []  # no siblings: no tree beats the chain


def test_trees_are_screened_out_where_no_second_choice_is_ever_right() -> None:
    """A simulated profile without siblings: every tree commits what the chain does (its best
    tree is the chain), so the tune does not spend trials on them; with siblings, or with real
    acceptance, it does."""
    from specpilot.engine.config import EngineConfig
    from specpilot.engine.deployment import DeploymentSpec
    from specpilot.tune.space import directions_for, skipped_mechanisms

    def names(sim: str | None) -> tuple[set[str], list[str]]:
        dep = DeploymentSpec(target="t", drafter="block", device="cuda", dtype="bf16",
                             simulate_acceptance=sim)  # fmt: skip
        base = EngineConfig(deployment=dep, k=15)
        return {d.name for d in directions_for(base, "cuda", "llama")}, skipped_mechanisms(base, "cuda", "llama")  # fmt: skip

    plain, skipped = names("tau=6.5,block=16")
    assert "mechanism:tree-verify" not in plain
    assert any(s.startswith("tree-verify: the simulated profile never") for s in skipped), skipped
    assert AcceptanceProfile.parse("tau=6.5,block=16").best_tree_tau(48) == pytest.approx(6.5)
    for sim in ("tau=6.5,block=16,sibling=0.5", None):
        assert "mechanism:tree-verify" in names(sim)[0], sim


def test_ragged_trees_equal_ar() -> None:
    """Rows at τ 1.5 and 6 (simulated): the policy gives the uncertain rows the wide tree and the
    confident ones the chain in the same verify; tokens equal AR."""
    model = tiny("qwen2", seed=5)
    ref = stock_ar(model, BATCH_PROMPTS, 60)
    profiles = [AcceptanceProfile.parse(t) for t in ("tau=1.5,block=8", "tau=6,block=8")]
    sim = _sim(model, row_profiles=profiles)
    policy = RaggedTrees(StaticTree.chain(7), TREES["wide12"], budget=10.0, decay=0.5)
    seen: list[list[str]] = []
    trees = policy.trees

    def spy(active: Any) -> Any:
        out = trees(active)
        seen.append([t.label() if a else "-" for t, a in zip(out, active, strict=True)])
        return out

    policy.trees = spy  # type: ignore[method-assign]
    got = generate(_engine(model, sim, policy, bucket=4), BATCH_PROMPTS, 60)
    assert toks(got) == ref and sim.divergences == 0
    assert any({"chain7", "tree12d6"} <= set(s) for s in seen), "no verify mixed chain and tree"
    late = seen[len(seen) // 3 :]
    to_low = sum(s[b] == "tree12d6" for s in late for b in (0, 2, 4))  # rows at τ 1.5
    to_high = sum(s[b] == "tree12d6" for s in late for b in (1, 3))  # rows at τ 6
    assert to_low > 4 * max(to_high, 1)


def test_random_ragged_trees_fuzz() -> None:
    """A policy drawing a random tree per row every cycle (topology buffers rewritten each time)
    never changes a token."""

    class RandomTrees:
        name = "random"
        shapes = (StaticTree.chain(3), *TREES.values(), StaticTree.chain(1))

        def __init__(self) -> None:
            self.rng = random.Random(0)

        def reset(self, batch: int, k: int) -> None:
            return None

        def trees(self, active: Any) -> list[StaticTree]:
            return [self.rng.choice(self.shapes) for _ in active]

        def observe(self, row: int, drafted: int, accepted: int) -> None:
            return None

        def reset_row(self, row: int) -> None:
            return None

    model = tiny("qwen3", seed=8)
    sim = _sim(model, p_sibling=0.7, seed=4)
    got = generate(_engine(model, sim, RandomTrees(), bucket=8), BATCH_PROMPTS, 50)
    assert toks(got) == stock_ar(model, BATCH_PROMPTS, 50)
    assert sim.divergences == 0


def test_real_block_drafter_tree_and_forcing() -> None:
    """A real (random) block drafter's top-k tree, no simulation: AR tokens, forcing clean."""
    model = tiny("qwen3", seed=4)
    got = generate(_engine(model, _block(model), FixedTree(TREES["wide12"])), BATCH_PROMPTS, 30)
    assert toks(got) == stock_ar(model, BATCH_PROMPTS, 30)
    records = [
        (str(i), p, r.tokens) for i, (p, r) in enumerate(zip(BATCH_PROMPTS, got, strict=True))
    ]
    report = force_tokens(model, records)
    assert report.ok and report.near_ties == 0


# ---------------------------------------------------------------------- K/V compaction
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_compacted_kv_equals_fresh_prefill(arch: str) -> None:
    """After decoding with sibling-heavy trees (many off-first-path acceptances), every committed
    slot's K/V equals a fresh prefill of the committed sequence (rows stepped together through
    the engine's row API, none released, so no idle row writes over them)."""
    model = tiny(arch, seed=6)
    eng = _engine(model, _sim(model, 1.0), FixedTree(TREES["bushy10"]))
    b = len(BATCH_PROMPTS)
    eng.open(b, 96)
    eng.prefill(list(range(b)), BATCH_PROMPTS, [0] * b, [len(p) for p in BATCH_PROMPTS], [40] * b)
    accepted = 0
    for _ in range(12):
        accepted += sum(c.accepted for c in eng.step())
    assert eng.cache is not None and accepted > 24
    lens = eng.committed_lens()
    seqs = [eng.state.tokens[row, :n].tolist() for row, n in enumerate(lens)]
    for prompt, s in zip(BATCH_PROMPTS, seqs, strict=True):
        assert s[len(prompt) :] == stock_ar(model, [prompt], len(s) - len(prompt))[0]
    fresh = model.allocate_cache(b, eng.cache.max_seq_len)
    width = max(lens)
    ids = torch.zeros(b, width, dtype=torch.int64)
    for row, s in enumerate(seqs):
        ids[row, : len(s)] = torch.tensor(s)
    Forward(model).dense(ids, fresh, torch.zeros(b, dtype=torch.int64), width)
    for row, n in enumerate(lens):
        valid = slice(0, n - 1)  # slots whose K/V the engine has committed
        for i in range(model.cfg.num_layers):
            torch.testing.assert_close(
                eng.cache.k[i][row, :, valid], fresh.k[i][row, :, valid], rtol=1e-5, atol=1e-5
            )
            torch.testing.assert_close(
                eng.cache.v[i][row, :, valid], fresh.v[i][row, :, valid], rtol=1e-5, atol=1e-5
            )


# ---------------------------------------------------------------------- must be able to fail
def test_broken_accept_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """An accept that takes a node whose token is not the argmax at its parent changes tokens,
    and token forcing reports it."""
    real = accept_mod.accepted_path

    def broken(tokens: Any, argmax: Any, topo: Any, visible: Any, active: Any, k: int) -> Any:
        n, src = real(tokens, argmax, topo, visible, active, k)
        # claim one more first-branch node than was accepted (if it exists in the tree)
        extra = (n < topo[1].max(dim=1).values) & active.bool()
        src2 = src.clone()
        nxt = (n + 1).clamp(max=k)
        src2.scatter_(
            1, nxt[:, None], torch.where(extra, nxt, src.gather(1, nxt[:, None])[:, 0])[:, None]
        )
        return n + extra.long(), src2

    monkeypatch.setattr(accept_mod, "accepted_path", broken)
    model = tiny("llama", seed=7)
    got = generate(_engine(model, _block(model), FixedTree(StaticTree.chain(7))), BATCH_PROMPTS, 20)
    monkeypatch.undo()
    assert toks(got) != stock_ar(model, BATCH_PROMPTS, 20)
    records = [
        (str(i), p, r.tokens) for i, (p, r) in enumerate(zip(BATCH_PROMPTS, got, strict=True))
    ]
    assert not force_tokens(model, records).ok


# ---------------------------------------------------------------------- setup errors, registry
def test_tree_setup_errors() -> None:
    model = tiny("llama")
    with pytest.raises(ValueError, match="deeper"):
        generate(_engine(model, _block(model), FixedTree(StaticTree.chain(9))), PROMPTS, 4)
    with pytest.raises(ValueError, match="drafter"):
        _engine(model, None, FixedTree(StaticTree.chain(3)))
    with pytest.raises(ValueError, match="budget"):
        RaggedTrees(StaticTree.chain(7), TREES["wide12"], budget=4.0)


def test_mechanisms_registered_and_applied() -> None:
    fixed, ragged = MECHANISMS["tree-verify"], MECHANISMS["ragged-trees"]
    assert fixed.applies.allows("cuda", "bf16", "block", "single", "llama")
    assert ragged.applies.allows("cuda", "bf16", "block", "batched", "llama")
    assert not ragged.applies.allows("cuda", "bf16", "block", "single", "llama")
    assert "committed" in fixed.lossless and "static-tree-verify" not in MECHANISMS
    model = tiny("llama")
    build = EngineBuild(
        config=SimpleNamespace(), target=None, draft_model=None, drafter=_block(model)
    )  # type: ignore[arg-type]
    ragged.apply(build, ragged.resolve_knobs({"max_nodes": 20, "depth": 7, "chain": 7}))
    assert isinstance(build.tree_policy, RaggedTrees) and build.packed_bucket == 16
    assert build.tree_policy.uncertain.nodes == 20 and build.tree_policy.confident.nodes == 7
    plan = build.plan()
    assert isinstance(plan, TreePlan) and plan.policy is build.tree_policy and plan.bucket == 16
    with pytest.raises(SpecPilotError, match="only one"):
        fixed.apply(build, fixed.resolve_knobs({}))
    from specpilot.drafters import NgramDrafter

    with pytest.raises(SpecPilotError, match="candidates"):
        ragged.apply(
            EngineBuild(
                config=SimpleNamespace(), target=None, draft_model=None, drafter=NgramDrafter()
            ),
            ragged.resolve_knobs({}),
        )  # type: ignore[arg-type]


# ---------------------------------------------------------------------- Triton, interpreted
SLOTS_KERNEL_CHECK = """
import torch
from specpilot.kernels import decode_triton, reference
torch.manual_seed(0)
b, t, hq, hkv, d, s = 2, 3, 4, 2, 16, 12
for norm in (False, True):
    qkv = torch.randn(b * t, (hq + 2 * hkv) * d)
    pos = torch.tensor([3, 4, 4, 5, 6, 6])
    slots = torch.tensor([3, 4, 5, 5, 6, 7])
    ang = torch.randn(32, d // 2)
    cos, sin = ang.cos().repeat(1, 2), ang.sin().repeat(1, 2)  # RoPE tables: halves repeat
    qn = torch.randn(d) if norm else None
    kn = torch.randn(d) if norm else None
    kc, vc = torch.zeros(b, hkv, s, d), torch.zeros(b, hkv, s, d)
    q = decode_triton.rope_qkv_write(qkv, hq, hkv, d, b, pos, cos, sin, qn, kn, 1e-6, kc, vc, slots)
    k = reference.rope_rows_ref(qkv[:, hq * d:(hq + hkv) * d].reshape(-1, hkv, d), cos, sin, pos, kn, 1e-6)
    v = qkv[:, (hq + hkv) * d:].reshape(-1, hkv, d)
    qr = reference.rope_rows_ref(qkv[:, :hq * d].reshape(-1, hq, d), cos, sin, pos, qn, 1e-6)
    for m in range(b * t):
        row = m // t
        torch.testing.assert_close(kc[row, :, slots[m]], k[m], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(vc[row, :, slots[m]], v[m])
    g = hq // hkv
    qr = qr.view(b, t, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * t, d)
    torch.testing.assert_close(q, qr, rtol=1e-5, atol=1e-5)
print("slots kernel ok")
"""


def test_rope_kernel_positions_apart_from_slots() -> None:
    assert "slots kernel ok" in run_interpreted(["-c", SLOTS_KERNEL_CHECK], timeout=300)
