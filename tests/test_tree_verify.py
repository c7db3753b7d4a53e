"""Tree verification (``TreePlan``): the tree rule's exact cases on synthetic argmaxes, K/V
compaction, n-gram tries, and tree speculation equal to plain AR token for token in fp32 for both
tree sources — host tries (n-gram) and static trees filled from device candidates (draft model,
block drafter) — over architectures (GQA, MQA, qwen2 bias, qwen3 qk-norm, tied), tree shapes,
batches of rows of different lengths, EOS and the length limit inside an accepted path, and token
forcing. Static-tree policies and simulated siblings: ``tests/test_static_tree.py``."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import tiny_config, tiny_model
from engine_cases import ar_tokens, block_drafter, repetitive_prompt, tokens
from specpilot.drafters import DraftModelDrafter, NgramDrafter
from specpilot.drafters.base import DraftRows, HostDrafter
from specpilot.drafters.static_tree import build_static_tree
from specpilot.drafters.tree import TreeShape, TrieBuilder, pack_trees
from specpilot.engine import Engine, generate
from specpilot.engine.accept import accepted_path, compact_kv
from specpilot.engine.build import EngineBuild
from specpilot.engine.plans import TreePlan, fixed_tree_plan
from specpilot.engine.tree_policy import FixedTree
from specpilot.engine.trees import tree_tables
from specpilot.errors import SpecPilotError
from specpilot.forcing import force_tokens
from specpilot.mechanisms import MECHANISMS
from test_engine_equivalence import FakeRows

SHAPES = [
    TreeShape.uniform(depth=4, width=3, max_nodes=10, branch=2),
    TreeShape(depth=6, widths=(3, 2, 2, 1, 1, 1), max_nodes=9, branch=3),
    TreeShape.chain(3),
]


# ---------------------------------------------------------------------- the tree rule
def tree_accept(
    tokens: list[int], parents: list[int], argmax: list[int], active: int = 1
) -> tuple[list[int], int]:
    """The accepted nodes (indices, root excluded) and the bonus token of one tree, by the
    engine's device rule. ``argmax[0]`` follows the root, ``argmax[j + 1]`` node j."""
    depths: list[int] = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    w, k = len(parents) + 1, max(depths)
    topo, vis = tree_tables(parents, depths, [0] * len(parents), w)
    n, src = accepted_path(
        torch.tensor([[0, *tokens]]),
        torch.tensor([argmax]),
        torch.tensor(topo)[:, None, :],  # [4, 1, W]
        torch.tensor([vis]),
        torch.tensor([active]),
        k,
    )
    m = int(n[0])
    return [int(j) - 1 for j in src[0, 1 : m + 1]], argmax[int(src[0, m])]


def test_tree_accept_exact_cases() -> None:
    # root → 0(5) → 1(6) → 2(7);  root → 3(8) → 4(6);  0 → 5(9)
    tokens = [5, 6, 7, 8, 6, 9]
    parents = [-1, 0, 1, -1, 3, 0]
    assert tree_accept(tokens, parents, [5, 6, 7, 1, 0, 0, 0]) == ([0, 1, 2], 1)
    assert tree_accept(tokens, parents, [5, 9, 0, 0, 0, 0, 4]) == ([0, 5], 4)  # 0, its 2nd child
    assert tree_accept(tokens, parents, [8, 0, 0, 0, 6, 2, 0]) == ([3, 4], 2)  # the 2nd branch
    assert tree_accept(tokens, parents, [1, 6, 7, 9, 6, 0, 0]) == ([], 1)  # every child rejected
    # a node whose parent was rejected is never accepted, even if it matches
    assert tree_accept([5, 6], [-1, 0], [4, 6, 0]) == ([], 4)
    # equal depth: the first in DFS order wins; a frozen row accepts nothing
    assert tree_accept([5, 6, 5, 7], [-1, 0, -1, 2], [5, 6, 9, 9, 9]) == ([0, 1], 9)
    assert tree_accept(tokens, parents, [5, 6, 7, 1, 0, 0, 0], active=0) == ([], 5)


def test_ancestor_mask_and_dfs_packing() -> None:
    trie = TrieBuilder(TreeShape.uniform(depth=3, width=4, max_nodes=8), max_depth=3)
    for cont in ([1, 2, 3], [1, 4], [5, 6, 7], [1, 2, 9]):
        trie.insert(cont)
    prop = pack_trees([trie.nodes])
    n = prop.counts[0]
    assert prop.tokens[0, :n].tolist() == [1, 2, 3, 9, 4, 5, 6, 7]
    parents = prop.parents[0, :n].tolist()
    assert parents == [-1, 0, 1, 1, 0, -1, 5, 6]
    topo, vis = tree_tables(parents, prop.depths[0, :n].tolist(), [0] * n, n + 1)
    assert topo[1] == [0, 1, 2, 3, 3, 2, 1, 2, 3]  # depths, root 0
    mask = [[int(v) for v in row] for row in vis]  # rows: root, nodes 0..7
    assert mask[4] == [1, 1, 1, 0, 1, 0, 0, 0, 0]  # node 3 (token 9): root, 0, 1, itself
    assert mask[8] == [1, 0, 0, 0, 0, 0, 1, 1, 1]
    padded = tree_tables([-1], [1], [0], 4)[1]
    assert padded[3] == [False, False, False, True]  # padding rows see only themselves
    # budgets: width 1 per depth keeps only the first path
    narrow = TrieBuilder(TreeShape.uniform(depth=3, width=1, max_nodes=8), max_depth=2)
    for cont in ([1, 2, 3], [1, 4], [5]):
        narrow.insert(cont)
    assert [n.token for n in narrow.nodes] == [1, 2]


def test_compact_kv_moves_kv_without_touching_the_prefix() -> None:
    cache = tiny_model(tiny_config(), 0).allocate_cache(2, 32)
    for t in cache.k + cache.v:
        t.copy_(torch.arange(32, dtype=torch.float32).view(1, 1, 32, 1).expand_as(t))
    # row 1: root at slot 5, accepted path on block rows 3, 5, 8 (slots 8, 10, 13)
    compact_kv(cache, torch.tensor([0, 5]), torch.tensor([[0, 1, 2, 3], [0, 3, 5, 8]]))
    assert cache.k[0][1, 0, :, 0].tolist()[:10] == [0, 1, 2, 3, 4, 5, 8, 10, 13, 9]
    assert cache.v[1][1, 1, :, 0].tolist()[:10] == [0, 1, 2, 3, 4, 5, 8, 10, 13, 9]
    assert cache.v[1][0, 0, :, 0].tolist() == list(range(32))  # identity: the other row untouched


def test_ngram_tree_starts_with_the_chain_proposal() -> None:
    ctx = [1, 2, 3, 4, 9, 1, 2, 7, 8, 1, 2]
    chain, tree = NgramDrafter(k=3, max_n=2), NgramDrafter(k=3, max_n=2)
    rows = FakeRows([ctx])
    chain.bind(rows)  # type: ignore[arg-type]
    tree.bind(rows)  # type: ignore[arg-type]
    chain.propose(rows, 0)  # type: ignore[arg-type]
    prop = tree.propose_tree(rows, TreeShape.uniform(3, 3, 9))  # type: ignore[arg-type]
    n = prop.counts[0]
    assert prop.tokens[0, :3].tolist() == rows.written[0] == [7, 8, 1]
    assert prop.parents[0, :3].tolist() == [-1, 0, 1]
    assert 3 in prop.tokens[0, :n].tolist()  # the older continuation (1, 2) → 3, 4, 9 is a branch
    assert int(prop.depths[0, :n].max()) <= 3
    rows.active[0] = False
    assert tree.propose_tree(rows, TreeShape.uniform(3, 3, 9)).counts == [0]  # type: ignore[arg-type]


# ---------------------------------------------------------------------- tree speculation == AR
CONFIGS = [
    dict(arch="llama", heads=4, kv_heads=2, tie=True, vocab=101),  # GQA, tied
    dict(arch="llama", heads=8, kv_heads=1, vocab=61),  # MQA
    dict(arch="qwen3", heads=4, kv_heads=2, vocab=113),  # q/k norm
    dict(arch="qwen2", heads=4, kv_heads=4, vocab=89),  # MHA, qkv bias
]


@pytest.mark.parametrize("cfg_kw", CONFIGS, ids=[c["arch"] + str(c["kv_heads"]) for c in CONFIGS])
@pytest.mark.parametrize("seed", range(2))
def test_tree_spec_equals_ar(cfg_kw: dict, seed: int) -> None:
    rng = random.Random(seed)
    cfg = tiny_config(**cfg_kw)
    target = tiny_model(cfg, seed)
    draft = tiny_model(cfg, seed + 1000)  # unrelated: low acceptance, many rejections
    prompts = [repetitive_prompt(rng, cfg.vocab_size, rng.randint(1, 30)) for _ in range(3)]
    max_new = rng.randint(12, 24)
    eos = [rng.randrange(cfg.vocab_size)]
    want = ar_tokens(target, prompts, max_new, eos)
    for i in range(len(SHAPES)):  # every source, shapes rotating over the cases
        shape = SHAPES[(i + seed + len(cfg_kw)) % len(SHAPES)]
        tree = build_static_tree(
            TreeShape(min(shape.depth, 4), shape.widths[:4], shape.max_nodes, shape.branch)
        )
        engines = {
            "ngram trie": Engine(
                target, NgramDrafter(k=4, max_n=rng.randint(1, 3)), plan=TreePlan(shape=shape)
            ),
            "draft model": Engine(
                target, DraftModelDrafter(draft, k=4), plan=fixed_tree_plan(tree)
            ),
            "perfect": Engine(
                target, DraftModelDrafter(target, k=4), plan=fixed_tree_plan(tree, 4)
            ),
            "block": Engine(target, block_drafter(target, 5), plan=fixed_tree_plan(tree)),
        }
        for name, engine in engines.items():
            got = tokens(generate(engine, prompts, max_new, eos))  # rows of three lengths
            assert got == want, f"{name} {shape} batched"
            alone = generate(engine, [prompts[i]], max_new, eos)[0].tokens
            assert alone == want[i], f"{name} {shape} alone"


@pytest.mark.parametrize("source", ["static", "trie"])
def test_eos_and_length_limit_inside_an_accepted_path(source: str) -> None:
    """The target drafting for itself (static tree), or n-gram lookup on a looping sequence
    (trie): whole paths are accepted, so stops fall inside them."""
    cfg = tiny_config(vocab=71)
    target = tiny_model(cfg, 3)
    prompt = [3, 1, 4, 1, 5]
    free = ar_tokens(target, [prompt], 30)[0]
    prompt = prompt + free * 2 if source == "trie" else prompt  # n-gram finds the continuation
    free = ar_tokens(target, [prompt], 30)[0]
    shape = TreeShape.uniform(depth=6, width=2, max_nodes=10, branch=2)

    def engine() -> Engine:
        if source == "trie":
            return Engine(target, NgramDrafter(k=6), plan=TreePlan(shape=shape))
        return Engine(
            target, DraftModelDrafter(target, k=6), plan=fixed_tree_plan(build_static_tree(shape))
        )

    for stop_at in (1, 5):
        eos = free[stop_at]
        want = generate(Engine(target), [prompt], 30, [eos])[0]
        got = generate(engine(), [prompt], 30, [eos])[0]
        assert got.tokens == want.tokens and got.stop_reason == "eos"
    for max_new in (1, 2, 9):
        res = generate(engine(), [prompt], max_new)[0]
        assert res.tokens == free[:max_new] and res.stop_reason == "length"
    if source == "static":
        assert generate(engine(), [prompt], 30)[0].stats.mean_accepted_len > 4.0


def test_tree_accepts_at_least_the_chain_with_ngram_and_is_token_forcing_clean() -> None:
    cfg = tiny_config(arch="qwen3", vocab=83)
    target = tiny_model(cfg, 1)
    rng = random.Random(1)
    prompts = [repetitive_prompt(rng, cfg.vocab_size, 30) for _ in range(2)]
    chain = generate(Engine(target, NgramDrafter(k=5)), prompts, 40)
    tree_plan = TreePlan(shape=TreeShape.uniform(5, 4, 16))
    tree = generate(Engine(target, NgramDrafter(k=5), plan=tree_plan), prompts, 40)
    assert tokens(tree) == tokens(chain) == ar_tokens(target, prompts, 40)
    assert sum(r.stats.cycles for r in tree) <= sum(r.stats.cycles for r in chain)
    report = force_tokens(
        target, [(str(i), p, r.tokens) for i, (p, r) in enumerate(zip(prompts, tree, strict=True))]
    )
    assert report.ok and report.near_ties == 0 and report.matches == 80


def test_draft_model_cache_has_room_for_a_tree_wider_than_k() -> None:
    cfg = tiny_config(vocab=67)
    target = tiny_model(cfg, 2)
    prompt = (list(range(1, 60)) * 5)[:250]
    want = ar_tokens(target, [prompt], 12)[0]
    tree = build_static_tree(TreeShape.uniform(depth=2, width=8, max_nodes=16, branch=8))
    assert tree.nodes == 16 and tree.max_rank == 7
    engine = Engine(target, DraftModelDrafter(tiny_model(cfg, 5), k=2), plan=fixed_tree_plan(tree))
    assert generate(engine, [prompt], 12)[0].tokens == want


# ---------------------------------------------------------------------- setup errors, registry
class NoTrees(HostDrafter):
    """A host drafter with neither tries nor candidates."""

    name, k = "no-trees", 2

    def propose(self, rows: DraftRows, attn_len: int) -> list[int]:
        return rows.write_drafts([[] for _ in rows.active])


def test_tree_plans_refuse_drafters_without_trees() -> None:
    target = tiny_model(tiny_config(), 0)
    with pytest.raises(ValueError, match="policy or a tree shape"):
        TreePlan()
    with pytest.raises(ValueError, match="drafter"):
        Engine(target, None, plan=TreePlan(shape=TreeShape.chain(2)))
    cases = [
        (DraftModelDrafter(target, k=2), TreePlan(shape=TreeShape.chain(2)), "proposes no trees"),
        (NoTrees(), TreePlan(shape=TreeShape.chain(2)), "proposes no trees"),
        (NoTrees(), fixed_tree_plan(build_static_tree(TreeShape.chain(2))), "candidates"),
        (
            DraftModelDrafter(target, k=2),
            fixed_tree_plan(build_static_tree(TreeShape.chain(3))),
            "deeper",
        ),
    ]
    for drafter, plan, msg in cases:
        with pytest.raises(ValueError, match=msg):
            generate(Engine(target, drafter, plan=plan), [[1, 2, 3]], 5)


def _build(drafter: object) -> EngineBuild:
    from types import SimpleNamespace

    return EngineBuild(config=SimpleNamespace(), target=None, draft_model=None, drafter=drafter)  # type: ignore[arg-type]


def test_registered_for_both_tree_sources() -> None:
    mech = MECHANISMS["tree-verify"]
    assert mech.plug_point == "verify_strategy"
    assert mech.applies.allows("cpu", "fp32", "ngram", "batched", "llama")
    assert mech.applies.allows("cuda", "bf16", "block", "single", "llama")
    assert mech.applies.allows("cpu", "fp32", "dflash", "single", "llama")
    assert not mech.applies.allows("cpu", "fp32", "none", "single", "llama")
    knobs = mech.resolve_knobs({"depth": 6, "width": 2, "max_nodes": 9})
    target = tiny_model(tiny_config(), 0)
    trie = _build(NgramDrafter(k=4))
    mech.apply(trie, knobs)
    assert trie.tree_shape == TreeShape.uniform(6, 2, 9, 2) and trie.tree_policy is None
    assert isinstance(trie.plan(), TreePlan)
    static = _build(DraftModelDrafter(target, k=4))
    mech.apply(static, knobs)  # depth 6 cut to the drafter's 4 positions
    assert isinstance(static.tree_policy, FixedTree) and static.tree_policy.tree.depth == 4
    assert any("cut" in note for note in static.notes)
    with pytest.raises(SpecPilotError, match="only one"):
        mech.apply(static, knobs)
    with pytest.raises(SpecPilotError, match="needs a drafter"):
        mech.apply(_build(None), knobs)
    with pytest.raises(SpecPilotError, match="proposes no trees"):
        mech.apply(_build(NoTrees()), knobs)
