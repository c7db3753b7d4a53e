"""Verify plans: how one speculative cycle drafts, verifies and accepts (the ``verify_plan`` plug).

Every plan runs the same three phases through the engine's runner, then the engine reads the
cycle back once (``[accepted, a_0..a_{W-1}]`` per row) and commits on the host:

* :class:`ChainPlan` — every row verifies ``[pending, d_1..d_w]`` in one dense forward; the
  block is as wide as the longest draft (a host drafter says how long its drafts are; on CUDA
  graphs the width is rounded up to a power of two), and an optional width policy
  (``engine/widths.py``) caps each row's drafts. The stock plan.
* :class:`PackedPlan` — row b verifies its own width ``w_b`` in one packed forward (ragged
  verify: the GEMMs run on ``sum(w_b)`` rows rounded up to a bucket); widths come from the
  policy, capped by each row's draft length.
* :class:`TreePlan` — row b verifies a draft tree: a static tree per row chosen by a tree policy
  and filled from a drafter's per-position candidates on the device, or a host drafter's trie
  (n-gram); one packed forward under a tree mask, then the tree rule accepts and compacts K/V
  on the device (``engine/accept.py``).

Whatever a plan does, acceptance is the exact greedy rule over the target's argmax, so a plan
changes speed, never a committed token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

import torch

from specpilot.drafters.static_tree import StaticTree
from specpilot.drafters.tree import TreeShape
from specpilot.engine.accept import tree_accept_and_commit, use_fused_tree_accept
from specpilot.engine.tree_policy import FixedTree, TreePolicy
from specpilot.engine.trees import TreeBuffers
from specpilot.engine.widths import WidthPolicy
from specpilot.models.layout import PackedLayout, PackedRows, bucket_rows

if TYPE_CHECKING:
    from specpilot.engine.view import EngineView


def _rows_fit(rows: PackedRows | None, batch: int, width: int) -> bool:
    """Whether buffers bound earlier serve this batch as they are. They must be kept then: the
    graphs an engine captured read them, and ``open`` re-binds the plan without recapturing."""
    return rows is not None and (rows.batch, rows.width) == (batch, width)


def _tree_bufs_fit(
    bufs: TreeBuffers | None,
    batch: int,
    width: int,
    k: int,
    ranks: int,
    hidden: tuple[int, int, torch.dtype] | None,
) -> bool:
    """Like :func:`_rows_fit`, for the tree buffers (``TreeBuffers.allocate``'s arguments)."""
    if bufs is None or (bufs.hidden is None) != (hidden is None):
        return False
    if tuple(bufs.tokens.shape) != (batch, width):
        return False
    if tuple(bufs.candidates.shape) != (batch, max(k, 1), max(ranks, 1)):
        return False
    if bufs.hidden is None or hidden is None:
        return True
    n_sel, size, dtype = hidden
    return tuple(bufs.hidden.shape) == (n_sel, batch, width, size) and bufs.hidden.dtype == dtype


def _packed_layout(
    engine: EngineView,
    rows: PackedRows,
    m: int,  # packed rows of this forward (a bucket)
    attn_len: int,
    depths: torch.Tensor | None = None,  # [B, W] tree depth of each block row (None: a chain)
    visible: torch.Tensor | None = None,  # [B, W, W] bool ancestor mask (with ``depths``)
) -> PackedLayout:
    """The layout of a packed verify over the engine's rows, from their committed lengths."""
    return PackedLayout.build(
        rows, m, engine.state.committed_len - 1, attn_len, engine.fwd.groups, engine.target.dtype,
        engine.capacity, depths, visible,
    )  # fmt: skip


def _pow2_width(w: int, cap: int) -> int:
    """Smallest power of two >= ``w``, capped at ``cap`` (graph keys stay few)."""
    p = 1
    while p < w:
        p *= 2
    return min(p, cap)


class _RowFeedback(Protocol):
    def reset_row(self, row: int) -> None: ...

    def observe(self, row: int, drafted: int, accepted: int) -> None: ...


_P = TypeVar("_P", bound=_RowFeedback)


class _PolicyFeedback(Generic[_P]):
    """A row's restart and each cycle's outcome, passed on to the optional per-row policy."""

    policy: _P | None

    def reset_row(self, row: int) -> None:
        if self.policy is not None:
            self.policy.reset_row(row)

    def observe(self, row: int, drafted: int, accepted: int) -> None:
        if self.policy is not None:
            self.policy.observe(row, drafted, accepted)


class _WidthCaps(_PolicyFeedback[WidthPolicy]):
    """Per-row draft caps from a width policy, written into ``state.cut`` (pinned copy)."""

    def __init__(self, policy: WidthPolicy | None) -> None:
        self.policy = policy
        self._host: torch.Tensor | None = None
        self._capped = False
        """A row's draft cap was applied once: ``cut`` is written on every cycle from then on."""

    def bind(self, engine: EngineView) -> None:
        dev = engine.device
        self._host = torch.zeros(engine.batch, dtype=torch.int64, pin_memory=dev.type == "cuda")
        if self.policy is not None:
            self.policy.reset(engine.batch, engine.k, 1)

    def widths(self, engine: EngineView) -> list[int]:
        """Per row: the widest block it verifies (the policy's, within the row's draft cap)."""
        active = engine.host.active
        if self.policy is None:
            widths = [engine.k + 1 if a else 0 for a in active]
        else:
            widths = self.policy.widths(active)
        caps = engine.draft_caps
        if any(c is not None for c in caps):
            self._capped = True
            widths = [w if c is None else min(w, c + 1) for w, c in zip(widths, caps, strict=True)]
        return widths

    def write(self, engine: EngineView, widths: Sequence[int]) -> None:
        if (self.policy is None and not self._capped) or self._host is None:
            return
        self._host.copy_(torch.tensor([max(w - 1, 0) for w in widths], dtype=torch.int64))
        engine.state.cut.copy_(self._host, non_blocking=True)


class ChainPlan:
    name = "chain"

    def __init__(self, width_policy: WidthPolicy | None = None) -> None:
        self.caps = _WidthCaps(width_policy)

    def block_width(self, k: int) -> int:
        return k + 1

    def widths_used(self, k: int, graphs: bool) -> list[int]:
        """Every block width a cycle may verify (on graphs: powers of two, capped at k + 1)."""
        return sorted({_pow2_width(w, k + 1) if graphs else w for w in range(1, k + 2)})

    def bind(self, engine: EngineView) -> None:
        self.caps.bind(engine)

    def reset_row(self, row: int) -> None:
        self.caps.reset_row(row)

    def observe(self, row: int, drafted: int, accepted: int) -> None:
        self.caps.observe(row, drafted, accepted)

    def cycle(self, engine: EngineView) -> tuple[int, list[int]]:
        host, k = engine.host, engine.k
        widths = self.caps.widths(engine)
        self.caps.write(engine, widths)
        lens = engine.run_draft()
        caps = [
            max(min(w - 1, k if lens is None else lens[b]), 0) if host.active[b] else 0
            for b, w in enumerate(widths)
        ]  # what the device accept may take of each row's drafts (draft_lens, cut)
        need = [min(c, room - 1) for c, room in zip(caps, engine.room(), strict=True)]
        w = 1 + max(need, default=0)  # no wider than the room of the row with the most
        if engine.runner.use_graphs:
            w = _pow2_width(w, k + 1)
        drafted = [min(c, w - 1) for c in caps]  # what the verify then sees of each row
        engine.mark()
        attn_len = engine.bucket(max(host.lens) - 1 + w)
        engine.verify_and_accept(
            lambda: engine.run_verify(w, attn_len), lambda: engine.run_accept(w - 1)
        )
        return w, drafted


class PackedPlan:
    name = "packed"

    def __init__(self, width_policy: WidthPolicy | None = None, bucket: int = 16) -> None:
        if bucket < 1:
            raise ValueError(f"the packed bucket must be at least 1, got {bucket}")
        self.caps = _WidthCaps(width_policy)
        self.bucket = bucket
        self.rows: PackedRows | None = None
        self.rows_verified = 0
        """Packed rows (bucket padding included) summed over cycles."""

    def block_width(self, k: int) -> int:
        return k + 1

    def bind(self, engine: EngineView) -> None:
        self.caps.bind(engine)
        if not _rows_fit(self.rows, engine.batch, engine.k + 1):
            self.rows = PackedRows.allocate(engine.batch, engine.k + 1, engine.device)
        self.rows_verified = 0

    def reset_row(self, row: int) -> None:
        self.caps.reset_row(row)

    def observe(self, row: int, drafted: int, accepted: int) -> None:
        self.caps.observe(row, drafted, accepted)

    def cycle(self, engine: EngineView) -> tuple[int, list[int]]:
        assert self.rows is not None
        host, k = engine.host, engine.k
        widths = self.caps.widths(engine)
        lens = engine.run_draft()
        widths = [
            max(min(w, 1 + (k if lens is None else lens[b]), room), 1) if host.active[b] else 0
            for b, (w, room) in enumerate(zip(widths, engine.room(), strict=True))
        ]
        m = min(bucket_rows(sum(widths), self.bucket), self.rows.capacity)
        self.rows.fill(widths, m)
        self.rows_verified += m
        engine.mark()
        rows, st = self.rows, engine.state
        attn_len = engine.bucket(max(host.lens) + k)

        def verify() -> None:
            st.cut.copy_(rows.data[3, : engine.batch])
            block = torch.cat([st.pending[:, None], st.drafts[:, :k]], dim=1)  # [B, k+1]
            lay = _packed_layout(engine, rows, m, attn_len)
            engine.forward_block(block, lay, st.verify_argmax, engine.verify_hidden)

        engine.verify_and_accept(
            lambda: engine.runner.run(
                ("packed_verify", m, attn_len), verify, st, engine.verify_graph_safe
            ),
            lambda: engine.run_accept(k),
        )
        return k + 1, [max(w - 1, 0) for w in widths]


class TreePlan(_PolicyFeedback[TreePolicy]):
    """Tree verify. ``policy`` picks each row's static tree (candidate drafters); ``shape``
    bounds a host drafter's trie (``propose_tree``). ``fused_accept``: accept and compact with
    the one Triton launch (None: wherever Triton runs, ``accept.use_fused_tree_accept``)."""

    name = "tree"

    def __init__(
        self,
        policy: TreePolicy | None = None,
        shape: TreeShape | None = None,
        bucket: int = 16,
        fused_accept: bool | None = None,
    ) -> None:
        if policy is None and shape is None:
            raise ValueError("A tree plan needs a tree policy or a tree shape.")
        self.policy = policy
        self.shape = shape
        self.bucket = bucket
        self.fused_accept = fused_accept
        self.fused = False
        """Whether the bound engine's accept runs the fused kernel."""
        self.bufs: TreeBuffers | None = None
        self.rows: PackedRows | None = None
        self.rows_verified = 0

    def block_width(self, k: int) -> int:
        if self.shape is not None and self.policy is None:
            return 1 + self.shape.max_nodes
        assert self.policy is not None
        return 1 + max(t.nodes for t in self.policy.shapes)

    def depth(self, k: int) -> int:
        if self.shape is not None and self.policy is None:
            return self.shape.depth
        return k

    def bind(self, engine: EngineView) -> None:
        drafter, w = engine.drafter, self.block_width(engine.k)
        assert drafter is not None
        host_trees = self.policy is None
        if host_trees and not hasattr(drafter, "propose_tree"):
            raise ValueError(f"The drafter '{drafter.name}' proposes no trees (use n-gram).")
        if not host_trees and not hasattr(drafter, "draft_candidates"):
            raise ValueError(
                f"Tree verify needs a drafter with per-position candidates or tries; "
                f"'{drafter.name}' has neither (use the block drafter, the draft model or n-gram)."
            )
        if self.policy is not None:
            if any(t.depth > engine.k for t in self.policy.shapes):
                raise ValueError(
                    f"A tree deeper than the drafter's {engine.k} positions was given."
                )
            self.policy.reset(engine.batch, engine.k)
        ranks = 1 + (max(t.max_rank for t in self.policy.shapes) if self.policy else 0)
        hid = None
        if drafter.hidden_layers:
            cfg = engine.target.cfg
            hid = (len(drafter.hidden_layers), cfg.hidden_size, engine.target.dtype)
        if not _tree_bufs_fit(self.bufs, engine.batch, w, engine.k, ranks, hid):
            self.bufs = TreeBuffers.allocate(engine.batch, w, engine.k, ranks, hid, engine.device)
        if not _rows_fit(self.rows, engine.batch, w):
            self.rows = PackedRows.allocate(engine.batch, w, engine.device)
        self.rows_verified = 0
        usable = use_fused_tree_accept(engine.device)
        if self.fused_accept and not usable:
            raise ValueError("The fused tree accept needs Triton on CUDA (or TRITON_INTERPRET=1).")
        self.fused = usable if self.fused_accept is None else self.fused_accept
        if self.fused and engine.cache is not None:
            engine.cache.tensor_offsets()  # its one host→device copy, before any capture

    def _static_trees(self, engine: EngineView) -> tuple[list[int], list[int]]:
        assert self.policy is not None and self.bufs is not None and engine.drafter is not None
        active = engine.host.active
        trees: list[StaticTree] = self.policy.trees(active)
        self.bufs.fill_static(trees)
        bufs, drafter, st = self.bufs, engine.drafter, engine.state
        attn_len = drafter.attn_len(engine, max(engine.host.lens))

        def draft() -> None:
            drafter.draft_candidates(engine, attn_len, bufs.candidates)  # type: ignore[attr-defined]
            bufs.gather_tokens(st.pending)

        engine.runner.run(("tree_draft", attn_len), draft, st, drafter.graph_safe)
        widths = [1 + t.nodes if a else 1 for t, a in zip(trees, active, strict=True)]
        return widths, [t.depth if a else 0 for t, a in zip(trees, active, strict=True)]

    def _host_trees(self, engine: EngineView) -> tuple[list[int], list[int]]:
        assert self.shape is not None and self.bufs is not None and engine.drafter is not None
        active = engine.host.active
        prop = engine.drafter.propose_tree(engine, self.shape)  # type: ignore[attr-defined]
        counts = [n if a else 0 for n, a in zip(prop.counts, active, strict=True)]
        prop.counts = counts
        self.bufs.fill_host(prop, engine.state.pending)
        return [1 + n for n in counts], [prop.max_depth(b) for b in range(len(counts))]

    def cycle(self, engine: EngineView) -> tuple[int, list[int]]:
        assert self.bufs is not None and self.rows is not None
        host_trees = self.policy is None
        widths, drafted = self._host_trees(engine) if host_trees else self._static_trees(engine)
        m = min(bucket_rows(sum(widths), self.bucket), self.rows.capacity)
        self.rows.fill(widths, m)
        self.rows_verified += m
        engine.mark()
        bufs, rows, st = self.bufs, self.rows, engine.state
        w, depth = bufs.width, self.depth(engine.k)
        attn_len = engine.bucket(max(engine.host.lens) - 1 + w)

        def verify() -> None:
            lay = _packed_layout(engine, rows, m, attn_len, bufs.topo[1], bufs.visible)
            engine.forward_block(bufs.tokens, lay, bufs.argmax, bufs.hidden)

        cache, fused = engine.cache, self.fused
        assert cache is not None

        def accept() -> None:
            tree_accept_and_commit(
                st, bufs.tokens, bufs.argmax, bufs.topo, bufs.visible, cache, depth,
                bufs.hidden, engine.verify_hidden, fused, engine.abstain_flag,
            )  # fmt: skip

        engine.verify_and_accept(
            lambda: engine.runner.run(
                ("tree_verify", m, attn_len), verify, st, engine.verify_graph_safe
            ),
            lambda: engine.runner.run(("tree_accept", depth, fused), accept, st),
        )
        return depth + 1, drafted


def fixed_tree_plan(
    tree: StaticTree, bucket: int = 16, fused_accept: bool | None = None
) -> TreePlan:
    """Every row verifies the same static tree."""
    return TreePlan(policy=FixedTree(tree), bucket=bucket, fused_accept=fused_accept)
