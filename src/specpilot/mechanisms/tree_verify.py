"""Tree verification: ``tree-verify`` (one tree shape for every row) and ``ragged-trees`` (a chain
for confident rows, a wider tree for uncertain ones, within a verify-token budget).

Terminology (greedy specialisation of SpecInfer, Miao et al. 2024, and Medusa/EAGLE tree
attention): the **root** is the pending token; drafted **nodes** hang below it, each with a
parent. The target runs once over ``[root, nodes…]`` under a tree mask (each node sees the
committed prefix, its ancestors and itself; RoPE at its depth), so node j's argmax is the
target's greedy token after the path root → j. A node is **accepted** when its token equals its
parent's argmax and its parent is accepted; the deepest accepted path is committed, plus the
target's **bonus** token after it, and its K/V is compacted to consecutive slots, not recomputed
(``engine/accept.py``). Every committed token is the target's argmax after the committed prefix.

Where the trees come from (``engine/plans.TreePlan``):

* a drafter with per-position candidates on the device (the block drafter, the draft model,
  simulated acceptance) fills a **static tree** (``drafters/static_tree.py``: node at depth d and
  rank r takes the r-th likeliest token of draft position d), one CUDA graph per shape;
* the n-gram drafter merges the continuations of every suffix match into a **trie** per row on
  the host (``NgramDrafter.propose_tree``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from specpilot.drafters.static_tree import StaticTree, build_static_tree
from specpilot.drafters.tree import TreeShape
from specpilot.engine.tree_policy import FixedTree, RaggedTrees
from specpilot.errors import SpecPilotError
from specpilot.mechanisms.registry import Applicability, ConfigView, Knob, Mechanism

if TYPE_CHECKING:
    from specpilot.mechanisms.parts import EngineParts

LOSSLESS = (
    "Each tree node is verified with exactly its path's context (tree mask: committed prefix, "
    "ancestors, itself; RoPE at its depth); only the longest root path whose every node equals "
    "the target's argmax at its parent is committed, plus the target's own bonus token, and its "
    "K/V is moved to consecutive slots, not recomputed; which tree a row verifies changes speed, "
    "never a committed token."
)


def _shape(build: EngineParts, knobs: Mapping[str, Any], candidates: bool) -> TreeShape:
    depth, width = int(knobs["depth"]), int(knobs["width"])
    if candidates and build.drafter is not None and depth > build.drafter.k:
        build.notes.append(f"tree depth {depth} cut to the drafter's {build.drafter.k} positions")
        depth = build.drafter.k
    return TreeShape.uniform(
        depth=depth,
        width=width,
        max_nodes=int(knobs["max_nodes"]),
        branch=min(int(knobs["branch"]), width),
    )


def _check(build: EngineParts) -> bool:
    """Whether the drafter gives candidates (static trees) rather than host tries."""
    d = build.drafter
    if d is None:
        raise SpecPilotError("Tree verification needs a drafter; choose one with --drafter.")
    if build.tree_policy is not None or build.tree_shape is not None or build.width_policy:
        raise SpecPilotError("Enable only one of tree-verify, ragged-trees and the width policies.")
    if hasattr(d, "draft_candidates"):
        return True
    if hasattr(d, "propose_tree"):
        return False
    raise SpecPilotError(f"The drafter '{d.name}' proposes no trees; disable tree-verify.")


def _apply_fixed(build: EngineParts, knobs: Mapping[str, Any]) -> None:
    candidates = _check(build)
    shape = _shape(build, knobs, candidates)
    if candidates:
        build.tree_policy = FixedTree(build_static_tree(shape))
    else:
        build.tree_shape = shape
    build.packed_bucket = build.packed_bucket or 16


def _apply_ragged(build: EngineParts, knobs: Mapping[str, Any]) -> None:
    if not _check(build):
        raise SpecPilotError("ragged-trees needs a drafter with per-position candidates.")
    assert build.drafter is not None
    build.tree_policy = RaggedTrees(
        confident=StaticTree.chain(min(int(knobs["chain"]), build.drafter.k)),
        uncertain=build_static_tree(_shape(build, knobs, True)),
        budget=float(knobs["budget"]),
        decay=float(knobs["decay"]),
        prior=float(knobs["prior"]),
    )
    build.packed_bucket = build.packed_bucket or 16


TREE_KNOBS = (
    Knob("depth", 8, low=1, high=31, doc="most drafted tokens on one path (<= drafter k)"),
    Knob("width", 3, low=1, high=8, doc="most nodes at each depth"),
    Knob("branch", 2, low=1, high=8, doc="children per node (ranks of a position's top-k)"),
    Knob("max_nodes", 24, low=1, high=64, doc="total nodes per tree (verify feeds 1 + nodes)"),
)

TREE_SEEDS = {
    "cuda": (
        {"depth": 16, "width": 7, "branch": 2, "max_nodes": 48},
        {"depth": 16, "width": 4, "branch": 2, "max_nodes": 32},
    )
}
"""Trees the H200 measured better than the 24-node default (``bench/tree_accept_gpu.py``, 8B
shape, EAGLE-like simulated profile: 48 nodes 1.298×, 32 nodes 1.248× the chain; the depth is cut
to the drafter's k): a verify there costs nearly the same at 1 + 48 tokens as at 1 + k, so wider
trees are nearly free. Not seeded on the CPU, where a verify's cost grows with its tokens."""


def _screen(config: ConfigView) -> str | None:
    """Under a simulated profile whose second choices are never right (no ``sibling``), every
    tree commits what the chain does (``AcceptanceProfile.best_tree_tau`` is the chain's τ) for a
    wider verify; None otherwise (real acceptance: the trial measures)."""
    from specpilot.drafters.simulated import AcceptanceProfile

    text = config.deployment.simulate_acceptance
    if text is None or AcceptanceProfile.parse(text).p_sibling > 0:
        return None
    return (
        "the simulated profile never makes a second choice right (no sibling=): every tree "
        "commits what the chain does, for a wider verify"
    )


MECHANISM = Mechanism(
    name="tree-verify",
    component="verify",
    plug_point="verify_strategy",
    lossless=LOSSLESS,
    apply=_apply_fixed,
    knobs=TREE_KNOBS,
    applies=Applicability(
        drafters=("ngram", "draft-model", "block", "dflash", "dflash2", "eagle3")
    ),
    summary="Verify a draft tree per row in one forward (tree mask), commit its longest path",
    seeds=TREE_SEEDS,
    screen=_screen,
)

RAGGED_TREES = Mechanism(
    name="ragged-trees",
    component="verify",
    plug_point="verify_strategy",
    lossless=LOSSLESS,
    apply=_apply_ragged,
    knobs=(
        *TREE_KNOBS,
        Knob("chain", 11, low=1, high=31, doc="chain length given to confident rows"),
        Knob("budget", 16.0, low=2.0, high=65.0, doc="verify tokens per active row per cycle"),
        Knob("decay", 0.2, low=0.01, high=1.0, doc="weight of the newest cycle in the EMA"),
        Knob("prior", 0.8, low=0.0, high=1.0, doc="initial per-position acceptance estimate"),
    ),
    applies=Applicability(
        drafters=("draft-model", "block", "dflash", "dflash2", "eagle3"), modes=("batched",)
    ),
    summary="A chain for confident rows, a wider tree for uncertain ones (batched)",
)
