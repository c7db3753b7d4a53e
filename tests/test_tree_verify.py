"""Tree verification: tree speculation equals plain AR token for token in fp32.

Exact cases of the acceptance rule on synthetic argmaxes, KV compaction, both drafters' trees, and
equivalence with AR over seeds, architectures (GQA, MQA, qwen3, tied), tree shapes, batches of rows
of different lengths, EOS and the length limit inside an accepted path, and token forcing.
"""

from __future__ import annotations

import random

import pytest
import torch

from conftest import tiny_config, tiny_model
from specpilot.drafters import DraftModelDrafter, NgramDrafter
from specpilot.drafters.tree import TreeShape, TrieBuilder, pack_trees
from specpilot.engine import SpecEngine
from specpilot.engine.strategy import ChainStrategy
from specpilot.errors import SpecPilotError
from specpilot.forcing import force_tokens
from specpilot.mechanisms import MECHANISMS
from specpilot.mechanisms.tree_verify import TreeStrategy, ancestor_mask, compact_path, tree_accept
from test_engine_equivalence import repetitive_prompt

SHAPES = [
    TreeShape.uniform(depth=4, width=3, max_nodes=10, branch=2),
    TreeShape(depth=6, widths=(3, 2, 2, 1, 1, 1), max_nodes=9, branch=3),
    TreeShape.chain(3),
]


def test_tree_accept_exact_cases():
    # root → 0(5) → 1(6) → 2(7);  root → 3(8) → 4(6);  0 → 5(9)
    tokens = [5, 6, 7, 8, 6, 9]
    parents = [-1, 0, 1, -1, 3, 0]
    # a_0 after root, then after each node
    assert tree_accept(tokens, parents, [5, 6, 7, 1, 0, 0, 0]).path == [0, 1, 2]
    out = tree_accept(tokens, parents, [5, 9, 0, 0, 0, 0, 4])  # 0 then its second child 5
    assert out.path == [0, 5] and out.bonus == 4
    out = tree_accept(tokens, parents, [8, 0, 0, 0, 6, 2, 0])  # the second branch
    assert out.path == [3, 4] and out.bonus == 2
    out = tree_accept(tokens, parents, [1, 6, 7, 9, 6, 0, 0])  # root rejects every child
    assert out.path == [] and out.bonus == 1
    # a node whose parent was rejected is never accepted, even if it matches
    assert tree_accept([5, 6], [-1, 0], [4, 6, 0]).path == []


def test_ancestor_mask_and_dfs_packing():
    trie = TrieBuilder(TreeShape.uniform(depth=3, width=4, max_nodes=8), max_depth=3)
    for cont in ([1, 2, 3], [1, 4], [5, 6, 7], [1, 2, 9]):
        trie.insert(cont)
    prop = pack_trees([trie.nodes])
    assert prop.tokens[0, : prop.counts[0]].tolist() == [1, 2, 3, 9, 4, 5, 6, 7]
    assert prop.parents[0, : prop.counts[0]].tolist() == [-1, 0, 1, 1, 0, -1, 5, 6]
    mask = ancestor_mask(prop.parents, prop.counts)[0].int()  # rows: root, nodes 0..7
    assert mask[4].tolist() == [1, 1, 1, 0, 1, 0, 0, 0, 0]  # node 3 (token 9): root, 0, 1, itself
    assert mask[8].tolist() == [1, 0, 0, 0, 0, 0, 1, 1, 1]
    # budgets: width 1 per depth keeps only the first path
    narrow = TrieBuilder(TreeShape.uniform(depth=3, width=1, max_nodes=8), max_depth=2)
    for cont in ([1, 2, 3], [1, 4], [5]):
        narrow.insert(cont)
    assert [n.token for n in narrow.nodes] == [1, 2]


def test_compact_path_moves_kv_without_touching_the_prefix():
    cfg = tiny_config()
    cache = tiny_model(cfg, 0).allocate_cache(2, 32)
    for k in cache.k + cache.v:
        k.copy_(torch.arange(32, dtype=torch.float32).view(1, 1, 32, 1).expand_as(k))
    compact_path(cache, row=1, start=5, path=[2, 4, 7])  # nodes at slots 8, 10, 13
    assert cache.k[0][1, 0, :, 0].tolist()[:10] == [0, 1, 2, 3, 4, 5, 8, 10, 13, 9]
    assert cache.v[1][0, 0, :, 0].tolist()[:10] == list(range(10))  # other row untouched


def test_ngram_tree_starts_with_the_chain_proposal():
    ctx = [1, 2, 3, 4, 9, 1, 2, 7, 8, 1, 2]
    chain, tree = NgramDrafter(k=3, max_n=2), NgramDrafter(k=3, max_n=2)
    chain.start([ctx])
    tree.start([ctx])
    want = chain.propose([ctx], [3]).tokens[0].tolist()
    prop = tree.propose_tree([ctx], [3], TreeShape.uniform(3, 3, 9))
    n = prop.counts[0]
    assert prop.tokens[0, :3].tolist() == want == [7, 8, 1]
    assert prop.parents[0, :3].tolist() == [-1, 0, 1]
    assert 3 in prop.tokens[0, :n].tolist()  # the older continuation (1, 2) → 3, 4, 9 is a branch
    assert int(prop.depths[0, :n].max()) <= 3


def ar_tokens(target, prompts, max_new, eos):
    return [r.tokens for r in SpecEngine(target).generate(prompts, max_new, eos)]


CONFIGS = [
    dict(arch="llama", heads=4, kv_heads=2, tie=True, vocab=101),  # GQA, tied
    dict(arch="llama", heads=8, kv_heads=1, vocab=61),  # MQA
    dict(arch="qwen3", heads=4, kv_heads=2, vocab=113),  # q/k norm
    dict(arch="qwen2", heads=4, kv_heads=4, vocab=89),  # MHA, qkv bias
]


@pytest.mark.parametrize("cfg_kw", CONFIGS, ids=[c["arch"] + str(c["kv_heads"]) for c in CONFIGS])
@pytest.mark.parametrize("seed", range(2))
def test_tree_spec_equals_ar(cfg_kw, seed):
    rng = random.Random(seed)
    cfg = tiny_config(**cfg_kw)
    target = tiny_model(cfg, seed)
    draft = tiny_model(cfg, seed + 1000)  # unrelated: low acceptance, many rejections
    prompts = [repetitive_prompt(rng, cfg.vocab_size, rng.randint(1, 30)) for _ in range(3)]
    max_new = rng.randint(12, 20)
    eos = [rng.randrange(cfg.vocab_size)]
    want = ar_tokens(target, prompts, max_new, eos)
    drafters = [
        NgramDrafter(k=4, max_n=rng.randint(1, 3)),
        DraftModelDrafter(draft, k=4),
        DraftModelDrafter(target, k=4),  # perfect drafter: whole paths accepted
    ]
    for i, drafter in enumerate(drafters):  # every drafter, shapes rotating over the cases
        shape = SHAPES[(i + seed + len(cfg_kw)) % len(SHAPES)]
        engine = SpecEngine(target, drafter, strategy=TreeStrategy(shape))
        got = [r.tokens for r in engine.generate(prompts, max_new, eos)]  # rows of 3 lengths
        assert got == want, f"{drafter.name} {shape} batched"
    engine = SpecEngine(target, drafters[seed], strategy=TreeStrategy(SHAPES[0]))
    assert engine.generate([prompts[0]], max_new, eos)[0].tokens == want[0], "single"


def test_eos_and_length_limit_inside_an_accepted_path():
    cfg = tiny_config(vocab=71)
    target = tiny_model(cfg, 3)
    prompt = [3, 1, 4, 1, 5]
    free = SpecEngine(target).generate([prompt], 30)[0].tokens
    shape = TreeShape.uniform(depth=6, width=2, max_nodes=10, branch=2)
    for stop_at in (1, 5):
        eos = free[stop_at]
        want = SpecEngine(target).generate([prompt], 30, [eos])[0]
        got = SpecEngine(
            target, DraftModelDrafter(target, k=6), strategy=TreeStrategy(shape)
        ).generate([prompt], 30, [eos])[0]
        assert got.tokens == want.tokens and got.stop_reason == "eos"
    for max_new in (1, 2, 9):
        res = SpecEngine(
            target, DraftModelDrafter(target, k=6), strategy=TreeStrategy(shape)
        ).generate([prompt], max_new)[0]
        assert res.tokens == free[:max_new] and res.stop_reason == "length"
    res = SpecEngine(target, DraftModelDrafter(target, k=6), strategy=TreeStrategy(shape)).generate(
        [prompt], 30
    )[0]
    assert res.stats.mean_accepted_len > 4.0


def test_tree_accepts_at_least_the_chain_with_ngram_and_is_token_forcing_clean():
    cfg = tiny_config(arch="qwen3", vocab=83)
    target = tiny_model(cfg, 1)
    rng = random.Random(1)
    prompts = [repetitive_prompt(rng, cfg.vocab_size, 30) for _ in range(2)]
    chain = SpecEngine(target, NgramDrafter(k=5), strategy=ChainStrategy()).generate(prompts, 40)
    tree = SpecEngine(
        target, NgramDrafter(k=5), strategy=TreeStrategy(TreeShape.uniform(5, 4, 16))
    ).generate(prompts, 40)
    assert [r.tokens for r in tree] == [r.tokens for r in chain]
    assert sum(r.stats.cycles for r in tree) <= sum(r.stats.cycles for r in chain)
    report = force_tokens(
        target, [(str(i), p, r.tokens) for i, (p, r) in enumerate(zip(prompts, tree, strict=True))]
    )
    assert report.ok and report.near_ties == 0 and report.matches == 80


def test_registered_and_refuses_drafters_without_trees():
    mech = MECHANISMS["tree-verify"]
    assert mech.plug_point == "verify_strategy"
    assert mech.applies.allows("cpu", "fp32", "ngram", "batched", "llama")
    assert not mech.applies.allows("cpu", "fp32", "dflash", "single", "llama")

    class ChainOnly:
        name, k = "chain-only", 2

        def start(self, contexts):
            pass

        def propose(self, contexts, max_lens):
            raise AssertionError

    target = tiny_model(tiny_config(), 0)
    engine = SpecEngine(target, ChainOnly(), strategy=TreeStrategy(TreeShape.chain(2)))
    with pytest.raises(SpecPilotError, match="proposes trees"):
        engine.generate([[1, 2, 3]], 5)


def test_draft_model_cache_has_room_for_a_tree_wider_than_k():
    cfg = tiny_config(vocab=67)
    target = tiny_model(cfg, 2)
    prompt = (list(range(1, 60)) * 5)[:250]  # the cache is sized from this context and k
    want = SpecEngine(target).generate([prompt], 12)[0].tokens
    shape = TreeShape.uniform(depth=3, width=8, max_nodes=17, branch=8)
    drafter = DraftModelDrafter(tiny_model(cfg, 5), k=2)
    got = SpecEngine(target, drafter, strategy=TreeStrategy(shape)).generate([prompt], 12)[0]
    assert got.tokens == want
