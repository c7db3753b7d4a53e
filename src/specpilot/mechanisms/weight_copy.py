"""A cheap copy of a target: the target's own tensors, with quantized linear layers and LM head.

Two-level verification (INT8, ``int8_copy``) and the FP8 pre-filter (``fp8_copy``) both run a
model that shares every tensor of the target (embeddings, norms, RoPE tables: nothing copied) and
reads quantized copies of its decoder matrices through ``DecoderLayer.linear_fns`` and of its LM
head through ``Transformer.argmax_head``. This module builds that model for any copy format.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

from torch import Tensor

from specpilot.models.transformer import DecoderLayer, Transformer

LINEAR_NAMES = ("w_qkv", "w_o", "w_gate_up", "w_down")


class CopiedLinear(Protocol):
    """``fn(x [.., K], bias [N] | None) -> [.., N]`` over a quantized copy of one matrix."""

    def __call__(self, x: Tensor, bias: Tensor | None = None) -> Tensor: ...

    def copy_nbytes(self) -> int:
        """Bytes of the quantized copy (codes and scales)."""
        ...


def shared_model(target: Transformer) -> Transformer:
    """A :class:`Transformer` holding ``target``'s own tensors (nothing copied), for a cheap copy
    to replace its linear layers (``DecoderLayer.linear_fns``) and greedy head."""
    cheap = Transformer(target.cfg, dtype=target.dtype, device="meta", max_positions=1)
    for name, param in target.named_parameters(recurse=False):
        setattr(cheap, name, param)
    if target.cfg.tie_word_embeddings:
        cheap.lm_head = cheap.embed
    cheap.rope_cos, cheap.rope_sin = target.rope_cos, target.rope_sin
    for src, dst in zip(target.layers, cheap.layers, strict=True):
        assert isinstance(src, DecoderLayer) and isinstance(dst, DecoderLayer)
        for name, param in src.named_parameters(recurse=False):
            setattr(dst, name, param)
    return cheap


def copy_model(
    target: Transformer,
    linear: Callable[[Tensor], CopiedLinear],
    head: Callable[[Tensor], Callable[[Tensor], Tensor]] | None,
) -> Transformer:
    """``target``'s tensors, each decoder matrix read through ``linear(weight)`` and, when
    ``head`` is given, the greedy LM head through ``head(lm_head)``."""
    cheap = shared_model(target)
    for src, dst in zip(target.layers, cheap.layers, strict=True):
        assert isinstance(src, DecoderLayer) and isinstance(dst, DecoderLayer)
        for name in LINEAR_NAMES:
            dst.linear_fns[name] = linear(getattr(src, name))
    if head is not None:
        cheap.argmax_head = head(target.lm_head)
    return cheap


Copy = TypeVar("Copy", bound=CopiedLinear)


def copy_nbytes(model: Transformer, kind: type[Copy]) -> int:
    """Bytes of the copies of type ``kind`` installed in ``model`` (linear layers and the LM
    head, whose copy is its ``linear`` attribute)."""
    total = 0
    for layer in model.layers:
        assert isinstance(layer, DecoderLayer)
        total += sum(fn.copy_nbytes() for fn in layer.linear_fns.values() if isinstance(fn, kind))
    head_linear = getattr(model.argmax_head, "linear", None)
    if isinstance(head_linear, kind):
        total += head_linear.copy_nbytes()
    return total


__all__ = ["LINEAR_NAMES", "CopiedLinear", "copy_model", "copy_nbytes", "shared_model"]
