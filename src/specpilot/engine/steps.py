"""The steps a cycle is made of, as the verify plans call them: the part of
:class:`~specpilot.engine.engine.Engine` that runs the drafter's proposal, the target's verify
forward over a block and the accept, each through the engine's runner (eager, or replayed from
a CUDA graph per shape key), and keeps the last verify for the abstain protocol.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from specpilot.engine.accept import accept_and_commit
from specpilot.models.layout import DenseLayout, Layout, PackedLayout

if TYPE_CHECKING:
    from specpilot.drafters.base import Drafter
    from specpilot.engine.rows import HostRows, RowState
    from specpilot.engine.runner import Runner
    from specpilot.models.forward import Forward
    from specpilot.models.kv_cache import KVCache
    from specpilot.models.transformer import Transformer


class VerifySteps:
    """Mixed into the engine, whose buffers and runner these steps use."""

    if TYPE_CHECKING:
        target: Transformer
        drafter: Drafter | None
        fwd: Forward
        runner: Runner
        batch: int
        host: HostRows
        cache: KVCache | None
        _hidden: Tensor | None
        _final: Tensor | None
        last_verify: tuple[Callable[[], None], Callable[[], None]] | None

        @property
        def state(self) -> RowState: ...
        @property
        def verify_graph_safe(self) -> bool: ...
        @property
        def abstain_flag(self) -> Tensor | None: ...
        def mark(self) -> None: ...

    def verify_and_accept(self, verify: Callable[[], None], accept: Callable[[], None]) -> None:
        """A cycle's verify then accept, kept so that the host can redo them with the stock head
        when the verify head abstains (the abstain protocol)."""
        self.last_verify = (verify, accept)
        verify()
        self.mark()
        accept()

    def run_verify(self, w: int, attn_len: int, with_hidden: bool = True, offset: int = 0) -> None:
        """Dense verify of ``[pending, drafts[:, :w-1]]`` per row into ``verify_argmax[:, :w]``.
        ``offset``: AR steps queued before this one (the host mirror lags by that much)."""
        hidden = self._hidden if with_hidden and self.drafter is not None else None
        host_start = None
        if not self.runner.use_graphs and self.batch == 1:
            host_start = self.host.lens[0] - 1 + offset
        step = self.verify_step(w, attn_len, hidden, host_start)
        key = ("verify", w, attn_len, hidden is not None)
        self.runner.run(key, step, self.state, self.verify_graph_safe)

    def verify_step(
        self, w: int, attn_len: int, hidden: Tensor | None, host_start: int | None
    ) -> Callable[[], None]:
        st = self.state

        def verify() -> None:
            block = (
                torch.cat([st.pending[:, None], st.drafts[:, : w - 1]], dim=1)
                if w > 1
                else st.pending[:, None]
            )
            lay = DenseLayout.build(
                st.committed_len - 1, w, attn_len, self.fwd.groups, self.target.dtype,
                host_start=host_start,
            )  # fmt: skip
            self.forward_block(block, lay, st.verify_argmax, hidden)

        return verify

    def run_accept(self, k: int) -> None:
        st = self.state
        self.runner.run(("accept", k), lambda: accept_and_commit(st, k, self.abstain_flag), st)

    def forward_block(
        self,
        block: Tensor,  # [B, W] int64: each row's block (a packed layout reads only its rows)
        lay: Layout,
        argmax_out: Tensor,  # [B, >= W] int64: a_j of each block row
        hidden_out: Tensor | None,  # [n_sel, B, >= W, hidden] for the drafter, or None
    ) -> None:
        """The target over a verify block: argmax (and the drafter's hidden states) in block order.
        Only the layout's live rows may make a verify head abstain (``engine/abstain.py``)."""
        fwd = self.fwd
        layers = () if hidden_out is None or self.drafter is None else self.drafter.hidden_layers
        tokens = block.reshape(-1)
        if isinstance(lay, PackedLayout):
            tokens = tokens.index_select(0, lay.gather_index)
        assert self.cache is not None
        x = fwd.run_layers(fwd.embed(tokens), self.cache, lay, layers, hidden_out)
        if self._final is not None:  # the logprobs of the committed tokens read it
            lay.to_block(x, self._final)
        live = lay.live_rows(self.state.active)  # [M]: idle rows and padding may not abstain
        lay.to_block(fwd.argmax(x, may_abstain=True, valid=live)[:, None], argmax_out[:, :, None])
