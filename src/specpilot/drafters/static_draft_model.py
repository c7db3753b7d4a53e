"""A smaller model with the target's tokenizer, drafting k tokens per cycle inside the static engine.

Its KV cache mirrors the committed sequence. Each cycle re-feeds the last two committed tokens
(positions C-2, C-1; rewriting an entry with the same token at the same position is harmless)
so that whatever was accepted — including a last draft it never fed — is in its cache, then
drafts greedily: one forward of width 2, then k - 1 forwards of width 1, all in one graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from specpilot.drafters.draft_model import check_draft_model
from specpilot.models.kv_cache import KVCache
from specpilot.models.static_forward import StaticForward
from specpilot.models.transformer import Transformer

if TYPE_CHECKING:
    from specpilot.engine.static_engine import StaticEngine


class StaticDraftModel:
    name = "draft-model"
    hidden_layers: tuple[int, ...] = ()

    def __init__(
        self, model: Transformer, k: int = 5, target_vocab_size: int | None = None
    ) -> None:
        check_draft_model(model, k, target_vocab_size)
        self.model = model
        self.k = k
        self.fwd = StaticForward(model)
        self.cache: KVCache | None = None

    def bind(self, engine: StaticEngine) -> None:
        assert engine.cache is not None
        self.cache = self.model.allocate_cache(engine.cache.batch_size, engine.cache.max_seq_len)

    def prefill(
        self, engine: StaticEngine, prompts: Tensor, prompt_lens: Tensor, hidden: Tensor | None
    ) -> None:
        assert self.cache is not None
        start = torch.zeros_like(prompt_lens)
        self.fwd(prompts, self.cache, start, engine.bucket(prompts.shape[1]))

    def prefill_row(
        self, engine: StaticEngine, row: int, prompt: Tensor, hidden: Tensor | None
    ) -> None:
        assert self.cache is not None
        start = torch.zeros(1, dtype=torch.int64, device=prompt.device)
        self.fwd(prompt, self.cache.row(row), start, engine.bucket(prompt.shape[1]))

    def rows_filled(self, engine: StaticEngine, rows: Sequence[int]) -> None:
        return None

    def attn_len(self, engine: StaticEngine, max_committed: int) -> int:
        return engine.bucket(max_committed + self.k)

    def draft(self, engine: StaticEngine, attn_len: int) -> None:
        st, cache = engine.state, self.cache
        assert st is not None and cache is not None
        dev = st.tokens.device
        start = st.committed_len - 2  # [B]
        last_two = st.tokens.gather(1, start[:, None] + torch.arange(2, device=dev))  # [B, 2]
        logits = self.fwd(last_two, cache, start, attn_len)  # [B, 2, V]
        tok = logits[:, 1].argmax(dim=-1)  # [B]
        st.drafts[:, 0].copy_(tok)
        for i in range(1, self.k):
            logits = self.fwd(tok[:, None], cache, start + 1 + i, attn_len)  # [B, 1, V]
            tok = logits[:, 0].argmax(dim=-1)
            st.drafts[:, i].copy_(tok)
        st.draft_lens.fill_(self.k)

    def after_cycle(
        self, engine: StaticEngine, committed: Sequence[tuple[int, int, list[int]]]
    ) -> None:
        return None
