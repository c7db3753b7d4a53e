"""The engines the equivalence tests run: every drafter under every verify plan, built from a seed.

Each case builds ``Engine(target, drafter, plan=...)`` from the target, an unrelated model of the
same config (a drafter that accepts little and so rolls back often) and a ``random.Random`` that
picks its knobs (k, n-gram sizes, tree shapes, budgets), so that the cases cover many settings
across seeds. Cases are plain functions; ``tests/test_engine_equivalence.py`` checks that each one
commits exactly the plain AR tokens in fp32, ``tests/test_graphs.py`` that their device steps
never sync with the host and replay like CUDA graphs.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from specpilot.drafters import BlockDrafter, DraftModelDrafter, NgramDrafter
from specpilot.drafters.base import Drafter
from specpilot.drafters.dflash import DFlashDrafter
from specpilot.drafters.eagle3 import Eagle3Drafter
from specpilot.drafters.early_exit import early_exit_model
from specpilot.drafters.simulated import AcceptanceProfile, SimulatedAcceptance
from specpilot.drafters.static_tree import StaticTree, build_static_tree
from specpilot.drafters.tree import TreeShape
from specpilot.drafters.wrapped import FilteredDrafter
from specpilot.engine import Engine, Request, Scheduler, generate
from specpilot.engine.plans import ChainPlan, PackedPlan, TreePlan
from specpilot.engine.tree_policy import FixedTree, RaggedTrees
from specpilot.engine.view import VerifyPlan
from specpilot.engine.widths import RowBlockLength, TieredBudget
from specpilot.mechanisms import MECHANISMS
from specpilot.mechanisms.adaptive_block import AdaptiveBlock
from specpilot.mechanisms.fp8_copy import fp8_model
from specpilot.mechanisms.fp8_prefilter import Fp8Prefilter
from specpilot.mechanisms.int8_copy import cheap_model
from specpilot.mechanisms.parts import EngineParts
from specpilot.mechanisms.two_level import TwoLevelDrafter
from specpilot.mechanisms.two_level_device import DeviceTwoLevelDrafter
from specpilot.models.dflash import DFlashNet, spec_for_target
from specpilot.models.eagle3 import Eagle3Net
from specpilot.models.eagle3 import spec_for_target as eagle3_spec
from specpilot.models.transformer import Transformer
from specpilot.runtime import LoadedModel
from specpilot.synthetic import init_random_on_device

CONFIGS = [
    dict(arch="llama", heads=4, kv_heads=4, tie=False, vocab=97),  # MHA, untied
    dict(arch="llama", heads=4, kv_heads=2, tie=True, vocab=101),  # GQA 2:1, tied, odd vocab
    dict(arch="llama", heads=8, kv_heads=1, hidden=64, vocab=61),  # MQA
    dict(arch="qwen2", heads=4, kv_heads=2, vocab=89),  # qkv bias
    dict(arch="qwen3", heads=4, kv_heads=2, vocab=113),  # q/k RMSNorm
]
CONFIG_IDS = [
    f"{c['arch']}-h{c['heads']}kv{c['kv_heads']}{'-tied' * bool(c.get('tie'))}" for c in CONFIGS
]


def repetitive_prompt(rng: random.Random, vocab: int, length: int) -> list[int]:
    """Prompts with repeated spans, so that n-gram lookup finds something to propose."""
    base = [rng.randrange(vocab) for _ in range(max(1, length // 3))]
    out = (base * 4)[:length]
    for _ in range(length // 8):
        out[rng.randrange(length)] = rng.randrange(vocab)
    return out


def tokens(results: Sequence[object]) -> list[list[int]]:
    return [r.tokens for r in results]  # type: ignore[attr-defined]


def ar_tokens(
    target: Transformer, prompts: Sequence[Sequence[int]], max_new: int, eos: Sequence[int] = ()
) -> list[list[int]]:
    """Plain AR (the engine without a drafter), one row per prompt."""
    return tokens(generate(Engine(target), prompts, max_new, eos))


def check_cuda_drafter_equals_ar(target: Transformer, drafter: Drafter, graphs: bool) -> None:
    """fp32 on CUDA (eagerly or from graphs): a batch of three prompts and the same requests
    through the scheduler equal eager AR, and the drafter drafted."""
    rng = random.Random(7)
    vocab = target.cfg.vocab_size
    prompts = [repetitive_prompt(rng, vocab, rng.randint(1, 40)) for _ in range(3)]
    want = [r.tokens for r in generate(Engine(target, graphs=False), prompts, 40, [])]
    res = generate(Engine(target, drafter, graphs=graphs), prompts, 40, [])
    assert [r.tokens for r in res] == want
    assert sum(sum(r.stats.drafted) for r in res) > 0
    engine = Engine(target, drafter, graphs=graphs)
    sched = Scheduler(engine, slots=2, segment_tokens=7, max_context=96)
    reqs = [Request(str(i), tuple(p), 30, frozenset()) for i, p in enumerate(prompts)]
    assert [r.tokens for r in sched.run(reqs)] == [w[:30] for w in want]


def make_requests(
    rng: random.Random, vocab: int, n: int, target: Transformer | None = None
) -> list[Request]:
    """Prompts of 1..70 tokens, budgets of 1..40; with ``target``, an EOS id that its greedy
    continuation of the first prompt emits mid-way, so that rows finish by EOS mid-batch."""
    prompts = [tuple(repetitive_prompt(rng, vocab, rng.randint(1, 70))) for _ in range(n)]
    eos: frozenset[int] = frozenset()
    if target is not None:
        cont = ar_tokens(target, [list(prompts[0])], 12)[0]
        eos = frozenset([cont[rng.randrange(3, 12)]])
    return [Request(f"r{i}", p, rng.randint(1, 40), eos) for i, p in enumerate(prompts)]


def single_ar(target: Transformer, req: Request) -> list[int]:
    """The request alone under plain AR: what every scheduler run must give it."""
    return ar_tokens(target, [list(req.prompt_ids)], req.max_new_tokens, tuple(req.stop_ids))[0]


def block_drafter(target: Transformer, block: int = 6, seed: int = 3) -> BlockDrafter:
    """A one-layer block drafter with seeded random weights (a real, low-acceptance drafter)."""
    drafter = BlockDrafter(target, num_layers=1, block=block, num_context_layers=2)
    init_random_on_device(drafter.weights, seed)
    return drafter


def int8_drafter(target: Transformer, drafter: Drafter) -> Drafter:
    """``drafter`` with the ``int8-drafter`` mechanism applied (its matrices and drafting head
    from an INT8 copy), as the composition root applies it."""
    mech = MECHANISMS["int8-drafter"]
    parts = EngineParts(target=LoadedModel("t", target, None), draft_model=None, drafter=drafter)
    mech.apply(parts, mech.resolve_knobs({}))
    return drafter


def dflash_drafter(target: Transformer, rng: random.Random, kind: str = "dflash") -> DFlashDrafter:
    """A seeded DFlash (or DFlash2: block conv and candidate selector) drafter of 1-2 layers."""
    extra = {}
    if kind == "dflash2":
        extra = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)
    ids = sorted(rng.sample(range(target.cfg.num_layers), rng.randint(1, target.cfg.num_layers)))
    spec = spec_for_target(
        target.cfg, rng.randint(1, 2), rng.randint(3, 9), rng.randrange(target.cfg.vocab_size),
        48, ids, kind, **extra,
    )  # fmt: skip
    net = DFlashNet(spec, target)
    net.init_random(rng.randrange(100), std=0.15)
    return DFlashDrafter(net, rng.randint(2, spec.block_size - 1))


def eagle3_drafter(target: Transformer, rng: random.Random) -> Eagle3Drafter:
    """A seeded EAGLE-3 head over 3 random target layers and a random draft vocabulary."""
    n, v = target.cfg.num_layers, target.cfg.vocab_size
    ids = [rng.randrange(n) for _ in range(3)]
    spec = eagle3_spec(target.cfg, rng.randint(v // 3, v), 48, ids)
    net = Eagle3Net(spec, target)
    net.init_random(rng.randrange(100), std=0.15)
    return Eagle3Drafter(net, rng.randint(1, 7))


def simulated(
    target: Transformer,
    rng: random.Random,
    block: int = 6,
    p_sibling: float = 0.0,
    heterogeneous: bool = False,
) -> SimulatedAcceptance:
    """Simulated acceptance over a random block drafter (rows at different τ when
    ``heterogeneous``)."""
    k = block - 1
    prof = AcceptanceProfile.constant(rng.uniform(1.5, k), k)
    rows = [AcceptanceProfile.constant(t, k) for t in (1.2, k * 0.9)] if heterogeneous else []
    return SimulatedAcceptance(
        block_drafter(target, block, seed=rng.randrange(100)),
        prof,
        seed=rng.randrange(1000),
        row_profiles=rows,
        p_sibling=p_sibling,
    )


def tree_shape(rng: random.Random, depth: int) -> TreeShape:
    width = rng.randint(1, 3)
    return TreeShape.uniform(
        depth=depth, width=width, max_nodes=rng.randint(depth, depth * width), branch=min(2, width)
    )


def static_tree(rng: random.Random, k: int) -> StaticTree:
    return build_static_tree(tree_shape(rng, rng.randint(1, k)))


def ragged_trees(rng: random.Random, k: int) -> RaggedTrees:
    wide = build_static_tree(TreeShape.uniform(depth=k, width=3, max_nodes=2 * k + 2))
    chain = StaticTree.chain(k)
    return RaggedTrees(chain, wide, budget=rng.uniform(1 + k, 1 + wide.nodes), decay=0.5)


def _k(rng: random.Random) -> int:
    return rng.choice((1, 3, 5, 8, 16))


def _ngram(rng: random.Random, k: int | None = None) -> NgramDrafter:
    return NgramDrafter(k=_k(rng) if k is None else k, max_n=rng.randint(1, 4))


Case = Callable[[Transformer, Transformer, random.Random], Engine]


def _case(
    make: Callable[[Transformer, Transformer, random.Random], tuple[Drafter, VerifyPlan | None]],
) -> Case:
    def build(target: Transformer, other: Transformer, rng: random.Random) -> Engine:
        drafter, plan = make(target, other, rng)
        return Engine(target, drafter, plan=plan)

    return build


def _prefilter(target: Transformer, inner: Drafter, rng: random.Random) -> FilteredDrafter:
    keep = Fp8Prefilter(
        fp8_model(target), margin=rng.randint(0, 2), min_batch=1, catch_up=rng.choice((6, 64))
    )
    return FilteredDrafter(inner, keep, "fp8-prefilter")


CASES: dict[str, Case] = {
    # host drafter: n-gram lookup
    "ngram/chain": _case(lambda t, o, r: (_ngram(r), ChainPlan())),
    "ngram/chain+row-block-len": _case(
        lambda t, o, r: (_ngram(r), ChainPlan(RowBlockLength(r.uniform(0.2, 0.7))))
    ),
    "ngram/packed+tiered": _case(
        lambda t, o, r: (_ngram(r), PackedPlan(TieredBudget(r.uniform(1.5, 4.0)), r.choice((1, 4))))
    ),
    "ngram/tree-trie": _case(
        lambda t, o, r: (_ngram(r, 4), TreePlan(shape=tree_shape(r, r.randint(1, 6))))
    ),
    # device drafters: an unrelated draft model, the target drafting itself, early exit
    "draft/chain": _case(lambda t, o, r: (DraftModelDrafter(o, k=_k(r)), None)),
    "draft/packed+adaptive": _case(
        lambda t, o, r: (DraftModelDrafter(o, k=5), PackedPlan(AdaptiveBlock(), 4))
    ),
    "draft/fixed-tree": _case(
        lambda t, o, r: (DraftModelDrafter(o, k=4), TreePlan(FixedTree(static_tree(r, 4))))
    ),
    "perfect/chain+adaptive": _case(
        lambda t, o, r: (DraftModelDrafter(t, k=_k(r)), ChainPlan(AdaptiveBlock(slack=0.5)))
    ),
    "perfect/packed": _case(lambda t, o, r: (DraftModelDrafter(t, k=6), PackedPlan(None, 4))),
    "perfect/fixed-tree": _case(
        lambda t, o, r: (DraftModelDrafter(t, k=5), TreePlan(FixedTree(static_tree(r, 5))))
    ),
    "early-exit/chain": _case(
        lambda t, o, r: (DraftModelDrafter(early_exit_model(t, 1), k=r.randint(1, 6)), None)
    ),
    # the block drafter, real and under simulated acceptance
    "block/chain": _case(lambda t, o, r: (block_drafter(t, r.randint(2, 9)), None)),
    "block/packed+tiered": _case(
        lambda t, o, r: (block_drafter(t, 7), PackedPlan(TieredBudget(3.0), 4))
    ),
    "block/ragged-trees": _case(
        lambda t, o, r: (block_drafter(t, 6), TreePlan(ragged_trees(r, 5)))
    ),
    # the learned block drafters (seeded weights of the published architecture)
    "dflash/chain": _case(lambda t, o, r: (dflash_drafter(t, r), None)),
    "dflash/fixed-tree": _case(
        lambda t, o, r: (d := dflash_drafter(t, r), TreePlan(FixedTree(static_tree(r, d.k))))
    ),
    "dflash2/chain": _case(lambda t, o, r: (dflash_drafter(t, r, "dflash2"), None)),
    "dflash2/packed+tiered": _case(
        lambda t, o, r: (dflash_drafter(t, r, "dflash2"), PackedPlan(TieredBudget(3.0), 4))
    ),
    "eagle3/chain": _case(lambda t, o, r: (eagle3_drafter(t, r), None)),
    "eagle3/fixed-tree": _case(
        lambda t, o, r: (d := eagle3_drafter(t, r), TreePlan(FixedTree(static_tree(r, d.k))))
    ),
    "eagle3/packed": _case(lambda t, o, r: (eagle3_drafter(t, r), PackedPlan())),
    "sim/chain": _case(lambda t, o, r: (simulated(t, r, r.randint(3, 9)), None)),
    "sim/packed+row-block-len": _case(
        lambda t, o, r: (simulated(t, r, 8, heterogeneous=True), PackedPlan(RowBlockLength(0.3), 4))
    ),
    "sim/fixed-tree": _case(
        lambda t, o, r: (simulated(t, r, 6, p_sibling=0.6), TreePlan(FixedTree(static_tree(r, 5))))
    ),
    "sim/ragged-trees": _case(
        lambda t, o, r: (
            simulated(t, r, 7, p_sibling=0.5, heterogeneous=True),
            TreePlan(ragged_trees(r, 6), bucket=4),
        )
    ),
    # the drafter's own weights and drafting head from an INT8 copy (drafts only)
    "int8-drafter(block)/chain": _case(
        lambda t, o, r: (int8_drafter(t, block_drafter(t, r.randint(2, 9))), None)
    ),
    "int8-drafter(dflash)/chain": _case(
        lambda t, o, r: (int8_drafter(t, dflash_drafter(t, r)), None)
    ),
    "int8-drafter(draft)/packed": _case(
        lambda t, o, r: (int8_drafter(t, DraftModelDrafter(o, k=_k(r))), PackedPlan())
    ),
    # host wrappers: two-level correction (INT8 copy) and the FP8 pre-filter
    "two-level(ngram)/chain": _case(
        lambda t, o, r: (
            TwoLevelDrafter(_ngram(r, r.randint(1, 4)), cheap_model(t), r.randint(0, 3)),
            None,
        )
    ),
    "two-level(draft)/packed": _case(
        lambda t, o, r: (
            TwoLevelDrafter(DraftModelDrafter(o, k=3), cheap_model(t), 1),
            PackedPlan(),
        )
    ),
    # two-level correction inside the captured draft step (graph-safe inner drafters)
    "two-level-dev(draft)/chain": _case(
        lambda t, o, r: (
            DeviceTwoLevelDrafter(DraftModelDrafter(o, k=r.randint(1, 5)), cheap_model(t), 0),
            None,
        )
    ),
    "two-level-dev(block)/chain+row-block-len": _case(
        lambda t, o, r: (
            DeviceTwoLevelDrafter(block_drafter(t, r.randint(2, 7)), cheap_model(t), 2),
            ChainPlan(RowBlockLength(r.uniform(0.2, 0.7))),
        )
    ),
    "two-level-dev(sim)/packed": _case(
        lambda t, o, r: (
            DeviceTwoLevelDrafter(simulated(t, r, 6, heterogeneous=True), cheap_model(t), 1),
            PackedPlan(None, 4),
        )
    ),
    "fp8-prefilter(ngram)/chain": _case(lambda t, o, r: (_prefilter(t, _ngram(r), r), None)),
    "fp8-prefilter(perfect)/packed+tiered": _case(
        lambda t, o, r: (
            _prefilter(t, DraftModelDrafter(t, k=5), r),
            PackedPlan(TieredBudget(4.0), 4),
        )
    ),
}
"""Every drafter under every plan; the name says ``drafter/plan``."""


def check_drafter_equals_ar(target: Transformer, drafter: Drafter, rng: random.Random, vocab: int) -> None:  # fmt: skip
    """A drafter's speculative output equals AR's (fp32, CPU): batched with EOS, one prompt
    alone, through the scheduler with prompt segments, and under a static-tree verify; and it
    drafted something."""
    prompts = [repetitive_prompt(rng, vocab, rng.randint(1, 40)) for _ in range(3)]
    eos = [rng.randrange(vocab)]
    want = ar_tokens(target, prompts, 40, eos)
    res = generate(Engine(target, drafter), prompts, 40, eos)
    assert [r.tokens for r in res] == want
    assert sum(sum(r.stats.drafted) for r in res) > 0
    assert generate(Engine(target, drafter), [prompts[1]], 40, eos)[0].tokens == want[1]
    sched = Scheduler(Engine(target, drafter), slots=2, segment_tokens=7, max_context=96)
    reqs = [Request(str(i), tuple(p), rng.randint(5, 40), frozenset(eos)) for i, p in enumerate(prompts + prompts[:1])]  # fmt: skip
    assert [r.tokens for r in sched.run(reqs)] == [single_ar(target, r) for r in reqs]
    tree = build_static_tree(TreeShape.uniform(depth=drafter.k, width=2, max_nodes=2 * drafter.k))
    tree_res = generate(Engine(target, drafter, plan=TreePlan(FixedTree(tree))), prompts, 40, eos)
    assert [r.tokens for r in tree_res] == want
