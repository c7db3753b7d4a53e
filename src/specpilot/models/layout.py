"""Where the rows of one forward sit: the layouts the one layer body (``models/forward.py``) takes.

A forward computes ``M`` rows (tokens). Attention runs over the KV cache of ``B`` sequences with a
padded query block of ``W`` rows per sequence (GQA group folded in: ``[B, H_kv, G*W, D]``); the
layout says, for every forward row, its RoPE position, the cache slot its K/V goes to, where its
query sits in the padded block, and what each query may see (an additive mask, built on the
device so that one captured CUDA graph serves every length inside its attention bucket).

* :class:`DenseLayout` — every sequence feeds the same ``T`` tokens, ``M = B*T`` (prefill, AR
  steps, chain verify, the block drafter's non-causal block). Placement is a reshape.
* :class:`PackedLayout` — sequence b feeds its own ``w_b <= W`` tokens, ``M = sum(w_b)`` rounded
  up to a bucket (ragged verify), or a draft tree per sequence (tree verify: node j at cache slot
  ``start + j``, rotated at ``start + depth(j)``, masked to its ancestors). Placement is a
  scatter into the padded block and a gather back; the bucket's padding rows write their K/V to
  the cache's last slot, which the engine's slot margin keeps invisible to every real query.

Invariant for both: a forward writes each sequence's K/V contiguously from its committed length,
and every query sees only slots below its sequence's committed length plus the rows of its own
block the mask allows; so stale entries past a committed length are never read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from specpilot.models.tree_mask import tree_attention_mask


def additive(visible: Tensor, groups: int, dtype: torch.dtype) -> Tensor:
    """``visible [B, W, S]`` bool → additive mask ``[B, 1, G*W, S]`` (row ``g*W + w``)."""
    b, w, s = visible.shape
    zero = torch.zeros((), dtype=dtype, device=visible.device)
    ninf = torch.full((), float("-inf"), dtype=dtype, device=visible.device)
    mask = torch.where(visible, zero, ninf)  # [B, W, S]
    return mask[:, None, None].expand(b, 1, groups, w, s).reshape(b, 1, groups * w, s)


def block_mask(
    start: Tensor,  # [B] int64: committed KV entries per sequence (first new token's slot)
    t: int,
    attn_len: int,
    groups: int,
    dtype: torch.dtype,
    causal: bool = True,
) -> Tensor:
    """Additive ``[B, 1, G*T, attn_len]``. Causal: query t sees slots ``< start + t + 1``.
    Block (``causal=False``): every query sees the prefix and the whole block, ``< start + T``."""
    dev = start.device
    keys = torch.arange(attn_len, device=dev)  # [S]
    if causal:
        limit = start[:, None] + torch.arange(1, t + 1, device=dev)  # [B, T]
    else:
        limit = (start + t)[:, None].expand(-1, t)  # [B, T]
    return additive(keys[None, None, :] < limit[:, :, None], groups, dtype)


def rope_rows(
    positions: Tensor,  # [M] int64
    cos_table: Tensor,  # [P, D]
    sin_table: Tensor,  # [P, D]
) -> tuple[Tensor, Tensor]:  # cos, sin [M, 1, D]
    """The RoPE tables gathered at the rows' positions, shaped for ``[M, H, D]`` heads."""
    return cos_table[positions][:, None, :], sin_table[positions][:, None, :]


@dataclass(slots=True)
class DenseLayout:
    """``B`` sequences, ``T`` new tokens each, at cache slots ``start_b + t``."""

    batch: int
    width: int  # T
    attn_len: int
    positions: Tensor  # [M] int64 RoPE positions
    mask: Tensor | None  # [B, 1, G*T, attn_len] additive, or None: every key < attn_len is seen
    write_start: int | None = None
    """Host-known first slot when ``batch == 1``: K/V are written by a slice, not an index."""
    slots: Tensor | None = None
    """[M] int64 cache slots when they differ from the positions (None: the positions)."""
    block: int = 0
    """Rows per independent draft block within a sequence's ``T`` rows, for the block mixes of
    DFlash2 layers (a trainer packs many blocks per sequence); 0: the whole ``T``."""
    start: Tensor | None = None
    """[B] int64 first new slot per sequence when ``mask`` is exactly ``block_mask(start, T,
    attn_len, ..., causal)`` (``build``), so that an attention kernel may read the lengths
    instead of the mask (``Forward.attend``); None: a mask of the caller's own."""
    causal: bool = True
    _cos_sin: tuple[Tensor, Tensor] | None = field(default=None, repr=False)

    @classmethod
    def build(
        cls,
        start: Tensor,  # [B] int64 on the device
        t: int,
        attn_len: int,
        groups: int,
        dtype: torch.dtype,
        causal: bool = True,
        host_start: int | None = None,
        positions: Tensor | None = None,  # [B, T] RoPE positions when not the slots
    ) -> DenseLayout:
        """A block of ``t`` tokens per sequence. ``host_start`` (batch 1 only, eager runs) lets a
        one-token step skip the mask when attention reads exactly the slots up to it, and write
        K/V by a slice."""
        b = start.shape[0]
        slots = (start[:, None] + torch.arange(t, device=start.device)).reshape(b * t)
        exact = host_start is not None and b == 1 and attn_len == host_start + t
        mask = None if exact and t == 1 else block_mask(start, t, attn_len, groups, dtype, causal)
        write_start = host_start if b == 1 else None
        if positions is None:
            return cls(b, t, attn_len, slots, mask, write_start, start=start, causal=causal)
        return cls(
            b, t, attn_len, positions.reshape(b * t), mask, write_start, slots,
            start=start, causal=causal,
        )  # fmt: skip

    @classmethod
    def writes(cls, start: Tensor, t: int) -> DenseLayout:
        """Rows that only write K/V (no attention): ``t`` per sequence at slots ``start + t``."""
        b = start.shape[0]
        positions = (start[:, None] + torch.arange(t, device=start.device)).reshape(b * t)
        return cls(b, t, 0, positions, None)

    def cos_sin(self, cos_table: Tensor, sin_table: Tensor) -> tuple[Tensor, Tensor]:
        """``cos, sin [M, 1, D]`` gathered once per forward (the torch path of every layer)."""
        if self._cos_sin is None:
            self._cos_sin = rope_rows(self.positions, cos_table, sin_table)
        return self._cos_sin

    def write_kv(self, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor) -> None:
        """``k, v [M, H_kv, D]`` into ``[B, H_kv, S, D]`` caches at the rows' slots."""
        b, t = self.batch, self.width
        k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)  # no-ops but under training autocast
        if self.write_start is not None:
            s = self.write_start
            k_cache[0, :, s : s + t] = k.transpose(0, 1)
            v_cache[0, :, s : s + t] = v.transpose(0, 1)
            return
        slots = (self.positions if self.slots is None else self.slots).view(b, t)
        bidx = torch.arange(b, device=k.device)[:, None]
        k_cache.permute(0, 2, 1, 3)[bidx, slots] = k.view(b, t, *k.shape[1:])
        v_cache.permute(0, 2, 1, 3)[bidx, slots] = v.view(b, t, *v.shape[1:])

    def place_q(self, q: Tensor, kv_heads: int) -> Tensor:
        """``q [M, H, D]`` → the padded block ``[B, H_kv, G*T, D]``."""
        b, t, d = self.batch, self.width, q.shape[-1]
        g = q.shape[1] // kv_heads
        return q.view(b, t, kv_heads, g, d).permute(0, 2, 3, 1, 4).reshape(b, kv_heads, g * t, d)

    def gather(self, attn: Tensor) -> Tensor:
        """``[B, H_kv, G*T, D]`` → ``[M, H*D]`` in forward-row order."""
        b, hkv, gt, d = attn.shape
        t = self.width
        return attn.view(b, hkv, gt // t, t, d).permute(0, 3, 1, 2, 4).reshape(b * t, -1)

    def to_block(self, x: Tensor, out: Tensor) -> None:
        """Copy forward rows ``x [M, C]`` into ``out [B, >= T, C]`` (rows ``:T`` of each)."""
        out[:, : self.width].copy_(x.view(self.batch, self.width, -1))

    def live_rows(self, active: Tensor) -> Tensor:  # active [B] int64 -> [M] bool
        """Forward rows whose argmax an accept may commit: every row of an active sequence."""
        return (active != 0)[:, None].expand(self.batch, self.width).reshape(-1)


def bucket_rows(m: int, bucket: int) -> int:
    """Packed rows rounded up to a multiple of ``bucket`` (at least one bucket)."""
    return max(bucket, -(-m // bucket) * bucket)


@dataclass(slots=True)
class PackedRows:
    """Per-cycle placement of packed rows: device buffers the host rewrites before each replay.

    ``data`` rows: 0 = sequence of packed row i, 1 = its offset in the sequence's block (0 is
    the pending token or the tree's root), 2 = 1 for a real row and 0 for bucket padding. Row 3's
    first B entries are the per-sequence draft lengths ``w_b - 1`` (0 for a width of 0 or 1).
    """

    data: Tensor  # [4, M_cap] int64 on the device
    host: Tensor  # [4, M_cap] int64, pinned on CUDA
    batch: int
    width: int  # W: the padded block width

    @classmethod
    def allocate(cls, batch: int, width: int, device: torch.device) -> PackedRows:
        m_cap = batch * width
        host = torch.zeros(4, m_cap, dtype=torch.int64, pin_memory=device.type == "cuda")
        return cls(torch.zeros(4, m_cap, dtype=torch.int64, device=device), host, batch, width)

    @property
    def capacity(self) -> int:
        return int(self.data.shape[1])

    def fill(self, widths: list[int], rows: int) -> None:
        """Place ``widths[b]`` tokens of sequence b, then padding up to ``rows``; one copy."""
        if len(widths) > self.batch or any(not 0 <= w <= self.width for w in widths):
            raise ValueError(f"Need <= {self.batch} widths in [0, {self.width}]; got {widths}.")
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
        h[3, : len(widths)] = torch.tensor([max(w - 1, 0) for w in widths], dtype=torch.int64)
        self.data.copy_(h, non_blocking=True)


@dataclass(slots=True)
class PackedLayout:
    """``M`` packed rows over ``B`` sequences with a padded block of ``W`` (see :class:`PackedRows`)."""

    batch: int
    width: int  # W
    attn_len: int
    positions: Tensor  # [M] RoPE positions
    place: Tensor  # [4, M]: q sequence (padding: B), q offset, cache row, cache slot (pad: last)
    gather_index: Tensor  # [M] row of the flattened padded block read back (padding: 0)
    pad_index: Tensor  # [M] row of the flattened block a forward row goes to (padding: B*W)
    mask: Tensor  # [B, 1, G*W, attn_len] additive
    _cos_sin: tuple[Tensor, Tensor] | None = field(default=None, repr=False)

    @classmethod
    def build(
        cls,
        rows: PackedRows,
        m: int,  # packed rows of this forward (a bucket)
        start: Tensor,  # [B] int64 device: committed KV entries per sequence
        attn_len: int,
        groups: int,
        dtype: torch.dtype,
        capacity: int,  # the cache's slots (padding writes the last one)
        depths: Tensor | None = None,  # [B, W] tree depth of each block row (None: a chain)
        visible: Tensor | None = None,  # [B, W, W] bool ancestor mask (with ``depths``)
    ) -> PackedLayout:
        b, w = start.shape[0], rows.width
        row, offset = rows.data[0, :m], rows.data[1, :m]  # [M]
        real = rows.data[2, :m].bool()  # [M]
        flat = row * w + offset  # [M]
        slot = start.index_select(0, row) + offset  # [M]
        if depths is None:
            positions = slot
            mask = block_mask(start, w, attn_len, groups, dtype)
        else:  # tree: RoPE at the node's depth, K/V at its block slot
            assert visible is not None
            positions = start.index_select(0, row) + depths.reshape(-1).index_select(0, flat)
            mask = tree_attention_mask(start, visible, attn_len, groups, dtype)
        kv_slot = torch.where(real, slot, torch.full_like(slot, capacity - 1))
        q_row = torch.where(real, row, torch.full_like(row, b))
        return cls(
            batch=b,
            width=w,
            attn_len=attn_len,
            positions=positions,
            place=torch.stack([q_row, offset, row, kv_slot]).contiguous(),
            gather_index=torch.where(real, flat, torch.zeros_like(flat)),
            pad_index=torch.where(real, flat, torch.full_like(flat, b * w)),
            mask=mask,
        )

    def cos_sin(self, cos_table: Tensor, sin_table: Tensor) -> tuple[Tensor, Tensor]:
        if self._cos_sin is None:
            self._cos_sin = rope_rows(self.positions, cos_table, sin_table)
        return self._cos_sin

    def write_kv(self, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor) -> None:
        k_cache.permute(0, 2, 1, 3).index_put_((self.place[2], self.place[3]), k)
        v_cache.permute(0, 2, 1, 3).index_put_((self.place[2], self.place[3]), v)

    def place_q(self, q: Tensor, kv_heads: int) -> Tensor:
        """``q [M, H, D]`` scattered into the padded block ``[B, H_kv, G*W, D]`` (zeros elsewhere)."""
        b, w, (_, h, d) = self.batch, self.width, q.shape
        g = h // kv_heads
        pad = q.new_zeros((b + 1) * w, h, d)
        pad.index_copy_(0, self.place[0] * w + self.place[1], q)  # [(B+1)*W, H, D]
        return (
            pad[: b * w]
            .view(b, w, kv_heads, g, d)
            .permute(0, 2, 3, 1, 4)
            .reshape(b, kv_heads, g * w, d)
        )

    def gather(self, attn: Tensor) -> Tensor:
        b, hkv, gw, d = attn.shape
        w = self.width
        o = attn.view(b, hkv, gw // w, w, d).permute(0, 3, 1, 2, 4).reshape(b * w, -1)
        return o.index_select(0, self.gather_index)  # [M, H*D]

    def to_block(self, x: Tensor, out: Tensor) -> None:
        """Scatter forward rows ``x [M, C]`` into ``out [B, >= W, C]`` (zeros at unfilled rows)."""
        b, w = self.batch, self.width
        pad = x.new_zeros(b * w + 1, x.shape[-1])
        pad.index_copy_(0, self.pad_index, x)
        out[:, :w].copy_(pad[: b * w].view(b, w, -1))

    def live_rows(self, active: Tensor) -> Tensor:  # active [B] int64 -> [M] bool
        """Forward rows whose argmax an accept may commit: real rows of active sequences (bucket
        padding is never placed in the block, :meth:`to_block`)."""
        return (self.place[0] < self.batch) & (active.index_select(0, self.place[2]) != 0)


Layout = DenseLayout | PackedLayout
