"""A graph-friendly forward of :class:`Transformer`: no host sync, fixed shapes per call site.

Differences from ``Transformer.forward`` (same weights, same math up to kernel rounding):

* the committed KV length of each row, ``start [B]``, is a **device** tensor; positions, cache
  slots and the attention mask are computed from it on the device;
* attention reads a fixed ``attn_len`` keys (a bucket ≥ every row's ``start + T``), with an
  additive mask that hides stale and future slots, so one captured CUDA graph serves every
  length inside its bucket;
* K/V are written by slot index (``start + t``), never by a host-side slice;
* on CUDA the small ops run as fused Triton kernels (``specpilot.kernels``), residual adds ride on
  the GEMM (``addmm``), and the GQA group is folded into the query rows so that SDPA runs one
  multi-head kernel over the ``H_kv`` cached heads.

Everything here also runs on the CPU (torch references instead of Triton), which is how the tests
check it against the stock path.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor

from specpilot.config import ModelConfig
from specpilot.kernels import reference, triton_usable
from specpilot.models.kv_cache import KVCache
from specpilot.models.transformer import DecoderLayer, Transformer


def attention_mask(
    start: Tensor,  # [B] int64: committed KV entries per row (first new token's slot)
    t: int,
    attn_len: int,
    groups: int,
    dtype: torch.dtype,
    causal: bool = True,
) -> Tensor:
    """Additive mask ``[B, 1, G*T, attn_len]`` (row ``g*T + t``): 0 where visible, -inf elsewhere.

    Causal: query t sees slots ``< start + t + 1``. Block (``causal=False``): every query of the
    block sees the committed prefix and the whole block, ``< start + T``.
    """
    dev = start.device
    keys = torch.arange(attn_len, device=dev)  # [S]
    if causal:
        limit = start[:, None] + torch.arange(1, t + 1, device=dev)  # [B, T]
    else:
        limit = (start + t)[:, None].expand(-1, t)  # [B, T]
    visible = keys[None, None, :] < limit[:, :, None]  # [B, T, S]
    zero = torch.zeros((), dtype=dtype, device=dev)
    ninf = torch.full((), float("-inf"), dtype=dtype, device=dev)
    mask = torch.where(visible, zero, ninf)  # [B, T, S]
    b = start.shape[0]
    return mask[:, None, None].expand(b, 1, groups, t, attn_len).reshape(b, 1, groups * t, attn_len)


class StaticForward:
    """Callable forward over a :class:`Transformer`'s weights for fixed-shape, graph-safe steps."""

    def __init__(
        self, model: Transformer, use_triton: bool | None = None, fuse_residual: bool | None = None
    ) -> None:
        self.model = model
        self.cfg: ModelConfig = model.cfg
        self.use_triton = triton_usable(model.device) if use_triton is None else use_triton
        self._k: ModuleType | None = None
        if self.use_triton:
            from specpilot.kernels import decode_triton

            self._k = decode_triton
        self.groups = self.cfg.num_heads // self.cfg.num_kv_heads
        # Fused residual GEMMs differ from "GEMM, round, add" by rounding only; on the CPU we
        # keep the stock order so fp32 results track the stock path as closely as possible.
        self.fuse_residual = model.device.type == "cuda" if fuse_residual is None else fuse_residual

    # ------------------------------------------------------------------ pieces
    def norm(self, x: Tensor, weight: Tensor) -> Tensor:  # [M, N] -> [M, N]
        if self._k is not None:
            return self._k.rms_norm(x, weight, self.cfg.rms_norm_eps)
        return reference.rms_norm_ref(x, weight, self.cfg.rms_norm_eps)

    @staticmethod
    def linear(layer: DecoderLayer, name: str, a: Tensor, b: Tensor | None = None) -> Tensor:
        """``a @ W.T (+ b)`` for the layer's matrix ``name``, through the kernel a mechanism
        installed in ``layer.linear_fns`` (e.g. W12) when there is one."""
        fn = layer.linear_fns.get(name)
        if fn is not None:
            return fn(a, b)
        return F.linear(a, getattr(layer, name), b)

    def linear_residual(self, x: Tensor, a: Tensor, layer: DecoderLayer, name: str) -> Tensor:
        """``x + a @ W.T`` for ``x [M, N]``, ``a [M, K]``, ``W = layer.<name> [N, K]``."""
        if self.fuse_residual and name not in layer.linear_fns:
            return torch.addmm(x, a, getattr(layer, name).t())
        return x + self.linear(layer, name, a)

    def rope_write(
        self,
        qkv: Tensor,  # [M, q_cols + 2kv]
        q_heads: int,
        layer: DecoderLayer,
        k_cache: Tensor,  # [B, H_kv, S, D]
        v_cache: Tensor,
        positions: Tensor,  # [M] int64 RoPE positions
        batch: int,
        slots: Tensor | None = None,  # [M] int64 cache slots; None: the positions
    ) -> Tensor:
        """RoPE (+ q/k norm), K/V written at their slots; returns q ``[B, H_kv, G*T, D]``.

        Slots and positions are equal for a chain; a tree puts node i at slot ``start + i`` and
        position ``start + depth(i)``."""
        cfg, m = self.cfg, qkv.shape[0]
        d, hkv, t = cfg.head_dim, cfg.num_kv_heads, qkv.shape[0] // batch
        model = self.model
        if self._k is not None:
            return self._k.rope_qkv_write(
                qkv.contiguous(),
                q_heads,
                hkv,
                d,
                batch,
                positions,
                model.rope_cos,
                model.rope_sin,
                layer.q_norm,
                layer.k_norm,
                cfg.rms_norm_eps,
                k_cache,
                v_cache,
                slots,
            )
        q_cols = q_heads * d
        q = qkv[:, :q_cols].reshape(m, q_heads, d)
        k = qkv[:, q_cols : q_cols + hkv * d].reshape(m, hkv, d)
        v = qkv[:, q_cols + hkv * d :].reshape(m, hkv, d)
        eps = cfg.rms_norm_eps
        k = reference.rope_rows_ref(k, model.rope_cos, model.rope_sin, positions, layer.k_norm, eps)
        slot_bt = (positions if slots is None else slots).view(batch, t)
        bidx = torch.arange(batch, device=qkv.device)[:, None]
        k_cache.permute(0, 2, 1, 3)[bidx, slot_bt] = k.view(batch, t, hkv, d)
        v_cache.permute(0, 2, 1, 3)[bidx, slot_bt] = v.reshape(batch, t, hkv, d)
        if q_heads == 0:
            return q.new_empty(batch, hkv, 0, d)
        q = reference.rope_rows_ref(q, model.rope_cos, model.rope_sin, positions, layer.q_norm, eps)
        g = q_heads // hkv
        return q.view(batch, t, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(batch, hkv, g * t, d)

    def write_kv(
        self,
        layer: DecoderLayer,
        x: Tensor,  # [M, hidden] already normed context rows
        k_cache: Tensor,
        v_cache: Tensor,
        positions: Tensor,  # [M]
        batch: int,
    ) -> None:
        """Project rows to K/V only (no attention, no MLP) and write them at their slots."""
        cfg = self.cfg
        w_kv = layer.w_qkv[cfg.q_size :]
        b_kv = None if layer.b_qkv is None else layer.b_qkv[cfg.q_size :]
        kv = F.linear(x, w_kv, b_kv)  # [M, 2kv]
        self.rope_write(kv, 0, layer, k_cache, v_cache, positions, batch)

    def layer(
        self,
        layer: DecoderLayer,
        x: Tensor,  # [M, hidden] residual stream, M = B*T
        k_cache: Tensor,
        v_cache: Tensor,
        positions: Tensor,  # [M]
        batch: int,
        attn_len: int,
        mask: Tensor,  # [B, 1, G*T, attn_len]
    ) -> Tensor:
        cfg = self.cfg
        m, t = x.shape[0], x.shape[0] // batch
        hn = self.norm(x, layer.input_norm)
        qkv = self.linear(layer, "w_qkv", hn, layer.b_qkv)  # [M, q + 2kv]
        q = self.rope_write(qkv, cfg.num_heads, layer, k_cache, v_cache, positions, batch)
        attn = F.scaled_dot_product_attention(
            q, k_cache[:, :, :attn_len], v_cache[:, :, :attn_len], attn_mask=mask
        )  # [B, H_kv, G*T, D]
        o = (
            attn.view(batch, cfg.num_kv_heads, self.groups, t, cfg.head_dim)
            .permute(0, 3, 1, 2, 4)
            .reshape(m, cfg.q_size)
        )
        x = self.linear_residual(x, o, layer, "w_o")
        hn = self.norm(x, layer.post_attn_norm)
        gate_up = self.linear(layer, "w_gate_up", hn)  # [M, 2I]
        act = self._k.silu_mul(gate_up) if self._k is not None else reference.silu_mul_ref(gate_up)
        return self.linear_residual(x, act, layer, "w_down")

    # ------------------------------------------------------------------ whole passes
    def run_layers(
        self,
        layers: Sequence[DecoderLayer],
        x: Tensor,  # [B, T, hidden]
        cache: KVCache,
        start: Tensor,  # [B] int64 device
        attn_len: int,
        causal: bool = True,
        hidden_layers: Sequence[int] = (),
        hidden_out: Tensor | None = None,  # [len(hidden_layers), B, T, hidden]
    ) -> Tensor:
        """Run ``layers`` over a block at slots ``start + t``; returns ``[B*T, hidden]``."""
        b, t, h = x.shape
        if attn_len > cache.max_seq_len:
            raise ValueError(f"attention length {attn_len} beyond the cache ({cache.max_seq_len})")
        positions = (start[:, None] + torch.arange(t, device=x.device)).reshape(b * t)  # [M]
        mask = attention_mask(start, t, attn_len, self.groups, x.dtype, causal)
        x2 = x.reshape(b * t, h)
        for i, layer in enumerate(layers):
            x2 = self.layer(layer, x2, cache.k[i], cache.v[i], positions, b, attn_len, mask)
            if hidden_out is not None and i in hidden_layers:
                hidden_out[hidden_layers.index(i)].view(b * t, h).copy_(x2)
        return x2

    def logits(self, x: Tensor) -> Tensor:  # [M, hidden] -> [M, vocab]
        return F.linear(self.norm(x, self.model.final_norm), self.model.lm_head)

    def __call__(
        self,
        tokens: Tensor,  # [B, T] int64
        cache: KVCache,
        start: Tensor,  # [B] int64 device: committed KV entries per row
        attn_len: int,
        hidden_layers: Sequence[int] = (),
        hidden_out: Tensor | None = None,  # [len(hidden_layers), B, T, hidden]
    ) -> Tensor:
        """Logits ``[B, T, vocab]`` of a causal block written at slots ``start + t``."""
        b, t = tokens.shape
        layers = [lyr for lyr in self.model.layers if isinstance(lyr, DecoderLayer)]
        x = F.embedding(tokens, self.model.embed)  # [B, T, hidden]
        x2 = self.run_layers(
            layers, x, cache, start, attn_len, True, hidden_layers, hidden_out
        )  # [B*T, hidden]
        return self.logits(x2).view(b, t, -1)
