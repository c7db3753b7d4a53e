"""The EAGLE-3 drafter: a ``LlamaForCausalLMEagle3`` checkpoint behind the one drafter protocol.

The drafter's own KV cache (one layer) holds, at slot j, the midlayer row ``(g_j, x_{j+1})``:
the fc'd target feature of token j and the embedding of token j + 1 (``models/eagle3.py``).
That row is valid once token j + 1 is committed, so a row's valid drafter slots are those below
``committed_len - 1`` (the target's own invariant, one slot behind).

Per cycle (graph-safe: device work only, fixed shapes per attention bucket, no host sync):

1. **Context.** The last verify fed the target ``[pending, d_1..d_k]`` at slots
   ``P - 1 .. P + k - 1`` (``P = prev_committed``); those ``k + 1`` rows go through the midlayer
   at the same slots with the tokens after them. The accepted ones (below ``C - 1``,
   ``C = committed_len``) are now exact; the rest lie at or past ``C - 1`` and are overwritten by
   the draft steps or the next cycle, and no valid row attends to them (causal).
2. **First draft.** The output at slot ``C - 2`` (row ``C - P - 1`` of step 1, or, right after
   a prompt, the output the prefill kept) scores the draft vocabulary; the argmax, mapped by
   ``d2t``, is d_1.
3. **Steps 2..k.** Row ``(h, d_i)`` at slot ``C - 2 + i``: the previous output stands in for the
   target feature; its output gives d_{i+1}.

Prefill writes the prompt's rows. The last row of a segment needs the token after it: the final
segment has it (the first generated token, already in ``tokens``) and keeps that row's output
for step 2; a non-final segment's last row is redone at the start of the next segment, from the
feature kept for it.

``draft_candidates`` gives, per draft position, the R best tokens of the step's scores along
the greedy chain (static trees, as the draft-model drafter does).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from specpilot.drafters.base import DraftRows, Segment
from specpilot.models.eagle3 import Eagle3Net
from specpilot.models.forward import Forward
from specpilot.models.kv_cache import KVCache
from specpilot.models.layout import DenseLayout
from specpilot.models.transformer import Transformer


class Eagle3Drafter:
    """Drafts ``k`` tokens per row with an EAGLE-3 midlayer."""

    name = "eagle3"
    graph_safe = True
    loads_checkpoint = True
    """Built from ``--draft-model DIR`` (an EAGLE-3 checkpoint), not from a loaded draft model."""

    def __init__(self, net: Eagle3Net, k: int = 6) -> None:
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        self.net = net
        self.k = k
        self.hidden_layers = net.spec.aux_layer_ids
        self.fwd = Forward(net)
        self.cache: KVCache | None = None
        self.out_tail: Tensor | None = None  # [B, H] output at slot C - 2 after a prompt
        self.feat_tail: Tensor | None = None  # [B, H] fc'd feature of a segment's last token

    @classmethod
    def load(cls, target: Transformer, path: str | Path, k: int | None = None) -> Eagle3Drafter:
        """The checkpoint directory ``path`` (config.json + safetensors) for ``target``."""
        from specpilot.loading.eagle3 import load_eagle3

        return cls(load_eagle3(path, target), 6 if k is None else k)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.net.parameters())

    def bind(self, rows: DraftRows) -> None:
        net, st = self.net, rows.state
        if st.capacity > net.target.max_positions:
            raise ValueError("the rows hold more slots than the RoPE table")
        self.cache = KVCache.allocate(net.cfg, st.batch_size, st.capacity, net.dtype, net.device)
        shape = (st.batch_size, net.spec.hidden_size)
        self.out_tail = torch.zeros(shape, dtype=net.dtype, device=net.device)
        self.feat_tail = torch.zeros(shape, dtype=net.dtype, device=net.device)

    def _layout(self, start: Tensor, t: int, attn_len: int) -> DenseLayout:
        return DenseLayout.build(start, t, attn_len, self.fwd.groups, self.net.dtype, True)

    def prefill(self, rows: DraftRows, seg: Segment) -> None:
        first_row, tokens, start, hidden = seg.first_row, seg.tokens, seg.start, seg.hidden
        attn_len = seg.attn_len
        assert hidden is not None and self.cache is not None
        assert self.out_tail is not None and self.feat_tail is not None
        net, st, b, t = self.net, rows.state, tokens.shape[0], tokens.shape[1]
        sl = slice(first_row, first_row + b)
        cache, known = self.cache.slice(first_row, b), st.tokens[sl]  # [b, S]
        # The previous segment's last row, now that its next token (tokens[:, 0]) is known; a
        # new prompt (start 0) writes junk at slot 0, which the segment's first row overwrites.
        redo = (start - 1).clamp(min=0)
        net.step(self.fwd, self.feat_tail[sl], tokens[:, 0], cache, self._layout(redo, 1, attn_len))
        g = net.features(hidden.to(net.dtype))  # [b, T, H]
        cols = (start[:, None] + 1 + torch.arange(t, device=start.device)).clamp(max=known.shape[1] - 1)  # fmt: skip
        nxt = known.gather(1, cols)  # [b, T] the token after each row
        h = net.step(self.fwd, g.reshape(b * t, -1), nxt.reshape(-1), cache, self._layout(start, t, attn_len))  # fmt: skip
        last = (st.committed_len[sl] - 2 - start).clamp(0, t - 1)  # [b] the segment's last row
        pick = torch.arange(b, device=start.device)
        self.feat_tail[sl] = g[pick, last]
        self.out_tail[sl] = h.view(b, t, -1)[pick, last]

    def admitted(self, rows: DraftRows, which: Sequence[int]) -> None:
        return None

    def attn_len(self, rows: DraftRows, max_committed: int) -> int:
        return rows.bucket(max_committed + self.k + 1)

    def propose(self, rows: DraftRows, attn_len: int) -> None:
        self._draft(rows, attn_len, None)

    def draft_candidates(self, rows: DraftRows, attn_len: int, out: Tensor) -> None:
        """The R best tokens of each draft position (``out [B, k, R]``) along the greedy chain,
        which also goes to ``drafts``."""
        self._draft(rows, attn_len, out)

    def _draft(self, rows: DraftRows, attn_len: int, out: Tensor | None) -> None:
        st, cache, hidden, net, fwd = rows.state, self.cache, rows.verify_hidden, self.net, self.fwd
        assert cache is not None and hidden is not None and self.out_tail is not None
        b, w, dev = st.batch_size, hidden.shape[2], st.tokens.device
        first = st.prev_committed - 1  # [B] slot of the last verify's first row
        g = net.features(hidden.to(net.dtype))  # [B, W, H]
        cols = (first[:, None] + 1 + torch.arange(w, device=dev)).clamp(max=st.tokens.shape[1] - 1)  # fmt: skip
        nxt = st.tokens.gather(1, cols)  # [B, W]
        h_ctx = net.step(fwd, g.reshape(b * w, -1), nxt.reshape(-1), cache, self._layout(first, w, attn_len))  # fmt: skip
        row = st.committed_len - st.prev_committed - 1  # [B] row of slot C - 2; -1: a new prompt
        picked = h_ctx.view(b, w, -1)[torch.arange(b, device=dev), row.clamp(min=0)]  # [B, H]
        h = torch.where((row >= 0)[:, None], picked, self.out_tail)  # [B, H]
        for i in range(self.k):
            scores = net.draft_scores(fwd, h)  # [B, Vd]
            if out is not None:
                out[:, i].copy_(net.to_target(scores.topk(out.shape[2], dim=-1).indices))
            tok = net.to_target(scores.argmax(dim=-1))  # [B] target ids
            st.drafts[:, i].copy_(tok)
            if i + 1 < self.k:
                slot = st.committed_len - 1 + i  # [B]
                h = net.step(fwd, h, tok, cache, self._layout(slot, 1, attn_len))
        st.draft_lens.fill_(self.k)

    def observe(self, rows: DraftRows, committed: Sequence[tuple[int, int, list[int]]]) -> None:
        return None


def load_eagle3(target: Transformer, path: str | Path, k: int | None = None) -> Eagle3Drafter:
    """``--drafter eagle3``: a ``LlamaForCausalLMEagle3`` checkpoint."""
    return Eagle3Drafter.load(target, path, k)
