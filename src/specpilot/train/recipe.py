"""What a drafter kind brings to ``train-drafter``; everything else (data, target features,
schedule, checkpoints, held-out τ, the budget) is shared by ``train/loop.py``.

A kind is one module with one class implementing :class:`Recipe`, one entry in
``train/kinds.recipes()`` and one name in ``train/settings.KIND_NAMES``:
``train/dflash_recipe.py`` (DFlash, DFlash's block loss) and ``train/eagle3_recipe.py``
(EAGLE-3: its draft vocabulary and its TTT loss). Recipes import this module; it imports none.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from specpilot.drafters.base import Drafter
    from specpilot.loading.tokenizer import TextTokenizer
    from specpilot.models.transformer import Transformer
    from specpilot.train.data import Sample
    from specpilot.train.settings import TrainSettings


@dataclass(slots=True)
class LossOut:
    """One batch's loss and what the progress line shows of it."""

    loss: Tensor  # [] weighted mean CE
    accuracy: list[float]
    """Top-1 of the trained rows per predicted position (DFlash: block row j >= 1; EAGLE-3: TTT
    step k); the first is the progress line's acc@1."""
    tokens: int  # trained rows


class Recipe(Protocol):
    kind: str
    default_lr: float
    """Peak AdamW learning rate when ``--lr`` is not given (the kind's published recipe)."""
    max_grad_norm: float
    """Gradient clipping norm (the kind's published recipe)."""

    def create(
        self, target: Transformer, tokenizer: TextTokenizer, settings: TrainSettings, out: Path
    ) -> nn.Module:
        """The network to train, fp32, parameters trainable, freshly initialised; when ``out``
        holds the shape of an earlier run (resuming), that shape."""
        ...

    def fit(self, net: nn.Module, samples: Sequence[Sample], out: Path) -> str | None:
        """Set what the training data decides before the first step (EAGLE-3: the draft
        vocabulary), keeping it in ``out`` so that a resumed run keeps it too; a line for the
        log, or None (most kinds have nothing to fit)."""
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


SpecT = TypeVar("SpecT")
SPEC_FILE = "spec.json"
"""In ``--out``: the drafter's config, written when a run starts, read when it resumes."""


def run_spec(
    out: Path,
    read: Callable[[dict[str, Any], str], SpecT],
    new: Callable[[], SpecT],
    config: Callable[[SpecT], dict[str, Any]],
) -> SpecT:
    """The drafter's shape: the one ``out/spec.json`` holds when resuming (``read`` from its
    config and path), else ``new()``, whose ``config`` is written there."""
    from specpilot.train.checkpoint import write_text_atomic

    path = out / SPEC_FILE
    if path.is_file():
        return read(json.loads(path.read_text()), str(path))
    spec = new()
    write_text_atomic(path, json.dumps(config(spec), indent=2))
    return spec


class Initialisable(Protocol):
    def init_random(self, seed: int, std: float = ..., norm_std: float = ...) -> None: ...
    def parameters(self) -> Any: ...


def make_trainable(net: Initialisable, seed: int) -> None:
    """Fresh weights as HF initialises them (N(0, 0.02) matrices, norms at 1), trainable."""
    net.init_random(seed, std=0.02, norm_std=0.0)
    for p in net.parameters():
        p.requires_grad_(True)


def copy_weights(dst: nn.Module, src: nn.Module) -> None:
    """``src``'s parameters into ``dst``'s, in place (an eval drafter's graphs stay valid)."""
    with torch.no_grad():
        for d, s in zip(dst.parameters(), src.parameters(), strict=True):
            d.copy_(s)
