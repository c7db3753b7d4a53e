"""The attention part of the layer body (``models/forward.py``, mixed into :class:`Forward`):
RoPE (+ q/k norm) and the K/V write at the layout's slots, then attention over the cache.

On the Triton path RoPE, the K/V write and the query placement are one fused kernel
(``kernels/decode_triton.py``), and a dense layout's attention may run the model's
``dense_attention`` kernel (plug point ``kernel_choice``, e.g. ``mechanisms/decode_attn.py``);
otherwise the torch references under the layout's mask (SDPA), the stock rounding order. On the
CPU a model's small ops (``Transformer.small_ops``) may run RoPE, the write and a batch-1 causal
block's attention in one call.
"""

from __future__ import annotations

import contextlib
from types import ModuleType
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from specpilot.kernels import reference
from specpilot.models.layer import DecoderLayer
from specpilot.models.layout import DenseLayout, Layout, PackedLayout

if TYPE_CHECKING:
    from specpilot.config import ModelConfig
    from specpilot.models.network import Network

SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""SDPA's backends on CUDA: not cuDNN, which builds an execution plan for every new shape; a
prefill has a new shape with every prompt length, about 80 ms of an 8B prefill's 100 on the
H200 (``bench/ttft_trace_gpu.py``). Graph capture runs the same backends as its eager warm-up
(a plan built inside a capture would break it)."""


class AttentionSteps:
    """Mixed into :class:`~specpilot.models.forward.Forward`, whose network, config and kernel
    module (``_k``: ``decode_triton`` on the Triton path, else None) these steps use."""

    if TYPE_CHECKING:
        cfg: ModelConfig
        model: Network
        _k: ModuleType | None

    def _rope(self, x: Tensor, cos: Tensor, sin: Tensor, norm_w: Tensor | None) -> Tensor:
        """Torch path: optional per-head RMSNorm, then rotate-half RoPE of ``x [M, H, D]``."""
        if norm_w is not None:
            x = reference.rms_norm_ref(x, norm_w, self.cfg.rms_norm_eps)
        ops = getattr(self.model, "small_ops", None)
        y = None if ops is None else ops.rope(x, cos, sin)
        if y is not None:
            return y
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return (x * cos + rotated * sin).to(x.dtype)

    def rope_write(
        self,
        layer: DecoderLayer,
        qkv: Tensor,  # [M, q + 2kv] (q_heads == 0: [M, 2kv])
        k_cache: Tensor,  # [B, H_kv, S, D]
        v_cache: Tensor,
        lay: Layout,
        q_heads: int,
    ) -> Tensor:
        """RoPE (+ q/k norm), K/V written at the layout's slots; q in the padded block
        ``[B, H_kv, G*W, D]`` (empty when ``q_heads == 0``)."""
        cfg, model = self.cfg, self.model
        d, hkv, m = cfg.head_dim, cfg.num_kv_heads, qkv.shape[0]
        if self._k is not None:
            args = (model.rope_cos, model.rope_sin, layer.q_norm, layer.k_norm, cfg.rms_norm_eps)
            if isinstance(lay, PackedLayout):
                return self._k.rope_qkv_write_packed(
                    qkv.contiguous(), q_heads, hkv, d, lay.batch, lay.width, lay.positions,
                    lay.place, *args, k_cache, v_cache,
                )[: lay.batch]  # fmt: skip
            return self._k.rope_qkv_write(
                qkv.contiguous(), q_heads, hkv, d, lay.batch, lay.positions, *args,
                k_cache, v_cache, lay.slots,
            )  # fmt: skip
        ops = getattr(model, "small_ops", None)
        start = lay.write_start if isinstance(lay, DenseLayout) else None  # one row, eager
        if ops is not None and start is not None and q_heads > 0 and layer.q_norm is None:
            cos, sin = lay.cos_sin(model.rope_cos, model.rope_sin)
            q = ops.rope_write(qkv, q_heads, cos, sin, k_cache, v_cache, start)
            if q is not None:
                return lay.place_q(q, hkv)
        q_cols = q_heads * d
        k = qkv[:, q_cols : q_cols + hkv * d].reshape(m, hkv, d)
        v = qkv[:, q_cols + hkv * d :].reshape(m, hkv, d)
        cos, sin = lay.cos_sin(model.rope_cos, model.rope_sin)
        lay.write_kv(self._rope(k, cos, sin, layer.k_norm), v, k_cache, v_cache)
        if q_heads == 0:
            return qkv.new_empty(lay.batch, hkv, 0, d)
        q = self._rope(qkv[:, :q_cols].reshape(m, q_heads, d), cos, sin, layer.q_norm)
        return lay.place_q(q, hkv)

    def rope_write_attend(
        self,
        layer: DecoderLayer,
        qkv: Tensor,  # [M, q + 2kv]
        k_cache: Tensor,  # [B, H_kv, S, D]
        v_cache: Tensor,
        lay: Layout,
    ) -> Tensor | None:  # [M, H*D], or None: rope_write and attend run
        """CPU small ops: RoPE, K/V write and causal attention of a batch-1 dense block with a
        host-known start (AR steps, the chain verify) in one call (``SmallOps.rope_write`` with
        ``attn_len``); None elsewhere (the Triton path, q/k norm, a non-causal or own mask)."""
        ops = getattr(self.model, "small_ops", None)
        if ops is None or self._k is not None or layer.q_norm is not None:
            return None
        if not isinstance(lay, DenseLayout) or lay.write_start is None or lay.batch != 1:
            return None
        if not lay.causal or lay.start is None:
            return None  # only build's causal block_mask (or none, one exact row) is the kernel's
        cos, sin = lay.cos_sin(self.model.rope_cos, self.model.rope_sin)
        return ops.rope_write(
            qkv, self.cfg.num_heads, cos, sin, k_cache, v_cache, lay.write_start, lay.attn_len
        )

    def attend(
        self,
        q: Tensor,  # [B, H_kv, G*W, D]
        k_cache: Tensor,  # [B, H_kv, S, D]
        v_cache: Tensor,
        lay: Layout,
    ) -> Tensor:  # [M, H*D] in forward-row order
        """Attention over the cache: the model's ``dense_attention`` kernel (plug point
        ``kernel_choice``) on the Triton path for a dense layout that carries its lengths;
        SDPA under the layout's mask and ``lay.gather`` otherwise (the stock path always, and
        any layout the kernel declines by returning None)."""
        fn = getattr(self.model, "dense_attention", None) if self._k is not None else None
        if fn is not None and isinstance(lay, DenseLayout) and lay.start is not None:
            out = fn(q, k_cache, v_cache, lay)
            if out is not None:
                return out
        k, v = k_cache[:, :, : lay.attn_len], v_cache[:, :, : lay.attn_len]
        with sdpa_kernel(SDPA_BACKENDS) if q.is_cuda else contextlib.nullcontext():
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=lay.mask)
        return lay.gather(attn)  # attn: [B, H_kv, G*W, D]
