"""Plain-torch references the drafter tests compare the engine against (written from the papers'
equations, independent of ``models/``), and how the tests write a checkpoint directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor


def rms(x: Tensor, w: Tensor, eps: float) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x: Tensor, pos: Tensor, theta: float) -> Tensor:  # x [L, heads, d], pos [L]
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = pos[:, None].float() * inv[None, :]  # [L, d/2]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    rot = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1)
    return x * cos + rot * sin


def write_dir(root: Path, cfg: dict[str, Any], tensors: dict[str, Tensor], prefix: str) -> None:
    """``config.json`` and one ``model.safetensors`` (names under ``prefix``) in ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file({prefix + n: v.contiguous() for n, v in tensors.items()}, str(root / "model.safetensors"))  # fmt: skip
