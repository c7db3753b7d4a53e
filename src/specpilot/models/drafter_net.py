"""What the learned drafters' networks (``models/dflash.py``, ``models/eagle3.py``) share: their
layers' config derived from the target's, the target they read tensors of, held outside the
module tree, the RoPE tables at the target's length, and the members of ``network.Network``
that come from those."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import Tensor, nn

from specpilot.config import ModelConfig
from specpilot.models.rope import rope_tables
from specpilot.models.transformer import Transformer


def drafter_layers(
    target: ModelConfig, arch: str, qk_norm: bool, num_layers: int, intermediate_size: int | None
) -> ModelConfig:
    """A learned drafter's decoder layers at ``target``'s width, heads and RoPE: ``arch``'s layer
    body, no attention bias, an untied head, ``intermediate_size`` wide (None: the target's)."""
    return dataclasses.replace(
        target,
        arch=arch,
        qk_norm=qk_norm,
        attention_bias=False,
        tie_word_embeddings=False,
        num_layers=num_layers,
        intermediate_size=intermediate_size or target.intermediate_size,
    )


class DrafterNet(nn.Module):
    """A drafter's own weights (``fc`` and the rest, set by the subclass) over ``target``, whose
    embedding it reads; the target sits in a tuple, not a submodule, so it is never saved,
    moved or trained with the drafter."""

    fc: nn.Parameter
    """The projection of the target's features, which every learned drafter has."""

    def __init__(self, cfg: ModelConfig, target: Transformer, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype or target.dtype
        self._target = (target,)
        cos, sin = rope_tables(cfg, target.max_positions, target.device)
        self.rope_cos: Tensor = cos  # [P, D] float32
        self.rope_sin: Tensor = sin
        self.argmax_head: Callable[[Tensor], Tensor] | None = None

    # --------------------------------------------------------------- what Forward reads
    @property
    def device(self) -> torch.device:
        return self.fc.device

    @property
    def target(self) -> Transformer:
        return self._target[0]

    @property
    def embed(self) -> Tensor:  # [V, H] the target's
        return self.target.embed


__all__ = ["DrafterNet", "drafter_layers"]
