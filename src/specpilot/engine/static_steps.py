"""The packed and tree verify steps of :class:`~specpilot.engine.static_engine.StaticEngine`.

Mixins, so the engine's module keeps the chain path, prefill and the decode loop while the
batched-mode steps live here. Each ``_run_*`` fills the host-side layout, then replays (or
captures) one graph per (rows, attention bucket): no host sync inside a step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from specpilot.drafters.static_base import StaticDrafter
from specpilot.engine.cuda_graphs import GraphRunner
from specpilot.engine.device_state import DecodeState
from specpilot.engine.static_tree import TreeBuffers, tree_accept_and_commit
from specpilot.engine.tree_policy import TreePolicy
from specpilot.models.kv_cache import KVCache
from specpilot.models.packed_forward import PackedLayout, PackedVerify, bucket_rows
from specpilot.timing import time_call


class _EngineParts:
    """What the step mixins read from the engine (set in ``StaticEngine.__init__``/``_prepare``)."""

    state: DecodeState | None
    cache: KVCache | None
    layout: PackedLayout | None
    trees: TreeBuffers | None
    drafter: StaticDrafter | None
    verify_hidden: Tensor | None
    runner: GraphRunner
    packed: PackedVerify
    packed_bucket: int
    rows_verified: int
    tree_policy: TreePolicy | None
    tree_width: int
    k: int
    device: torch.device
    _dev_len: list[int]

    def bucket(self, need: int) -> int:
        raise NotImplementedError


class PackedSteps(_EngineParts):
    """Packed ragged verify: row b verifies its own width ``w_b <= k + 1``."""

    def _packed_verify_fn(self, rows: int, attn_len: int) -> Callable[[], None]:
        st, cache, layout, k = self.state, self.cache, self.layout, self.k
        assert st is not None and cache is not None and layout is not None and self.drafter
        layers = self.drafter.hidden_layers if self.verify_hidden is not None else ()

        def step() -> None:
            st.draft_lens.copy_(layout.data[3, : st.batch_size])
            block = torch.cat([st.pending[:, None], st.drafts[:, :k]], dim=1)  # [B, k+1]
            self.packed(
                block,
                layout,
                rows,
                cache,
                st.committed_len - 1,
                attn_len,
                st.verify_argmax,
                layers,
                self.verify_hidden,
            )

        return step

    def _run_packed_verify(self, widths: list[int], attn_len: int) -> None:
        assert self.state is not None and self.layout is not None
        full = len(widths) * (self.k + 1)
        rows = min(bucket_rows(sum(widths), self.packed_bucket), full)  # [M] real + padding
        self.layout.fill(widths, rows)
        self.rows_verified += rows
        fn = self._packed_verify_fn(rows, attn_len)
        self.runner.run(("packed_verify", rows, attn_len), fn, self.state)

    @torch.inference_mode()
    def time_packed_verify(self, rows: int, iters: int = 20) -> float:
        """Seconds per packed verify of ``rows`` tokens spread evenly over the batch (capped at
        ``k + 1`` per row) at the current committed state, by replaying its graph (median of 3
        runs of ``iters``). Writes only scratch: K/V past the committed length, the argmax."""
        assert self.state is not None and self.layout is not None
        b, w = self.state.batch_size, self.k + 1
        if not 1 <= rows <= b * w:
            raise ValueError(f"rows must be in [1, {b * w}], got {rows}.")
        widths = [min(w, rows // b + (1 if i < rows % b else 0)) for i in range(b)]
        self.layout.fill(widths, rows)
        attn_len = self.bucket(max(self._dev_len) + self.k)
        fn = self._packed_verify_fn(rows, attn_len)

        def once() -> None:
            self.runner.run(("time_packed", rows, attn_len), fn, self.state)  # type: ignore[arg-type]

        return time_call(once, self.device, iters, warmup=1)


class TreeSteps(_EngineParts):
    """Static tree verify: draft candidates, a packed verify under a tree mask, device accept."""

    def _tree_verify_fn(self, rows: int, attn_len: int) -> Callable[[], None]:
        st, cache, layout, trees = self.state, self.cache, self.layout, self.trees
        assert st is not None and cache is not None and layout is not None and trees is not None
        layers = () if self.drafter is None else self.drafter.hidden_layers
        layers = layers if trees.hidden is not None else ()

        def step() -> None:
            self.packed(
                trees.tokens,
                layout,
                rows,
                cache,
                st.committed_len - 1,
                attn_len,
                trees.argmax,
                layers,
                trees.hidden,
                depths=trees.topo[1],
                visible=trees.visible,
            )

        return step

    def _run_tree_verify(self, widths: list[int], attn_len: int) -> None:
        assert self.state is not None and self.layout is not None
        full = len(widths) * self.tree_width
        rows = min(bucket_rows(sum(widths), self.packed_bucket), full)  # [M] real + padding
        self.layout.fill(widths, rows)
        self.rows_verified += rows
        fn = self._tree_verify_fn(rows, attn_len)
        self.runner.run(("tree_verify", rows, attn_len), fn, self.state)

    def _run_tree_accept(self) -> None:
        st, trees, cache, k = self.state, self.trees, self.cache, self.k
        assert st is not None and trees is not None and cache is not None

        def step() -> None:
            tree_accept_and_commit(st, trees, cache, k, self.verify_hidden)

        self.runner.run(("tree_accept",), step, st)

    @torch.inference_mode()
    def time_tree_verify(self, iters: int = 20) -> float:
        """Seconds per tree verify of the trees the policy gives every row now, at the current
        committed state, by replaying its graph (median of 3 runs of ``iters``). Writes only
        scratch: K/V past the committed length, the tree argmax."""
        assert self.state is not None and self.trees is not None and self.tree_policy is not None
        trees = self.tree_policy.trees([True] * self.state.batch_size)
        self.trees.fill(trees)
        widths = [1 + t.nodes for t in trees]
        rows = min(bucket_rows(sum(widths), self.packed_bucket), len(widths) * self.tree_width)
        assert self.layout is not None
        self.layout.fill(widths, rows)
        attn_len = self.bucket(max(self._dev_len) + self.tree_width)
        fn = self._tree_verify_fn(rows, attn_len)

        def once() -> None:
            self.runner.run(("time_tree", rows, attn_len), fn, self.state)  # type: ignore[arg-type]

        return time_call(once, self.device, iters, warmup=1)
