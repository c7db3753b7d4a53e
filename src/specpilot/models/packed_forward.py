"""Packed ragged verify: one target forward where batch row b verifies its own width ``w_b``.

The dense projections (qkv, o, gate/up, down) and the LM head run on the **packed** rows only,
``M = sum(w_b)`` rounded up to a bucket (so a CUDA graph per bucket stays static); attention
scatters the packed queries into the usual padded ``[B, W]`` block, runs one SDPA call with the
causal additive mask (padding queries compute garbage that is never gathered back) and gathers
the real rows again. K/V are written only at real tokens' slots; the bucket's padding rows write
theirs to the cache's last slot, which no real query ever sees (the engine keeps a margin of
free slots past every row's final length).

Tree verify (``depths`` and ``visible`` given): the block is a draft tree rather than a chain;
block row j keeps its cache slot ``start + j`` but is rotated at position ``start + depth(j)``,
and the causal mask is replaced by the tree mask (``models/tree_mask.py``).

Where each packed row lives comes from a :class:`PackedLayout`: device buffers the host rewrites
in place before each replay (one small host→device copy from pinned memory, ordered on the
stream; no device→host sync).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from specpilot.kernels import reference
from specpilot.models.kv_cache import KVCache
from specpilot.models.static_forward import StaticForward, attention_mask
from specpilot.models.transformer import DecoderLayer
from specpilot.models.tree_mask import tree_attention_mask


def bucket_rows(m: int, bucket: int) -> int:
    """Packed rows rounded up to a multiple of ``bucket`` (at least one bucket)."""
    return max(bucket, -(-m // bucket) * bucket)


@dataclass(slots=True)
class PackedLayout:
    """Per-cycle placement of the packed verify rows, on the device (and its pinned host twin).

    ``data`` rows: 0 = batch row of packed row i, 1 = its offset in the row's block (0 is the
    pending token, j the j-th draft), 2 = 1 for a real token and 0 for bucket padding. Row 3's
    first B entries are the draft lengths ``w_b - 1`` (0 for a row given no width).
    """

    data: Tensor  # [4, M_cap] int64 on the device
    host: Tensor  # [4, M_cap] int64, pinned on CUDA
    batch: int
    width: int  # W: the padded block width (k + 1)

    @classmethod
    def allocate(cls, batch: int, width: int, device: torch.device) -> PackedLayout:
        m_cap = batch * width
        host = torch.zeros(4, m_cap, dtype=torch.int64, pin_memory=device.type == "cuda")
        return cls(torch.zeros(4, m_cap, dtype=torch.int64, device=device), host, batch, width)

    @property
    def capacity(self) -> int:
        return int(self.data.shape[1])

    def fill(self, widths: Sequence[int], rows: int) -> None:
        """Place ``widths[b]`` tokens of row b, then padding up to ``rows``; copy to the device."""
        if len(widths) != self.batch or any(not 0 <= w <= self.width for w in widths):
            raise ValueError(f"Need {self.batch} widths, each in [0, {self.width}]; got {widths}.")
        total = sum(widths)
        if not total <= rows <= self.capacity:
            raise ValueError(f"{rows} packed rows cannot hold {total} tokens.")
        row_ids: list[int] = []
        offsets: list[int] = []
        for b, w in enumerate(widths):
            row_ids += [b] * w
            offsets += range(w)
        h = self.host
        h.zero_()
        h[0, :total] = torch.tensor(row_ids, dtype=torch.int64)
        h[1, :total] = torch.tensor(offsets, dtype=torch.int64)
        h[2, :total] = 1
        h[3, : self.batch] = torch.tensor([max(w - 1, 0) for w in widths], dtype=torch.int64)
        self.data.copy_(h, non_blocking=True)


class PackedVerify:
    """The packed forward over a :class:`StaticForward`'s weights and pieces."""

    def __init__(self, fwd: StaticForward) -> None:
        self.fwd = fwd
        self.cfg = fwd.cfg

    def _rope_write_ref(
        self,
        layer: DecoderLayer,
        qkv: Tensor,  # [M, q + 2kv]
        k_cache: Tensor,  # [B, H_kv, S, D]
        v_cache: Tensor,
        positions: Tensor,  # [M]
        place: Tensor,  # [4, M]: q batch row (padding: B), offset, cache row, cache slot
        batch: int,
        width: int,
    ) -> Tensor:
        """Torch reference of ``decode_triton.rope_qkv_write_packed``; returns the padded query
        block ``[B, H_kv, G*W, D]``."""
        cfg, model = self.cfg, self.fwd.model
        m, d, hkv, g, eps = (
            qkv.shape[0],
            cfg.head_dim,
            cfg.num_kv_heads,
            self.fwd.groups,
            cfg.rms_norm_eps,
        )
        q = qkv[:, : cfg.q_size].reshape(m, cfg.num_heads, d)
        k = qkv[:, cfg.q_size : cfg.q_size + hkv * d].reshape(m, hkv, d)
        v = qkv[:, cfg.q_size + hkv * d :].reshape(m, hkv, d)
        k = reference.rope_rows_ref(k, model.rope_cos, model.rope_sin, positions, layer.k_norm, eps)
        q = reference.rope_rows_ref(q, model.rope_cos, model.rope_sin, positions, layer.q_norm, eps)
        k_cache.permute(0, 2, 1, 3).index_put_((place[2], place[3]), k)
        v_cache.permute(0, 2, 1, 3).index_put_((place[2], place[3]), v)
        q_pad = q.new_zeros((batch + 1) * width, cfg.num_heads, d)
        q_pad.index_copy_(0, place[0] * width + place[1], q)  # [(B+1)*W, H, D]
        return (
            q_pad[: batch * width]
            .view(batch, width, hkv, g, d)
            .permute(0, 2, 3, 1, 4)
            .reshape(batch, hkv, g * width, d)
        )

    def _attention_layer(
        self,
        layer: DecoderLayer,
        x: Tensor,  # [M, hidden] packed residual stream
        k_cache: Tensor,  # [B, H_kv, S, D]
        v_cache: Tensor,
        positions: Tensor,  # [M] RoPE positions
        place: Tensor,  # [4, M]: q batch row (padding: B), offset, cache row, slot (padding: last)
        gather_index: Tensor,  # [M] row of the padded block read back (padding: 0)
        batch: int,
        width: int,
        attn_len: int,
        mask: Tensor,  # [B, 1, G*W, attn_len]
    ) -> Tensor:
        cfg, fwd = self.cfg, self.fwd
        d, hkv, g = cfg.head_dim, cfg.num_kv_heads, fwd.groups
        eps = cfg.rms_norm_eps
        model = fwd.model
        hn = fwd.norm(x, layer.input_norm)
        qkv = fwd.linear(layer, "w_qkv", hn, layer.b_qkv)  # [M, q + 2kv]
        if fwd._k is not None:  # one fused launch: RoPE, K/V write, query scatter
            qb = fwd._k.rope_qkv_write_packed(
                qkv.contiguous(),
                cfg.num_heads,
                hkv,
                d,
                batch,
                width,
                positions,
                place,
                model.rope_cos,
                model.rope_sin,
                layer.q_norm,
                layer.k_norm,
                eps,
                k_cache,
                v_cache,
            )[:batch]  # [B, H_kv, G*W, D]
        else:
            qb = self._rope_write_ref(layer, qkv, k_cache, v_cache, positions, place, batch, width)
        attn = F.scaled_dot_product_attention(
            qb, k_cache[:, :, :attn_len], v_cache[:, :, :attn_len], attn_mask=mask
        )  # [B, H_kv, G*W, D]
        o = (
            attn.view(batch, hkv, g, width, d)
            .permute(0, 3, 1, 2, 4)
            .reshape(batch * width, cfg.q_size)
        )
        x = fwd.linear_residual(x, o.index_select(0, gather_index), layer, "w_o")  # [M, hidden]
        hn = fwd.norm(x, layer.post_attn_norm)
        gate_up = fwd.linear(layer, "w_gate_up", hn)  # [M, 2I]
        act = fwd._k.silu_mul(gate_up) if fwd._k is not None else reference.silu_mul_ref(gate_up)
        return fwd.linear_residual(x, act, layer, "w_down")

    def __call__(
        self,
        block: Tensor,  # [B, W] int64: pending token, then drafts (only each row's w_b are read)
        layout: PackedLayout,
        rows: int,  # M: packed rows of this call (a bucket)
        cache: KVCache,
        start: Tensor,  # [B] int64 device: committed KV entries per row
        attn_len: int,
        argmax_out: Tensor,  # [B, >= W] int64: a_0..a_{W-1} per row (only w_b are meaningful)
        hidden_layers: Sequence[int] = (),
        hidden_out: Tensor | None = None,  # [len(hidden_layers), B, W, hidden]
        depths: Tensor | None = None,  # [B, W] int64 tree depth of each block row (None: chain)
        visible: Tensor | None = None,  # [B, W, W] bool tree ancestor mask (with ``depths``)
    ) -> None:
        b, w = block.shape
        h = self.cfg.hidden_size
        if attn_len > cache.max_seq_len:
            raise ValueError(f"attention length {attn_len} beyond the cache ({cache.max_seq_len})")
        row, offset = layout.data[0, :rows], layout.data[1, :rows]  # [M]
        real = layout.data[2, :rows].bool()  # [M]
        flat = row * w + offset  # [M]
        pad_index = torch.where(real, flat, torch.full_like(flat, b * w))
        gather_index = torch.where(real, flat, torch.zeros_like(flat))
        slot = start.index_select(0, row) + offset  # [M]
        if depths is None:
            positions = slot
        else:  # tree: RoPE at the node's depth, K/V at its block slot
            positions = start.index_select(0, row) + depths.reshape(b * w).index_select(0, flat)
        kv_slot = torch.where(real, slot, torch.full_like(slot, cache.max_seq_len - 1))
        q_row = torch.where(real, row, torch.full_like(row, b))
        place = torch.stack([q_row, offset, row, kv_slot]).contiguous()  # [4, M]
        dtype = self.fwd.model.dtype
        if visible is None:
            mask = attention_mask(start, w, attn_len, self.fwd.groups, dtype)
        else:
            mask = tree_attention_mask(start, visible, attn_len, self.fwd.groups, dtype)
        tokens = block.reshape(b * w).index_select(0, gather_index)  # [M]
        x = F.embedding(tokens, self.fwd.model.embed)  # [M, hidden]
        layers = [lyr for lyr in self.fwd.model.layers if isinstance(lyr, DecoderLayer)]
        for i, layer in enumerate(layers):
            x = self._attention_layer(
                layer,
                x,
                cache.k[i],
                cache.v[i],
                positions,
                place,
                gather_index,
                b,
                w,
                attn_len,
                mask,
            )
            if hidden_out is not None and i in hidden_layers:
                pad = x.new_zeros(b * w + 1, h)
                pad.index_copy_(0, pad_index, x)
                hidden_out[hidden_layers.index(i)].view(b * w, h).copy_(pad[: b * w])
        ids = self.fwd.logits(x).argmax(dim=-1)  # [M]
        pad_ids = ids.new_zeros(b * w + 1)
        pad_ids.index_copy_(0, pad_index, ids)
        argmax_out[:, :w].copy_(pad_ids[: b * w].view(b, w))
