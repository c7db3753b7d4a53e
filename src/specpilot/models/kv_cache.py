"""Preallocated static KV cache for a batch of sequences of different lengths.

Rollback is by position: entries past a sequence's committed length are stale and are simply
overwritten by the next forward, which always writes a contiguous run of positions starting at
the committed length. Because attention masks keys by position (key_pos <= query_pos), a stale
entry is never read: every key at or below a query's position was either committed earlier or
written in the same forward. So rollback costs nothing and needs no copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from specpilot.config import ModelConfig


@dataclass(slots=True)
class KVCache:
    """Keys and values of every layer, plus the committed length of each sequence."""

    k: list[Tensor]  # per layer [B, H_kv, S_max, D] (the layout attention reads)
    v: list[Tensor]  # per layer [B, H_kv, S_max, D]
    lengths: Tensor  # [B] int64 on the host: committed (valid) KV entries per sequence
    _offsets: Tensor | None = field(default=None, repr=False, compare=False)
    _offsets_of: tuple[int, ...] = field(default=(), repr=False, compare=False)

    @classmethod
    def allocate(
        cls,
        cfg: ModelConfig,
        batch_size: int,
        max_seq_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> KVCache:
        shape = (batch_size, cfg.num_kv_heads, max_seq_len, cfg.head_dim)
        k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        return cls(k=k, v=v, lengths=torch.zeros(batch_size, dtype=torch.int64))

    @property
    def batch_size(self) -> int:
        return self.k[0].shape[0]

    @property
    def max_seq_len(self) -> int:
        return self.k[0].shape[2]

    def commit(self, row: int, length: int) -> None:
        """Declare the first ``length`` entries of ``row`` valid (grows or rolls back)."""
        if not 0 <= length <= self.max_seq_len:
            raise ValueError(f"length {length} outside the cache (0..{self.max_seq_len})")
        self.lengths[row] = length

    def slice(self, first: int, n: int = 1) -> KVCache:
        """A view of sequences ``first .. first + n - 1``: same storage, so writes land there."""
        if not (first >= 0 and n >= 1 and first + n <= self.batch_size):
            raise ValueError(f"rows {first}..{first + n - 1} outside 0..{self.batch_size - 1}")
        end = first + n
        return KVCache(
            k=[t[first:end] for t in self.k],
            v=[t[first:end] for t in self.v],
            lengths=self.lengths[first:end],
        )

    def tensor_offsets(self) -> Tensor:
        """``[2L]`` int64 on the cache's device: element offset of ``k[0..L-1]`` then
        ``v[0..L-1]`` from ``k[0]``, so that one kernel reaches every layer through one base
        pointer (``kernels/tree_accept.py``). Computed once per set of tensors (a host→device
        copy), so call it outside CUDA-graph capture first."""
        tensors = [*self.k, *self.v]
        ptrs = tuple(t.data_ptr() for t in tensors)
        if self._offsets is not None and self._offsets_of == ptrs:
            return self._offsets
        first = tensors[0]
        size = first.element_size()
        for t in tensors:
            if t.shape != first.shape or t.stride() != first.stride() or t.dtype != first.dtype:
                raise ValueError("every cache tensor needs the same shape, strides and dtype")
            if (t.data_ptr() - ptrs[0]) % size:
                raise ValueError("a cache tensor is not aligned to its element size")
        offs = [(p - ptrs[0]) // size for p in ptrs]
        self._offsets = torch.tensor(offs, dtype=torch.int64, device=first.device)
        self._offsets_of = ptrs
        return self._offsets

    def reset(self) -> None:
        self.lengths.zero_()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
