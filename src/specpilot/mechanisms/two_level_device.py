"""Two-level verification on the device: the cheap model corrects a graph-safe drafter's block
inside the same captured draft step, so a whole cycle stays CUDA-graph replays.

The host variant (``two_level.TwoLevelDrafter``) reads drafts back and scores them through
``CheapScorer``, which tracks fed tokens on the host; this one wraps drafters whose ``propose``
is device work (block drafter / DFlash, draft model, EAGLE-3, ``SimulatedAcceptance`` around any
of them) and keeps everything on the device, with fixed shapes and no host sync.

**The cheap cache.** The cheap model (``int8_copy.cheap_model``) keeps its own KV cache at the
target's slots, like ``DraftModelDrafter``. Invariant at the start of a draft step, for a row of
committed length ``C``: slots ``< C - 2`` hold the cheap K/V of the committed tokens. The step
feeds ``[token at C-2, pending (C-1), d_1..d_k]`` (fixed width ``k + 2``) at slots ``C - 2 ..``,
so ``d_i`` lands at slot ``C + i - 1``. Why re-feed ``C - 2``: the verify commits a prefix of
the block ``d_1..d_n, c_n`` plus a bonus; every committed ``d_i`` was fed at its own slot after
the committed prefix, but when ``c_n`` is accepted its slot ``C + n`` holds ``d_{n+1}`` in the
cheap cache, and that slot is exactly the new ``C' - 2`` (``C' = C + n + 2``). With the
extension (``correct-extend``) the last appended token is never fed either, and again sits at
``C' - 2`` when everything is accepted. So the invariant holds after every cycle whatever the
verify accepted. Prefill writes the prompt's cheap K/V (``prefill``), rows that committed by AR
while the gate had drafting off are re-fed (``resync``), and a row that takes a new sequence is
prefilled from slot 0; idle rows (``committed_len = IDLE_LEN``) and rows in prefill only get
scratch or same-value writes at or past their ``C - 2``.

**The correction.** With ``c_i`` the cheap greedy token after ``d_1..d_i`` (forward rows
``1..k+1``): ``n`` = the agreed prefix (``d_i == c_{i-1}`` for ``i = 1..n``, ``n <= draft_lens``),
the block becomes ``d_1..d_n, c_n`` and ``draft_lens = n + 1``. A width policy's ``cut`` needs no
care here: the accept takes ``min(draft_lens, cut)`` of a block whose first ``n`` tokens are the
inner drafter's, so a cut below ``n + 1`` sees exactly what a cut of the inner block would.
``correct-extend``: ``e`` one-token cheap forwards then feed ``c_n, x_1, ..`` at each row's own
slot ``C + n + j`` and append their greedy tokens ``x_1..x_e`` (``draft_lens = n + 1 + e``).

Lossless: the block is only a proposal; the unchanged exact verify commits the target's argmax.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from specpilot.drafters.base import Drafter, DraftRows, Segment
from specpilot.drafters.draft_model import refeed_committed
from specpilot.drafters.wrapped import WrappedDrafter
from specpilot.models.forward import Forward
from specpilot.models.kv_cache import KVCache
from specpilot.models.transformer import Transformer

COUNTS = ("rows", "drafted", "kept", "replaced", "forwards")
"""Device counters (``DeviceTwoLevelDrafter.counts``), summed over row-cycles of active rows:
row-cycles, inner drafted tokens, drafted tokens the cheap model agreed with, row-cycles where it
replaced a drafted token; ``forwards`` counts cheap forwards over the batch (every cycle). On CUDA
graphs they also count the runner's warm-up call of each captured key (one cycle per key)."""


def two_level_k(inner: Drafter, max_extension: int) -> int:
    """Drafts per cycle of a two-level wrapper: the inner drafter's, the cheap token and the
    extension."""
    if max_extension < 0:
        raise ValueError(f"max_extension must be at least 0, got {max_extension}")
    return inner.k + 1 + max_extension


def corrected_block(
    drafts: Tensor,  # [B, k] int64: the inner drafter's d_1..d_k
    lens: Tensor,  # [B] int64: valid drafts per row
    greedy: Tensor,  # [B, k+1] int64: c_0..c_k, the cheap greedy token after d_1..d_i
) -> tuple[Tensor, Tensor]:
    """``(block [B, k+1], n [B])``: the agreed prefix ``d_1..d_n`` then ``c_n``; columns past
    ``n`` hold cheap tokens (past ``draft_lens = n + 1`` they are never verified)."""
    k = drafts.shape[1]
    pos = torch.arange(k, device=drafts.device)[None, :]  # [1, k]
    agree = (drafts == greedy[:, :k]) & (pos < lens[:, None])  # [B, k]
    n = agree.long().cumprod(dim=1).sum(dim=1)  # [B]
    padded = torch.cat([drafts, drafts[:, :1]], dim=1)  # [B, k+1]: column k is never kept
    cols = torch.arange(k + 1, device=drafts.device)[None, :]
    return torch.where(cols < n[:, None], padded, greedy), n


class DeviceTwoLevelDrafter(WrappedDrafter):
    """Wraps a graph-safe :class:`Drafter`; see the module docstring."""

    graph_safe = True

    def __init__(self, inner: Drafter, cheap: Transformer, max_extension: int = 0) -> None:
        if not inner.graph_safe:
            raise ValueError(
                f"The device two-level variant needs a graph-safe drafter; '{inner.name}' drafts "
                "on the host (use two_level.TwoLevelDrafter)."
            )
        super().__init__(inner, f"{inner.name}+two-level", two_level_k(inner, max_extension))
        self.cheap = cheap
        self.fwd = Forward(cheap)
        self.max_extension = max_extension
        self.cache: KVCache | None = None
        self.counts: Tensor | None = None  # [len(COUNTS)] int64 on the device

    # ------------------------------------------------------------------ protocol
    def bind(self, rows: DraftRows) -> None:
        super().bind(rows)
        st = rows.state
        self.cache = self.cheap.allocate_cache(st.batch_size, st.capacity)
        self.counts = torch.zeros(len(COUNTS), dtype=torch.int64, device=st.tokens.device)

    def prefill(self, rows: DraftRows, seg: Segment) -> None:
        super().prefill(rows, seg)
        self._feed(seg.first_row, seg.tokens, seg.start, seg.attn_len)

    def _feed(self, first_row: int, tokens: Tensor, start: Tensor, attn_len: int) -> None:
        """Cheap K/V of ``tokens [b, T]`` at slots ``start + t`` of rows ``first_row..``."""
        assert self.cache is not None
        self.fwd.dense(tokens, self.cache.slice(first_row, tokens.shape[0]), start, attn_len)

    def resync(self, rows: DraftRows, which: Sequence[int], since: Sequence[int]) -> None:
        """The inner drafter catches up, and so does the cheap cache (slots below ``C - 2``)."""
        super().resync(rows, which, since)
        refeed_committed(rows, which, since, self._feed)

    def attn_len(self, rows: DraftRows, max_committed: int) -> int:
        # the cheap forwards write up to slot C + k - 1
        return max(super().attn_len(rows, max_committed), rows.bucket(max_committed + self.k))

    # ------------------------------------------------------------------ the step
    def propose(self, rows: DraftRows, attn_len: int) -> None:
        self.inner.propose(rows, attn_len)
        st, cache, fwd, k_in = rows.state, self.cache, self.fwd, self.inner.k
        assert cache is not None and self.counts is not None
        b, dev = st.batch_size, st.tokens.device
        start = st.committed_len - 2  # [B]
        before = st.tokens.gather(1, start[:, None])  # [B, 1] the token at C - 2
        drafts = st.drafts[:, :k_in]  # [B, k_in]
        feed = torch.cat([before, st.pending[:, None], drafts], dim=1)  # [B, k_in + 2]
        x = fwd.dense(feed, cache, start, attn_len).view(b, k_in + 2, -1)[:, 1:]
        greedy = fwd.argmax(x.reshape(b * (k_in + 1), -1)).view(b, k_in + 1)  # [B, k_in+1]
        lens = st.draft_lens.clamp(max=k_in)
        block, n = corrected_block(drafts, lens, greedy)  # [B, k_in+1], [B]
        if self.max_extension:
            block = self._extend(rows, block, n, attn_len)  # [B, k]
        st.drafts[:, : self.k].copy_(block)
        st.draft_lens.copy_(n + 1 + self.max_extension)
        on = st.active
        self.counts.add_(
            torch.stack(
                [
                    on.sum(),
                    (lens * on).sum(),
                    (n * on).sum(),
                    ((n < lens).long() * on).sum(),
                    torch.ones((), dtype=torch.int64, device=dev) * (1 + self.max_extension),
                ]
            )
        )

    def _extend(self, rows: DraftRows, block: Tensor, n: Tensor, attn_len: int) -> Tensor:
        """Append ``max_extension`` cheap greedy tokens after ``block[:, n]``, one one-token
        forward each, fed at each row's own slot ``C + n + j``; returns ``[B, k]``."""
        st, cache, fwd = rows.state, self.cache, self.fwd
        assert cache is not None
        e = self.max_extension
        out = torch.cat([block, block.new_zeros(block.shape[0], e)], dim=1)  # [B, k]
        for j in range(e):
            col = (n + j)[:, None]  # [B, 1]: the token to feed
            tok = out.gather(1, col)  # [B, 1]
            x = fwd.dense(tok, cache, st.committed_len + n + j, attn_len)  # [B, H]
            out.scatter_(1, col + 1, fwd.argmax(x)[:, None])
        return out

    def stats(self) -> dict[str, float]:
        """The device counters read back (one host copy; call it between runs, not per cycle)."""
        vals = [0] * len(COUNTS) if self.counts is None else self.counts.tolist()
        out: dict[str, float] = dict(zip(COUNTS, map(float, vals), strict=True))
        out["kept_frac"] = out["kept"] / max(out["drafted"], 1.0)
        return out


__all__ = ["COUNTS", "DeviceTwoLevelDrafter", "corrected_block", "two_level_k"]
