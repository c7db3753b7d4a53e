"""Torch references for the fused decode kernels; numerically the stock ``Transformer`` ops."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def rms_norm_ref(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``x [M, N]`` → ``[M, N]``: float32 statistics, cast back, then scaled (as HF does)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_rows_ref(
    x: Tensor,  # [M, heads, D]
    cos_table: Tensor,  # [P, D] float32
    sin_table: Tensor,  # [P, D] float32
    positions: Tensor,  # [M] int64
    norm_weight: Tensor | None,  # [D] (Qwen3 q/k norm) or None
    eps: float,
) -> Tensor:
    """Optional per-head RMSNorm, then rotate-half RoPE; returns ``[M, heads, D]`` in x's dtype."""
    if norm_weight is not None:
        x = rms_norm_ref(x, norm_weight, eps)
    cos = cos_table[positions][:, None, :]  # [M, 1, D]
    sin = sin_table[positions][:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


def silu_mul_ref(gate_up: Tensor) -> Tensor:
    """``gate_up [M, 2I]`` (gate first) → ``silu(gate) * up`` ``[M, I]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def decode_attention_ref(
    q: Tensor,  # [B, H_kv, G*W, D] (row g*W + j)
    k_cache: Tensor,  # [B, H_kv, S, D]
    v_cache: Tensor,
    start: Tensor,  # [B] int64: the block's first slot per sequence
    width: int,  # W
    attn_len: int,
    causal: bool = True,
) -> Tensor:  # [B*W, H*D] in forward-row order
    """``kernels/decode_attn.decode_attention`` through SDPA under ``models/layout.block_mask``,
    reordered as ``DenseLayout.gather`` does (what the layer body runs without the kernel)."""
    from specpilot.models.layout import block_mask  # models import this module

    b, hkv, rows, d = q.shape
    g = rows // width
    mask = block_mask(start, width, attn_len, g, q.dtype, causal)
    attn = F.scaled_dot_product_attention(
        q, k_cache[:, :, :attn_len], v_cache[:, :, :attn_len], attn_mask=mask
    )  # [B, H_kv, G*W, D]
    return attn.view(b, hkv, g, width, d).permute(0, 3, 1, 2, 4).reshape(b * width, -1)
