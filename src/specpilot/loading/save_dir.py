"""Write a checkpoint directory as published drafters ship: ``config.json`` plus the weights in
``model.safetensors``, or in shards under a size limit with ``model.safetensors.index.json``.

Each file is written beside its name and renamed into place; weights files of an earlier save
that this one does not rewrite are removed, so a directory saved twice holds one checkpoint.
(``loading/dflash_save.py`` and ``loading/eagle3_save.py`` build the config and the tensors.)
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from torch import Tensor

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def split_shards(tensors: dict[str, Tensor], shard_bytes: int) -> list[dict[str, Tensor]]:
    """Tensors in order, a new shard whenever the next one would pass ``shard_bytes``."""
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    return shards


def save_safetensors_dir(
    out: str | Path, config: dict[str, Any], tensors: dict[str, Tensor], shard_bytes: int
) -> Path:
    """``config`` as config.json and ``tensors`` (CPU, contiguous) in files under
    ``shard_bytes`` (one ``model.safetensors`` when they fit)."""
    from safetensors.torch import save_file

    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    shards = split_shards(tensors, shard_bytes)
    names = (
        [WEIGHTS_NAME]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    files: list[tuple[str, Any]] = [
        (fname, lambda p, sh=shard: save_file(sh, p, {"format": "pt"}))
        for fname, shard in zip(names, shards, strict=True)
    ]
    index = {
        "metadata": {},
        "weight_map": {n: f for f, sh in zip(names, shards, strict=True) for n in sh},
    }
    if len(shards) > 1:
        files.append((INDEX_NAME, lambda p: Path(p).write_text(json.dumps(index, indent=2))))
    files.append(("config.json", lambda p: Path(p).write_text(json.dumps(config, indent=2) + "\n")))
    for stale in root.glob("model*.safetensors*"):
        if stale.name not in names and stale.name != INDEX_NAME:
            stale.unlink()
    if len(shards) == 1 and (root / INDEX_NAME).exists():
        (root / INDEX_NAME).unlink()
    for name, write in files:
        fd, part = tempfile.mkstemp(prefix=name + ".", suffix=".part", dir=root)
        os.close(fd)
        try:
            write(part)
            os.chmod(part, 0o644)
            os.replace(part, root / name)
        finally:
            if os.path.exists(part):
                os.unlink(part)
    return root


__all__ = ["INDEX_NAME", "WEIGHTS_NAME", "save_safetensors_dir", "split_shards"]
