"""Rotary position embeddings (non-interleaved halves, as in HF Llama/Qwen), with llama3 scaling."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from specpilot.config import ModelConfig


def inv_frequencies(cfg: ModelConfig) -> Tensor:
    """Inverse frequencies ``[head_dim // 2]`` in float64, llama3 scaling applied when configured."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    rs = cfg.rope_scaling
    if rs is None:
        return inv
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor
    )
    scaled = torch.where(wavelen > low_wavelen, inv / rs.factor, inv)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(mid, (1 - smooth) * inv / rs.factor + smooth * inv, scaled)


def rope_tables(
    cfg: ModelConfig, max_positions: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    """cos and sin tables ``[max_positions, head_dim]`` in float32 (halves duplicated)."""
    inv = inv_frequencies(cfg).to(torch.float32)
    # float32 like HF, so that rotations match the reference bit for bit in fp32.
    t = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(t, inv)  # [P, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [P, D]
    return emb.cos().to(device), emb.sin().to(device)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x [B, T, H, D]`` by ``cos/sin [B, T, 1, D]`` (already gathered by position)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)
