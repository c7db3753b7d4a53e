"""A DFlash-like block drafter: a few decoder layers at the target's width that draft a whole
block in one forward, conditioned on the target's hidden states.

Shape and cost follow DFlash ("Block Diffusion for Flash Speculative Decoding", z-lab): hidden states of ``len(hidden_layers)`` target layers are concatenated, projected by
``fc`` to the hidden size and normed; every drafter layer turns these context rows into K/V only
(no attention or MLP for them). The block ``[bonus, mask × (block-1)]`` then runs through the
layers attending to the whole context and, non-causally, to itself; the target's own LM head
turns rows 1.. into ``block - 1`` drafted tokens. Per cycle the drafter reads its layers' weights
once plus the target's LM head, as the real one does.

Context bookkeeping: the last verify fed the target ``[pending, d_1..d_k]`` at slots starting at
``prev_committed - 1``; their hidden states are written as context K/V at those slots. Only the
accepted ones (slots ``< committed_len - 1``) stay visible: the block is written from slot
``committed_len - 1`` on, over the rejected ones.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specpilot.config import ModelConfig
from specpilot.drafters.base import DraftRows, Segment
from specpilot.models.forward import Forward
from specpilot.models.kv_cache import KVCache
from specpilot.models.layer import DecoderLayer
from specpilot.models.layout import DenseLayout
from specpilot.models.transformer import Transformer


def default_hidden_layers(num_target_layers: int, count: int) -> tuple[int, ...]:
    """``count`` target layers spread from the second to the second-to-last (as DFlash picks)."""
    count = min(count, num_target_layers)
    if count == 1:
        return (num_target_layers // 2,)
    lo, hi = 1, max(num_target_layers - 2, 1)
    return tuple(sorted({lo + round(i * (hi - lo) / (count - 1)) for i in range(count)}))


class BlockDrafterWeights(nn.Module):
    """The drafter's own weights; embedding and LM head are the target's."""

    def __init__(
        self, cfg: ModelConfig, num_context: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, device) for _ in range(cfg.num_layers))
        self.fc = nn.Parameter(
            torch.empty(h, num_context * h, dtype=dtype, device=device), requires_grad=False
        )
        self.hidden_norm = nn.Parameter(
            torch.empty(h, dtype=dtype, device=device), requires_grad=False
        )

    def init_random(self, seed: int, std: float = 0.02) -> None:
        """Seeded random weights generated on their device."""
        gen = torch.Generator(device=self.fc.device).manual_seed(seed)
        with torch.no_grad():
            for name, prm in self.named_parameters():
                if prm.dim() == 1 and "norm" in name:
                    prm.normal_(1.0, 0.1, generator=gen)
                else:
                    prm.normal_(0.0, std, generator=gen)


class BlockDrafter:
    name = "block"
    graph_safe = True

    def __init__(
        self,
        target: Transformer,
        num_layers: int = 5,
        block: int = 16,
        num_context_layers: int = 5,
        mask_token_id: int = 0,
    ) -> None:
        if block < 2:
            raise ValueError(f"block must be at least 2, got {block}")
        tcfg = target.cfg
        self.cfg = ModelConfig.from_dict({**tcfg.to_dict(), "num_layers": num_layers})
        self.target = target
        self.block = block
        self.k = block - 1
        self.mask_token_id = mask_token_id
        self.hidden_layers = default_hidden_layers(tcfg.num_layers, num_context_layers)
        self.weights = BlockDrafterWeights(
            self.cfg, len(self.hidden_layers), target.dtype, target.device
        )
        self.fwd = Forward(target, layers=self._layers())
        self.cache: KVCache | None = None

    def num_params(self) -> int:
        return sum(p.numel() for p in self.weights.parameters())

    def bind(self, rows: DraftRows) -> None:
        st = rows.state
        self.cache = KVCache.allocate(
            self.cfg, st.batch_size, st.capacity, self.target.dtype, self.target.device
        )

    def _layers(self) -> list[DecoderLayer]:
        return [lyr for lyr in self.weights.layers if isinstance(lyr, DecoderLayer)]

    def _write_context(self, hidden: Tensor, start: Tensor, cache: KVCache) -> None:
        """``hidden [n_sel, B, T, H]`` target states → context K/V at slots ``start + t``."""
        n, b, t, h = hidden.shape
        feats = hidden.permute(1, 2, 0, 3).reshape(b * t, n * h)  # [B*T, n_sel*H]
        ctx = self.fwd.norm(F.linear(feats, self.weights.fc), self.weights.hidden_norm)  # [B*T, H]
        lay = DenseLayout.writes(start, t)
        for i, layer in enumerate(self.fwd.layers):
            self.fwd.write_kv(layer, ctx, cache.k[i], cache.v[i], lay)

    def prefill(self, rows: DraftRows, seg: Segment) -> None:
        assert seg.hidden is not None and self.cache is not None
        self._write_context(seg.hidden, seg.start, self.cache.slice(seg.first_row, seg.rows))

    def admitted(self, rows: DraftRows, which: Sequence[int]) -> None:
        return None

    def attn_len(self, rows: DraftRows, max_committed: int) -> int:
        return rows.bucket(max_committed + max(self.block, self.k + 1))

    def propose(self, rows: DraftRows, attn_len: int) -> None:
        logits = self._block_logits(rows, attn_len)  # [B, k, V]
        rows.state.drafts[:, : self.k].copy_(logits.argmax(dim=-1))
        rows.state.draft_lens.fill_(self.k)

    def draft_candidates(self, rows: DraftRows, attn_len: int, out: Tensor) -> None:
        """The R best tokens of each block position (``out [B, k, R]``), for static trees; the
        first choices also go to ``drafts`` as a chain."""
        logits = self._block_logits(rows, attn_len)  # [B, k, V]
        out.copy_(logits.topk(out.shape[2], dim=-1).indices)
        rows.state.drafts[:, : self.k].copy_(out[:, :, 0])
        rows.state.draft_lens.fill_(self.k)

    def _block_logits(self, rows: DraftRows, attn_len: int) -> Tensor:
        """One drafter forward over ``[pending, mask × k]``; logits of rows 1.. ``[B, k, V]``."""
        st, cache, hidden = rows.state, self.cache, rows.verify_hidden
        assert cache is not None and hidden is not None
        self._write_context(hidden, st.prev_committed - 1, cache)
        b = st.pending.shape[0]
        block = torch.full(
            (b, self.block), self.mask_token_id, dtype=torch.int64, device=st.pending.device
        )
        block[:, 0] = st.pending
        out = self.fwd.dense(block, cache, st.committed_len - 1, attn_len, causal=False)
        rows_out = out.view(b, self.block, -1)[:, 1:].reshape(b * self.k, -1)  # [B*k, H]
        return self.fwd.logits(rows_out).view(b, self.k, -1)

    def observe(self, rows: DraftRows, committed: Sequence[tuple[int, int, list[int]]]) -> None:
        return None
