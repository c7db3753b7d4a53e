"""What a drafter kind brings to ``train-drafter``; everything else (data, target features,
schedule, checkpoints, held-out τ, the budget) is shared by ``train/loop.py``.

A kind is one module with one class implementing :class:`Recipe` and one entry in ``RECIPES``
(``train/dflash_recipe.py`` is the DFlash one; an EAGLE-3 recipe would bring its network, its
TTT loss and its writer the same way).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from specpilot.drafters.base import Drafter
    from specpilot.loading.tokenizer import TextTokenizer
    from specpilot.models.transformer import Transformer
    from specpilot.train.dflash_loss import LossOut
    from specpilot.train.loop import TrainSettings


class Recipe(Protocol):
    kind: str

    def create(
        self, target: Transformer, tokenizer: TextTokenizer, settings: TrainSettings, out: Path
    ) -> nn.Module:
        """The network to train, fp32, parameters trainable, freshly initialised; when ``out``
        holds the shape of an earlier run (resuming), that shape."""
        ...

    def hidden_layers(self, net: nn.Module) -> tuple[int, ...]:
        """Target layers whose outputs the loss reads (in this order)."""
        ...

    def loss(
        self,
        net: nn.Module,
        hidden: Tensor,  # [n_layers, b, S, H] target states of ``hidden_layers``
        tokens: Tensor,  # [b, S] int64
        loss_mask: Tensor,  # [b, S] bool: response tokens
        gen: torch.Generator,
    ) -> LossOut:
        """One batch's loss (under the caller's autocast)."""
        ...

    def eval_drafter(self, target: Transformer, net: nn.Module) -> Drafter:
        """A drafter in the target's dtype over a copy of ``net``'s weights, for the engine."""
        ...

    def sync(self, drafter: Drafter, net: nn.Module) -> None:
        """Copy ``net``'s current weights into ``eval_drafter``'s (in place: graphs stay valid)."""
        ...

    def save(self, net: nn.Module, out: Path) -> Path:
        """Write the trained drafter in its loadable format."""
        ...

    def load(self, target: Transformer, path: Path) -> Drafter:
        """Load what ``save`` wrote, as the commands do (``--drafter KIND --draft-model DIR``)."""
        ...


def recipes() -> dict[str, Recipe]:
    """Kind name → recipe (imported on demand)."""
    from specpilot.train.dflash_recipe import DFlashRecipe

    return {"dflash": DFlashRecipe()}


KIND_NAMES = ("dflash",)
"""The kinds ``recipes()`` returns, for argument parsers."""
