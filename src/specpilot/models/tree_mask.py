"""The additive attention mask of a static tree verify, built on the device (graph-safe).

Row b verifies a block of ``W`` forward rows written at cache slots ``start_b + j``; row j (the
root j = 0, or a drafted node) may see every committed slot (``< start_b``) and, inside the block,
exactly the rows ``visible[b, j]`` marks: its ancestors and itself. The host fills ``visible``
in place before each replay, so one captured graph serves every tree shape of the same width.
"""

from __future__ import annotations

import torch
from torch import Tensor


def tree_attention_mask(
    start: Tensor,  # [B] int64: committed KV entries per row (the root's slot)
    visible: Tensor,  # [B, W, W] bool: row j sees block row i (ancestors and itself)
    attn_len: int,
    groups: int,
    dtype: torch.dtype,
) -> Tensor:
    """Additive mask ``[B, 1, G*W, attn_len]`` (row ``g*W + j``): 0 where visible, -inf elsewhere."""
    b, w, _ = visible.shape
    dev = start.device
    keys = torch.arange(attn_len, device=dev)  # [S]
    rel = keys[None, :] - start[:, None]  # [B, S]: slot relative to the root
    prefix = rel < 0  # [B, S]
    in_block = (rel >= 0) & (rel < w)  # [B, S]
    idx = rel.clamp(0, w - 1)[:, None, :].expand(b, w, attn_len)  # [B, W, S]
    seen = visible.gather(2, idx) & in_block[:, None, :]  # [B, W, S]
    ok = seen | prefix[:, None, :]  # [B, W, S]
    zero = torch.zeros((), dtype=dtype, device=dev)
    ninf = torch.full((), float("-inf"), dtype=dtype, device=dev)
    mask = torch.where(ok, zero, ninf)  # [B, W, S]
    return mask[:, None, None].expand(b, 1, groups, w, attn_len).reshape(b, 1, groups * w, attn_len)
