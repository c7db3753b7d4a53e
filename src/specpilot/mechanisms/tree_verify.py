"""Tree verification: verify a draft tree in one target forward, commit its longest accepted path.

Terminology (greedy specialisation of SpecInfer, Miao et al. 2024, and Medusa/EAGLE tree attention;
chain terms as in ``engine/verify.py``):

* the **root** is the pending token (last committed, KV not cached yet), node 0 of the forward;
  drafted **nodes** 1..N follow (``TreeProposal`` node i is forward row i + 1), each with a parent;
* the target runs once on ``[root, nodes…]`` with a tree mask (each node sees the committed prefix,
  its ancestors and itself) and RoPE positions ``committed_len + depth``, so row j's argmax ``a_j``
  is the target's greedy token after the path root → j;
* a node is **accepted** when its token equals ``a_parent`` and its parent is accepted (the root
  is); with distinct sibling tokens the accepted nodes form one path, and the deepest one ends it;
* the **bonus** token is ``a_last`` (``a_0`` when nothing is accepted); **committed** tokens are the
  path's tokens and the bonus: every one is the target's argmax after the committed prefix, which
  is why the scheme is lossless, exactly as for a chain.

The forward wrote node j's K/V at slot ``L + j``. The accepted path's entries are copied down to
slots ``L + 1 .. L + m`` (no recomputation: a node's K/V depends only on its token, its position and
its ancestors, which is what a chain over the path would have seen); then the length is committed
to ``L + m + 1``. Nodes come in DFS order with the drafter's first choice first, so accepting that
first path needs no copy at all.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from specpilot.drafters.base import Drafter
from specpilot.drafters.tree import TreeDrafter, TreeProposal, TreeShape, empty_trees
from specpilot.engine.strategy import CycleOutcome
from specpilot.errors import SpecPilotError
from specpilot.mechanisms.registry import Applicability, Knob, Mechanism
from specpilot.models.kv_cache import KVCache
from specpilot.models.transformer import Transformer

if TYPE_CHECKING:
    from specpilot.engine.build import EngineBuild


@dataclass(slots=True)
class TreeAccept:
    """The accepted path of one row."""

    path: list[int]  # node indices (0-based, TreeProposal order), root excluded, root → leaf
    bonus: int  # the target's token after the path


def tree_accept(
    tokens: Sequence[int],  # [n] drafted node tokens
    parents: Sequence[int],  # [n] parent node index, -1 = root (parents precede children)
    target_argmax: Sequence[int],  # [1 + n]: a_0 (after the root), then after each node
) -> TreeAccept:
    """Longest root-to-node path whose every token is the target's argmax at its parent."""
    accepted = [False] * len(tokens)
    depth = [0] * len(tokens)
    best = -1
    for i, (tok, par) in enumerate(zip(tokens, parents, strict=True)):
        parent_ok = par < 0 or accepted[par]
        if parent_ok and tok == target_argmax[par + 1]:
            accepted[i] = True
            depth[i] = 1 + (depth[par] if par >= 0 else 0)
            if best < 0 or depth[i] > depth[best]:
                best = i
    path: list[int] = []
    node = best
    while node >= 0:
        path.append(node)
        node = parents[node]
    path.reverse()
    return TreeAccept(path=path, bonus=target_argmax[best + 1])


def ancestor_mask(parents: Tensor, counts: Sequence[int]) -> Tensor:
    """``[B, 1+N, 1+N]`` bool: forward row j may attend row i iff i is j or an ancestor of j."""
    b, n = parents.shape
    rows: list[list[int]] = parents.tolist()
    mask = torch.eye(n + 1, dtype=torch.bool).repeat(b, 1, 1)
    mask[:, :, 0] = True  # every node descends from the root
    for row in range(b):
        m = mask[row]
        for i in range(counts[row]):
            par = rows[row][i]
            if par >= 0:
                m[i + 1] |= m[par + 1]
    return mask


def compact_path(cache: KVCache, row: int, start: int, path: Sequence[int]) -> None:
    """Copy the K/V of the path's nodes (slots ``start + 1 + node``) to ``start + 1 ..``."""
    if all(node == i for i, node in enumerate(path)):
        return  # already contiguous (the drafter's first path)
    dev = cache.k[0].device
    src = torch.tensor([start + 1 + node for node in path], device=dev)
    dst = torch.arange(start + 1, start + 1 + len(path), device=dev)
    for k, v in zip(cache.k, cache.v, strict=True):
        k[row, :, dst] = k[row, :, src]  # [H_kv, m, D]; the right side is gathered first
        v[row, :, dst] = v[row, :, src]


class TreeStrategy:
    """The ``verify_strategy`` plug for trees (see the module docstring)."""

    name = "tree"

    def __init__(self, shape: TreeShape) -> None:
        self.shape = shape

    def width(self, drafter: Drafter | None) -> int:
        return 0 if drafter is None else self.shape.max_nodes

    def propose(
        self, drafter: Drafter | None, contexts: Sequence[Sequence[int]], max_lens: Sequence[int]
    ) -> TreeProposal:
        if drafter is None or max(max_lens) <= 0:
            return empty_trees(len(contexts))
        if not isinstance(drafter, TreeDrafter):
            raise SpecPilotError(
                f"Tree verification needs a drafter that proposes trees; '{drafter.name}' does not "
                "(use ngram or draft-model, or disable tree-verify)."
            )
        return drafter.propose_tree(contexts, max_lens, self.shape)

    def verify(
        self,
        target: Transformer,
        cache: KVCache,
        pending: Tensor,  # [B] int64 (host)
        proposal: TreeProposal,
        active: Sequence[bool],
    ) -> CycleOutcome:
        dev = target.device
        b = len(active)
        starts = cache.lengths.clone()  # [B] committed lengths (host)
        inputs = torch.cat([pending[:, None], proposal.tokens], dim=1)  # [B, 1+N]
        depths = torch.cat([torch.zeros(b, 1, dtype=torch.int64), proposal.depths], dim=1)
        positions = starts[:, None] + depths  # [B, 1+N]
        mask = ancestor_mask(proposal.parents, proposal.counts)  # [B, 1+N, 1+N]
        argmax = target.forward_argmax(
            inputs.to(dev), cache, positions=positions.to(dev), tree_mask=mask.to(dev)
        ).tolist()  # [B][1+N]
        tokens, parents = proposal.tokens.tolist(), proposal.parents.tolist()
        committed: list[list[int]] = []
        draft_lens: list[int] = []
        accepted_lens: list[int] = []
        for row in range(b):
            if not active[row]:
                committed.append([])
                draft_lens.append(0)
                accepted_lens.append(0)
                continue
            n = proposal.counts[row]
            acc = tree_accept(tokens[row][:n], parents[row][:n], argmax[row][: n + 1])
            start = int(starts[row])
            compact_path(cache, row, start, acc.path)
            cache.commit(row, start + len(acc.path) + 1)
            committed.append([tokens[row][i] for i in acc.path] + [acc.bonus])
            draft_lens.append(proposal.max_depth(row))
            accepted_lens.append(len(acc.path))
        return CycleOutcome(committed=committed, draft_lens=draft_lens, accepted_lens=accepted_lens)


def _apply(build: EngineBuild, knobs: Mapping[str, Any]) -> None:
    depth, width = int(knobs["depth"]), int(knobs["width"])
    shape = TreeShape.uniform(
        depth=depth,
        width=width,
        max_nodes=int(knobs["max_nodes"]),
        branch=min(int(knobs["branch"]), width),
    )
    build.strategy = TreeStrategy(shape)


MECHANISM = Mechanism(
    name="tree-verify",
    component="verify",
    plug_point="verify_strategy",
    lossless=(
        "Only the longest root-to-node path whose every token equals the target's argmax at its "
        "parent is committed, plus the target's own bonus token; the tree mask and depth positions "
        "give each node exactly its path's context, and its KV is moved, not recomputed."
    ),
    apply=_apply,
    knobs=(
        Knob("depth", 8, low=1, high=16, doc="most drafted tokens on one path"),
        Knob("width", 4, low=1, high=8, doc="most nodes at each depth"),
        Knob("branch", 2, low=1, high=8, doc="children proposed per expanded node (top-k)"),
        Knob("max_nodes", 24, low=1, high=64, doc="total nodes per tree (verify feeds 1 + nodes)"),
    ),
    engines=("eager",),
    applies=Applicability(drafters=("ngram", "draft-model")),
    summary="Verify a draft tree in one forward (tree mask), commit its longest accepted path",
)
