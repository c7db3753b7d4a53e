"""The learned block drafters: DFlash and DFlash2 checkpoints behind the one drafter protocol.

Per cycle, one forward of the drafter network (``models/dflash.py``) over the block
``[pending, mask × k]`` at slots ``committed_len - 1 ..``, attending to the context K/V of every
committed token before it; the target's LM head turns rows 1..k into k drafts (DFlash: argmax;
DFlash2: the candidate selector's greedy walk). Graph-safe: device work only, fixed shapes per
attention bucket, no host sync.

Context bookkeeping (as the block drafter): the last verify fed the target ``[pending, d_1..]`` at
slots from ``prev_committed - 1``; their hidden states become context K/V at those slots. The
accepted ones lie below ``committed_len - 1`` and stay; the rest lie inside the block's slots and
are overwritten by it, so a query only ever reads the context of committed tokens. Prefill writes
the prompt's context. The block length is ``k + 1`` (at most the checkpoint's ``block_size``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from specpilot.drafters.base import DraftRows, Segment
from specpilot.models.dflash import DFlashNet, positions_of
from specpilot.models.forward import Forward
from specpilot.models.kv_cache import KVCache
from specpilot.models.layout import DenseLayout
from specpilot.models.transformer import Transformer


class DFlashDrafter:
    """Drafts ``k`` tokens per row with a DFlash / DFlash2 network."""

    graph_safe = True
    loads_checkpoint = True
    """Built from ``--draft-model DIR`` (a DFlash checkpoint), not from a loaded draft model."""

    def __init__(self, net: DFlashNet, k: int | None = None) -> None:
        spec = net.spec
        k = spec.block_size - 1 if k is None else k
        if not 1 <= k <= spec.block_size - 1:
            raise ValueError(
                f"this {spec.kind} drafter was trained with blocks of {spec.block_size}, so it "
                f"drafts 1 to {spec.block_size - 1} tokens per cycle, not {k}"
            )
        self.name = spec.kind
        self.net = net
        self.k = k
        self.block = k + 1
        self.hidden_layers = spec.target_layer_ids
        self.fwd = Forward(net, layers=net.decoder_layers())
        self.cache: KVCache | None = None

    @classmethod
    def load(
        cls, target: Transformer, path: str | Path, k: int | None = None, kind: str | None = None
    ) -> DFlashDrafter:
        """The checkpoint directory ``path`` (config.json + safetensors) for ``target``; ``kind``
        (``dflash`` / ``dflash2``) must match the checkpoint when given."""
        from specpilot.loading.dflash import load_dflash

        return cls(load_dflash(path, target, kind), k)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.net.parameters())

    def bind(self, rows: DraftRows) -> None:
        st = self.net
        if rows.state.capacity > st.target.max_positions:
            raise ValueError("the rows hold more slots than the RoPE table")
        self.cache = KVCache.allocate(
            st.cfg, rows.state.batch_size, rows.state.capacity, st.dtype, st.device
        )

    def prefill(self, rows: DraftRows, seg: Segment) -> None:
        assert seg.hidden is not None and self.cache is not None
        cache = self.cache.slice(seg.first_row, seg.rows)
        self.net.write_context(self.fwd, seg.hidden.to(self.net.dtype), seg.start, cache)

    def admitted(self, rows: DraftRows, which: Sequence[int]) -> None:
        return None

    def attn_len(self, rows: DraftRows, max_committed: int) -> int:
        return rows.bucket(max_committed + self.block)

    def propose(self, rows: DraftRows, attn_len: int) -> None:
        st = rows.state
        st.drafts[:, : self.k].copy_(self._drafts(rows, attn_len, 1)[:, :, 0])
        st.draft_lens.fill_(self.k)

    def draft_candidates(self, rows: DraftRows, attn_len: int, out: Tensor) -> None:
        """The R best tokens of each block position (``out [B, k, R]``), for static trees; the
        first choices also go to ``drafts`` as a chain."""
        out.copy_(self._drafts(rows, attn_len, out.shape[2]))
        rows.state.drafts[:, : self.k].copy_(out[:, :, 0])
        rows.state.draft_lens.fill_(self.k)

    def _drafts(self, rows: DraftRows, attn_len: int, ranks: int) -> Tensor:
        """One drafter forward; the ``ranks`` best tokens per draft position ``[B, k, R]``."""
        st, cache, hidden, net = rows.state, self.cache, rows.verify_hidden, self.net
        assert cache is not None and hidden is not None
        net.write_context(self.fwd, hidden.to(net.dtype), st.prev_committed - 1, cache)
        b = st.pending.shape[0]
        block = torch.full(
            (b, self.block), net.spec.mask_token_id, dtype=torch.int64, device=st.pending.device
        )
        block[:, 0] = st.pending
        start = st.committed_len - 1
        lay = DenseLayout.build(start, self.block, attn_len, self.fwd.groups, net.dtype, False)
        h = net.run_block(self.fwd, block, cache, lay, positions_of(start, self.block))
        h = h.view(b, self.block, -1)[:, 1:]  # [B, k, H]
        logits = net.logits(self.fwd, h.reshape(b * self.k, -1)).view(b, self.k, -1)
        if net.selector is not None:
            return net.select(h, logits, st.pending, ranks)
        if ranks == 1:
            return logits.argmax(dim=-1, keepdim=True)
        return logits.topk(ranks, dim=-1).indices

    def observe(self, rows: DraftRows, committed: Sequence[tuple[int, int, list[int]]]) -> None:
        return None


def load_dflash(target: Transformer, path: str | Path, k: int | None = None) -> DFlashDrafter:
    """``--drafter dflash``: a ``DFlashDraftModel`` checkpoint."""
    return DFlashDrafter.load(target, path, k, "dflash")


def load_dflash2(target: Transformer, path: str | Path, k: int | None = None) -> DFlashDrafter:
    """``--drafter dflash2``: a ``DFlash2DraftModel`` checkpoint."""
    return DFlashDrafter.load(target, path, k, "dflash2")
