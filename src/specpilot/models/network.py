"""What the layer body (``models/forward.py``) reads of a network: the :class:`Network` protocol
that the target (``models/transformer.py``) and the drafter networks built on its embedding and
LM head (``models/drafter_net.py``) follow."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol, TypeVar

import torch
from torch import Tensor

if TYPE_CHECKING:
    from specpilot.config import ModelConfig


class Network(Protocol):
    """What the layer body reads of a network: a :class:`Transformer`, or a drafter network
    built on the target's embedding and LM head (``models/dflash.py``)."""

    @property
    def cfg(self) -> ModelConfig: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def layers(self) -> Iterable[torch.nn.Module]: ...
    @property
    def embed(self) -> Tensor: ...  # [vocab, hidden]
    @property
    def final_norm(self) -> Tensor: ...  # [hidden]
    @property
    def lm_head(self) -> Tensor: ...  # [vocab, hidden]
    @property
    def lm_head_in_out(self) -> Tensor | None: ...  # [hidden, vocab] copy, or None
    @property
    def argmax_head(self) -> Callable[[Tensor], Tensor] | None: ...
    @property
    def rope_cos(self) -> Tensor: ...  # [P, head_dim] float32
    @property
    def rope_sin(self) -> Tensor: ...


NetT = TypeVar("NetT", bound=Network)
