"""Load a Hugging Face model directory: ``config.json`` plus safetensors shards, never pickle."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specpilot.config import ModelConfig
from specpilot.errors import CheckpointError
from specpilot.loading.fetch import PICKLE_SUFFIXES
from specpilot.loading.names import check_tensors, expected_tensor_names

INDEX_NAME = "model.safetensors.index.json"


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise CheckpointError(f"Could not read {path}: {e.strerror or e}.") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"{path} is not valid JSON.") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} should hold a JSON object.")
    return data


def _shard_files(root: Path) -> list[Path]:
    """The safetensors files to read: those the index names, else every ``*.safetensors``."""
    index = root / INDEX_NAME
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no weight_map.")
        files = [root / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise CheckpointError(
                    f"{index} names shard {f.name}, which is missing from {root}."
                )
        return files
    files = sorted(root.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in root.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(
            f"{root} holds only pickle weights ({', '.join(pickles[:3])}), which SpecPilot never "
            "loads; convert them to safetensors."
        )
    raise CheckpointError(f"{root} has no *.safetensors weights.")


def _read_shard(path: Path, wanted: set[str]) -> dict[str, torch.Tensor]:
    """Tensors of ``wanted`` found in one shard; safetensors' own errors become CheckpointError."""
    from safetensors import SafetensorError, safe_open

    out: dict[str, torch.Tensor] = {}
    try:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name in wanted:
                    out[name] = f.get_tensor(name)
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path} is truncated or corrupt ({first}).") from None
    return out


def load_hf_dir(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a HF directory into a config and its tensors under HF names, in their stored dtype.

    Only the tensors the network needs are returned (e.g. ``rotary_emb.inv_freq`` is dropped). When
    embeddings are tied, ``lm_head.weight`` is left out even if the file carries a copy, so that
    callers have one rule: tied means no ``lm_head.weight``.
    """
    root = Path(path).expanduser()
    if not root.is_dir():
        raise CheckpointError(f"Model directory {root} does not exist.")
    config_path = root / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{root} has no config.json, so it is not a Hugging Face model.")
    cfg = ModelConfig.from_hf(_read_json(config_path), str(config_path))
    wanted = set(expected_tensor_names(cfg))
    tensors: dict[str, torch.Tensor] = {}
    for shard in _shard_files(root):
        tensors.update(_read_shard(shard, wanted))
    check_tensors(cfg, tensors, str(root))
    return cfg, tensors
