"""One decoder layer's weights and its plug points: what a mechanism may set on a layer.

:class:`DecoderLayer` holds the weights of one pre-norm attention + SwiGLU MLP layer (the body
that runs them is ``models/forward.py``) and the per-layer plug points ``linear_fns``,
``phase_hooks`` (called before each of ``PHASE_POINTS``) and ``fused_steps`` (a
:class:`FusedSteps`). It imports nothing of the forward or the network, so both read it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor, nn

from specpilot.config import ModelConfig
from specpilot.models.block_conv import BlockConv


class FusedSteps(Protocol):
    """A layer's fused GEMVs (plug point ``kernel_choice``): each computes what the named
    unfused steps compute, rounded the same way up to fp32 summation order."""

    def takes(self, name: str, rows: int) -> bool:
        """Whether a fused kernel serves matrix ``name`` for ``rows`` rows; False for a matrix
        that ``linear_fns`` serves from another storage unless the fused kernel reads that."""
        ...

    def norm_linear(
        self, name: str, x: Tensor, norm_weight: Tensor, bias: Tensor | None
    ) -> Tensor:  # [M, K] -> [M, N]: RMSNorm(x) @ W.T (+ bias)
        ...

    def linear_residual(self, name: str, x: Tensor, a: Tensor) -> Tensor:
        """``x [M, N] + a [M, K] @ W.T``, one rounding."""
        ...

    def silu_linear_residual(self, name: str, x: Tensor, gate_up: Tensor) -> Tensor:
        """``x [M, N] + silu_mul(gate_up [M, 2I]) @ W.T``, one rounding."""
        ...


PHASE_POINTS = (
    "input_norm",
    "w_qkv",
    "attention",
    "w_o",
    "post_attn_norm",
    "w_gate_up",
    "silu_mul",
    "w_down",
)
"""The steps of the layer body, in order, before each of which a ``DecoderLayer.phase_hooks``
entry of that name is called: the small phases (the norms, RoPE + K/V write + attention,
SiLU·mul) and the four matrices."""


class DecoderLayer(nn.Module):
    """Weights of one pre-norm attention + SwiGLU MLP layer (the body is ``models/forward.py``).
    q/k/v and gate/up are fused into one matrix each at load time."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        h, qkv = cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size

        def p(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)

        self.cfg = cfg
        self.gemv: dict[str, Tensor] = {}  # name -> [in, out] copy for one-row products (CPU)
        # Plug point "linear_weights": name -> fn(x [.., in], bias) computing F.linear(x, w, bias)
        # from another storage of bit-identical weights (e.g. mechanisms/w12.py).
        self.linear_fns: dict[str, Callable[[Tensor, Tensor | None], Tensor]] = {}
        # Plug point "layer_phases": point -> fn() called just before that step of the layer body
        # (``models/forward.PHASE_POINTS``). A hook must not change any value the forward reads
        # (e.g. mechanisms/l2_prefetch.py issues L2 prefetches of the next matrix).
        self.phase_hooks: dict[str, Callable[[], None]] = {}
        # Plug point "kernel_choice": GEMVs with the norm / SiLU·mul / residual add fused in,
        # for few rows on the Triton path (e.g. mechanisms/fused_gemv.py); None: unfused.
        self.fused_steps: FusedSteps | None = None
        self.input_norm = p(h)
        self.post_attn_norm = p(h)
        self.w_qkv = p(qkv, h)
        self.b_qkv = p(qkv) if cfg.attention_bias else None
        self.q_norm = p(cfg.head_dim) if cfg.qk_norm else None
        self.k_norm = p(cfg.head_dim) if cfg.qk_norm else None
        self.w_o = p(h, cfg.q_size)
        self.w_gate_up = p(2 * cfg.intermediate_size, h)
        self.w_down = p(h, cfg.intermediate_size)
        # DFlash2 drafters mix the rows of each draft block around attention and the MLP
        # (``models/block_conv.py``); None everywhere else.
        self.attention_conv: BlockConv | None = None
        self.mlp_conv: BlockConv | None = None
