"""An early-exit draft model: the target's own first layers, final norm and LM head.

It shares the target's weights (no copy, no training) and its tokenizer, so it is the
same-tokenizer draft model that is always on hand. It only proposes tokens: the target verifies
every one, so it changes speed, never output.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from specpilot.models.transformer import Transformer


def early_exit_model(target: Transformer, layers: int) -> Transformer:
    """A :class:`Transformer` running the target's first ``layers`` layers + final norm + head."""
    n = target.cfg.num_layers
    if not 1 <= layers < n:
        raise ValueError(f"An early-exit drafter needs 1 to {n - 1} layers, got {layers}")
    cfg = replace(target.cfg, num_layers=layers)
    draft = Transformer(
        cfg, dtype=target.dtype, device=target.device, max_positions=target.max_positions
    )
    draft.embed = target.embed
    draft.lm_head = target.lm_head
    draft.final_norm = target.final_norm
    draft.layers = torch.nn.ModuleList(list(target.layers)[:layers])
    draft.lm_head_in_out = target.lm_head_in_out
    return draft
