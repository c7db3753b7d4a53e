"""The DFlash kind of ``train-drafter``: the network (``models/dflash.py``), its block loss
(``train/dflash_loss.py``) and its published format (``loading/dflash*.py``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from specpilot.drafters.base import Drafter
from specpilot.drafters.dflash import DFlashDrafter
from specpilot.models.dflash import DFlashNet, DFlashSpec, spec_for_target
from specpilot.models.forward import Forward
from specpilot.train.dflash_loss import dflash_loss, make_blocks, sample_anchors
from specpilot.train.recipe import SPEC_FILE, LossOut, copy_weights, make_trainable, run_spec

if TYPE_CHECKING:
    from specpilot.loading.tokenizer import TextTokenizer
    from specpilot.models.transformer import Transformer
    from specpilot.train.data import Sample
    from specpilot.train.settings import TrainSettings

MASK_NAMES = ("<|MASK|>", "<mask>", "[MASK]", "<|mask|>")


def mask_token(tokenizer: TextTokenizer, given: int | None) -> int:
    """The explicit id; else a mask token of the tokenizer's; else its first EOS (SpecForge's
    fallback order, for vocabularies without a free row such as SmolLM2's)."""
    if given is not None:
        return given
    vocab = tokenizer.vocab()
    for name in MASK_NAMES:
        if name in vocab:
            return int(vocab[name])
    eos = tokenizer.eos_token_ids
    return eos[0] if eos else 0


class DFlashRecipe:
    kind = "dflash"
    default_lr = 6e-4  # SpecForge's DFlash recipe
    max_grad_norm = 1.0

    def __init__(self) -> None:
        self.anchors = 64
        self.gamma = 7.0
        self._fwd: Forward | None = None

    def create(
        self, target: Transformer, tokenizer: TextTokenizer, settings: TrainSettings, out: Path
    ) -> nn.Module:
        from specpilot.loading.dflash import spec_from_config
        from specpilot.loading.dflash_save import config_from_spec

        s = settings
        self.anchors, self.gamma = s.anchors, s.gamma
        if s.init is not None:  # warm start: the given drafter's shape and weights
            from specpilot.loading.dflash import load_dflash
            from specpilot.train.checkpoint import write_text_atomic

            net = load_dflash(s.init, target, self.kind, dtype=torch.float32)
            write_text_atomic(out / SPEC_FILE, json.dumps(config_from_spec(net.spec), indent=2))
            net.requires_grad_(True)
        else:

            def new() -> DFlashSpec:
                mask = mask_token(tokenizer, s.mask_token_id)
                return spec_for_target(target.cfg, s.layers, s.block, mask, s.intermediate or 640)

            net = DFlashNet(run_spec(out, spec_from_config, new, config_from_spec), target, torch.float32)  # fmt: skip
            make_trainable(net, s.seed)
        self._fwd = Forward(net, layers=net.decoder_layers(), use_triton=False, fuse_residual=False)
        return net

    def fit(self, net: nn.Module, samples: Sequence[Sample], out: Path) -> str | None:
        return None  # the data decides nothing of a DFlash drafter

    def hidden_layers(self, net: nn.Module) -> tuple[int, ...]:
        assert isinstance(net, DFlashNet)
        return net.spec.target_layer_ids

    def loss(
        self,
        net: nn.Module,
        hidden: Tensor,
        tokens: Tensor,
        loss_mask: Tensor,
        gen: torch.Generator,
    ) -> LossOut:
        assert isinstance(net, DFlashNet) and self._fwd is not None
        spec = net.spec
        anchors, keep = sample_anchors(loss_mask, self.anchors, gen)
        blocks = make_blocks(tokens, loss_mask, anchors, keep, spec.block_size, spec.mask_token_id, self.gamma)  # fmt: skip
        return dflash_loss(net, self._fwd, hidden, blocks, torch.float32)

    def eval_drafter(self, target: Transformer, net: nn.Module) -> Drafter:
        assert isinstance(net, DFlashNet)
        copy = DFlashNet(net.spec, target)
        drafter = DFlashDrafter(copy)
        self.sync(drafter, net)
        return drafter

    def sync(self, drafter: Drafter, net: nn.Module) -> None:
        assert isinstance(drafter, DFlashDrafter)
        copy_weights(drafter.net, net)

    def save(self, net: nn.Module, out: Path) -> Path:
        from specpilot.loading.dflash_save import save_dflash

        assert isinstance(net, DFlashNet)
        return save_dflash(net, out)

    def load(self, target: Transformer, path: Path) -> Drafter:
        return DFlashDrafter.load(target, path, kind=self.kind)
