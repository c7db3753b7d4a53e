"""A cheap copy of a target: the target's own tensors, with quantized linear layers and LM head.

Two-level verification (INT8, ``int8_copy``) and the FP8 pre-filter (``fp8_copy``) both run a
model that shares every tensor of the target (embeddings, norms, RoPE tables: nothing copied) and
reads quantized copies of its decoder matrices through ``DecoderLayer.linear_fns`` and of its LM
head through ``Transformer.argmax_head``. This module builds that model for any copy format.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch
from torch import Tensor

from specpilot.errors import SpecPilotError
from specpilot.models.layer import DecoderLayer
from specpilot.models.transformer import Transformer

LINEAR_NAMES = ("w_qkv", "w_o", "w_gate_up", "w_down")


@dataclass(frozen=True, slots=True)
class QuantWeight:
    """A per-output-channel quantized ``[N, K]`` matrix: ``w ≈ q * scale[:, None]``."""

    q: Tensor  # [N, K] 1-byte codes (int8, or float8_e4m3fn)
    scale: Tensor  # [N] fp32, > 0

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.q.shape[0]), int(self.q.shape[1]))

    def nbytes(self) -> int:
        return self.q.numel() + 4 * self.scale.numel()


def channel_scales(w: Tensor, qmax: float, fmt: str) -> tuple[Tensor, Tensor]:
    """``(w [N, K] fp32, scale [N])`` with ``scale = max|w[n]| / qmax`` (1 for an all-zero row),
    after refusing what cannot be quantized (not 2-D floating point, NaN or Inf)."""
    if w.dim() != 2 or not w.is_floating_point():
        raise SpecPilotError(f"{fmt} quantization takes a 2-D floating-point weight matrix.")
    wf = w.detach().float()
    if not bool(torch.isfinite(wf).all()):
        raise SpecPilotError(f"The weight has NaN or Inf entries; it cannot be quantized to {fmt}.")
    amax = wf.abs().amax(dim=1)  # [N]
    return wf, torch.where(amax > 0, amax / qmax, torch.ones_like(amax))


def dequantize(w: QuantWeight, dtype: torch.dtype = torch.float32) -> Tensor:  # [N, K]
    return (w.q.float() * w.scale[:, None]).to(dtype)


class CopiedLinear(Protocol):
    """``fn(x [.., K], bias [N] | None) -> [.., N]`` over a quantized copy of one matrix."""

    def __call__(self, x: Tensor, bias: Tensor | None = None) -> Tensor: ...

    def copy_nbytes(self) -> int:
        """Bytes of the quantized copy (codes and scales)."""
        ...


class CopiedArgmaxHead:
    """``x [B, R, hidden] -> [B, R]`` greedy tokens of the LM head read through its quantized
    copy ``linear`` (lowest id on ties)."""

    def __init__(self, linear: CopiedLinear) -> None:
        self.linear = linear

    def __call__(self, x: Tensor) -> Tensor:
        return self.linear(x).argmax(dim=-1)


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


__all__ = [
    "LINEAR_NAMES",
    "CopiedArgmaxHead",
    "CopiedLinear",
    "QuantWeight",
    "channel_scales",
    "copy_model",
    "copy_nbytes",
    "dequantize",
    "shared_model",
]
