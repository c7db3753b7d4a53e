"""Tree verification on the static (CUDA-graph) engine: ``static-tree-verify`` (one tree for every
row) and ``ragged-trees`` (a tree per row of a batch, chosen from its acceptance).

The block drafter's per-position top-k fills a static tree (``drafters/static_tree.py``); the
engine verifies it in one packed forward under a tree mask, accepts the longest argmax path on the
device and compacts its K/V (``engine/static_tree.py``). Only the static engine uses these (the
eager engine's trees are ``tree-verify``); both need a drafter with per-position candidates (the
block drafter).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from specpilot.drafters.static_tree import StaticTree, build_static_tree
from specpilot.drafters.tree import TreeShape
from specpilot.engine.tree_policy import FixedTree, RaggedTrees
from specpilot.errors import SpecPilotError
from specpilot.mechanisms.registry import Applicability, Knob, Mechanism

if TYPE_CHECKING:
    from specpilot.engine.build import EngineBuild

LOSSLESS = (
    "Each tree node is verified with exactly its path's context (tree mask: committed prefix, "
    "ancestors, itself; RoPE at its depth); only the longest root path whose every node equals "
    "the target's argmax at its parent is committed, plus the target's own bonus token, and its "
    "K/V is moved to consecutive slots, not recomputed; which tree a row verifies changes speed, "
    "never a committed token."
)


def _tree(knobs: Mapping[str, Any]) -> StaticTree:
    shape = TreeShape.uniform(
        depth=int(knobs["depth"]),
        width=int(knobs["width"]),
        max_nodes=int(knobs["max_nodes"]),
        branch=min(int(knobs["branch"]), int(knobs["width"])),
    )
    return build_static_tree(shape)


def _check_free(build: EngineBuild) -> None:
    if build.tree_policy is not None or build.width_policy is not None:
        raise SpecPilotError(
            "Enable only one of static-tree-verify, ragged-trees and the width policies."
        )


def _apply_fixed(build: EngineBuild, knobs: Mapping[str, Any]) -> None:
    _check_free(build)
    build.tree_policy = FixedTree(_tree(knobs))
    build.packed_bucket = build.packed_bucket or 16


def _apply_ragged(build: EngineBuild, knobs: Mapping[str, Any]) -> None:
    _check_free(build)
    build.tree_policy = RaggedTrees(
        confident=StaticTree.chain(int(knobs["chain"])),
        uncertain=_tree(knobs),
        budget=float(knobs["budget"]),
        decay=float(knobs["decay"]),
        prior=float(knobs["prior"]),
    )
    build.packed_bucket = build.packed_bucket or 16


TREE_KNOBS = (
    Knob("depth", 15, low=1, high=31, doc="most drafted tokens on one path (<= drafter k)"),
    Knob("width", 3, low=1, high=8, doc="most nodes at each depth"),
    Knob("branch", 2, low=1, high=8, doc="ranks of the block position's top-k per node"),
    Knob("max_nodes", 24, low=1, high=64, doc="total nodes per tree (verify feeds 1 + nodes)"),
)

STATIC_TREE_VERIFY = Mechanism(
    name="static-tree-verify",
    component="verify",
    plug_point="verify_strategy",
    lossless=LOSSLESS,
    apply=_apply_fixed,
    knobs=TREE_KNOBS,
    engines=("static",),
    applies=Applicability(drafters=("block",)),
    summary="Static engine: verify a draft tree from the block drafter's top-k in one graph",
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
    engines=("static",),
    applies=Applicability(drafters=("block",), modes=("batched",)),
    summary="Static batched engine: a chain for confident rows, a wider tree for uncertain ones",
)
