"""A smaller model with the target's tokenizer drafts greedily, k tokens per cycle, on the device.

Its KV cache mirrors each row's committed sequence at the same slots as the target's. Each cycle
re-feeds the row's last two committed tokens (positions C-2, C-1; rewriting an entry with the
same token at the same position changes nothing but rounding), so that whatever was accepted —
including a last draft it never fed — is in its cache, then drafts greedily: one forward of
width 2, then k - 1 forwards of width 1, all graph-safe (captured as one step). Under a wrapper
whose cycles commit more than k + 1 tokens (two-level: a cheap replacement and extension after
the drafts) it re-feeds that many more (``follow_commits``; slots clamped at 0). For static trees
it also gives the top-R tokens of every draft position (``draft_candidates``), taken along its
greedy chain.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from specpilot.drafters.base import DraftRows, Segment
from specpilot.errors import IncompatibleDrafterError
from specpilot.models.forward import Forward
from specpilot.models.kv_cache import KVCache
from specpilot.models.transformer import Transformer


def check_draft_model(model: Transformer, k: int, target_vocab_size: int | None) -> None:
    """The checks a draft-model drafter makes on construction."""
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    if target_vocab_size is not None and model.cfg.vocab_size != target_vocab_size:
        raise IncompatibleDrafterError(
            f"The drafter's vocabulary has {model.cfg.vocab_size} tokens but the target's has "
            f"{target_vocab_size}; a draft model must share the target's tokenizer."
        )


Feed = Callable[[int, Tensor, Tensor, int], None]
"""``feed(row, tokens [1, T], start [1], attn_len)``: a model's K/V of one row's tokens."""


def refeed_committed(
    rows: DraftRows, which: Sequence[int], since: Sequence[int], feed: Feed
) -> None:
    """Rows ``which`` committed by AR from ``since`` on: ``feed`` each one's committed tokens at
    slots ``since - 2 .. C - 3`` (a cache kept like the draft model's holds the slots below
    ``since - 2``, and every cycle re-feeds ``C - 2`` and ``C - 1`` itself)."""
    st = rows.state
    lens = rows.committed_lens()
    for row, s in zip(which, since, strict=True):
        lo, hi = max(s - 2, 0), lens[row] - 2
        if hi <= lo:
            continue
        tokens = st.tokens[row : row + 1, lo:hi]  # [1, T]
        start = torch.tensor([lo], dtype=torch.int64, device=st.tokens.device)
        feed(row, tokens, start, rows.bucket(hi))


class DraftModelDrafter:
    name = "draft-model"
    hidden_layers: tuple[int, ...] = ()
    graph_safe = True

    def __init__(
        self, model: Transformer, k: int = 5, target_vocab_size: int | None = None
    ) -> None:
        check_draft_model(model, k, target_vocab_size)
        self.model = model
        self.k = k
        self.fwd = Forward(model)
        self.cache: KVCache | None = None
        self.refeed = 2
        """Last committed tokens re-fed each cycle (slots C - refeed .. C - 1)."""

    def follow_commits(self, most: int) -> None:
        """A wrapper may commit up to ``most`` tokens per cycle (k + 1 without one: the drafts
        and the bonus). Every committed token after the last draft this drafter fed (``d_{k-1}``)
        must be re-fed: ``most - k + 1`` of them."""
        self.refeed = max(2, most - self.k + 1)

    def bind(self, rows: DraftRows) -> None:
        st = rows.state
        self.cache = self.model.allocate_cache(st.batch_size, st.capacity)

    def prefill(self, rows: DraftRows, seg: Segment) -> None:
        assert self.cache is not None
        cache = self.cache.slice(seg.first_row, seg.rows)
        self.fwd.dense(seg.tokens, cache, seg.start, seg.attn_len)

    def admitted(self, rows: DraftRows, which: Sequence[int]) -> None:
        return None

    def resync(self, rows: DraftRows, which: Sequence[int], since: Sequence[int]) -> None:
        """Rows that committed by AR from ``since`` on: feed the draft model the tokens it missed
        (its cache holds slots below ``since - 2``; a cycle feeds the last two itself), one
        eager forward per row (drafting resumes rarely)."""
        refeed_committed(
            rows, which, since, lambda row, t, s, n: self.prefill(rows, Segment(row, t, s, n))
        )

    def attn_len(self, rows: DraftRows, max_committed: int) -> int:
        return rows.bucket(max_committed + self.k)

    def propose(self, rows: DraftRows, attn_len: int) -> None:
        self._draft(rows, attn_len, None)

    def draft_candidates(self, rows: DraftRows, attn_len: int, out: Tensor) -> None:
        """The R likeliest tokens of each draft position (``out [B, k, R]``) along the greedy
        chain, which also goes to ``drafts``."""
        self._draft(rows, attn_len, out)

    def _draft(self, rows: DraftRows, attn_len: int, out: Tensor | None) -> None:
        st, cache, fwd = rows.state, self.cache, self.fwd
        assert cache is not None
        b, dev, r = st.batch_size, st.tokens.device, self.refeed
        start = (st.committed_len - r).clamp(min=0)  # [B]
        last = st.tokens.gather(1, start[:, None] + torch.arange(r, device=dev))  # [B, r]
        x = fwd.dense(last, cache, start, attn_len).view(b, r, -1)
        pend = (st.committed_len - 1 - start)[:, None, None].expand(b, 1, x.shape[2])
        x = x.gather(1, pend).squeeze(1)  # [B, H]: the pending token's row (r - 1 unless clamped)
        for i in range(self.k):
            logits = fwd.logits(x)  # [B, V]
            if out is not None:
                out[:, i].copy_(logits.topk(out.shape[2], dim=-1).indices)
            tok = logits.argmax(dim=-1)  # [B]
            st.drafts[:, i].copy_(tok)
            if i + 1 < self.k:
                x = fwd.dense(tok[:, None], cache, st.committed_len + i, attn_len)  # [B, H]
        st.draft_lens.fill_(self.k)

    def observe(self, rows: DraftRows, committed: Sequence[tuple[int, int, list[int]]]) -> None:
        return None
