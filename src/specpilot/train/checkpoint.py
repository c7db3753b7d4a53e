"""Resumable training checkpoints: weights, optimizer state, step and data position, atomically.

A checkpoint is a folder ``ckpt-NNNNNNN`` of safetensors shards (each under ``SHARD_BYTES``, so
that every file can travel in a 16 MB limit) and ``meta.json`` (the training state and the
optimizer's hyper-parameters). It is written as ``*.tmp`` and renamed; then ``latest.json``
(written beside its name and renamed) points at it, and older checkpoints are removed. A kill at
any moment leaves ``latest.json`` naming a complete checkpoint, or none.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from specpilot.loading.save_dir import split_shards

SHARD_BYTES = 15_000_000
LATEST = "latest.json"


def write_text_atomic(path: Path, text: str) -> None:
    fd, part = tempfile.mkstemp(prefix=path.name + ".", suffix=".part", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)


def _shards(tensors: dict[str, Tensor]) -> list[dict[str, Tensor]]:
    """Shards under ``SHARD_BYTES``; a tensor bigger than that goes as row blocks ``name@i``."""
    parts: dict[str, Tensor] = {}
    for name, t in tensors.items():
        if t.numel() * t.element_size() > SHARD_BYTES:
            rows = max(1, SHARD_BYTES // max(1, t[0].numel() * t.element_size()))
            parts |= {f"{name}@{i}": p.contiguous() for i, p in enumerate(t.split(rows))}
        else:
            parts[name] = t
    return [s for s in split_shards(parts, SHARD_BYTES) if s]


def save_checkpoint(
    root: Path, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> Path:
    """Write a checkpoint of ``model``, ``optimizer`` and ``state`` (JSON-able; ``step`` in it)."""
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    name = f"ckpt-{int(state['step']):07d}"
    tmp = root / (name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    tensors = {f"model/{n}": p.detach().cpu().contiguous() for n, p in model.named_parameters()}
    opt = optimizer.state_dict()
    for idx, st in opt["state"].items():
        for key, value in st.items():
            tensors[f"opt/{idx}/{key}"] = torch.as_tensor(value).detach().cpu().contiguous()
    files = []
    for i, shard in enumerate(_shards(tensors)):
        fname = f"part-{i:03d}.safetensors"
        save_file(shard, str(tmp / fname))
        files.append(fname)
    meta = {"state": state, "param_groups": opt["param_groups"], "files": files}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    final = root / name
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    write_text_atomic(root / LATEST, json.dumps({"checkpoint": name, "step": state["step"]}) + "\n")
    for old in root.glob("ckpt-*"):
        if old.name != name:
            shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(
    root: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> dict[str, Any] | None:
    """Restore the checkpoint ``latest.json`` names (None if there is none); returns its state."""
    from safetensors import safe_open

    latest = root / LATEST
    if not latest.is_file():
        return None
    folder = root / json.loads(latest.read_text())["checkpoint"]
    meta = json.loads((folder / "meta.json").read_text())
    tensors: dict[str, Tensor] = {}
    pieces: dict[str, list[tuple[int, Tensor]]] = {}
    for fname in meta["files"]:
        with safe_open(str(folder / fname), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                base, _, part = key.partition("@")
                if part:
                    pieces.setdefault(base, []).append((int(part), f.get_tensor(key)))
                else:
                    tensors[key] = f.get_tensor(key)
    for base, parts in pieces.items():
        tensors[base] = torch.cat([t for _, t in sorted(parts, key=lambda p: p[0])])
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(tensors[f"model/{n}"])
    if optimizer is not None:
        state: dict[int, dict[str, Tensor]] = {}
        for key, t in tensors.items():
            if key.startswith("opt/"):
                _, idx, name = key.split("/", 2)
                state.setdefault(int(idx), {})[name] = t
        optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    return dict(meta["state"])
