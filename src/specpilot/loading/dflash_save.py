"""Write a DFlash drafter in the published format (what ``loading/dflash.py`` reads back):
config.json in z-lab's keys, and the weights under their published names, bf16 by default, in
``model.safetensors`` or in shards under ``SHARD_BYTES`` with ``model.safetensors.index.json``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from specpilot.loading.dflash import ARCHITECTURES, _pairs, expected_shapes
from specpilot.loading.save_dir import save_safetensors_dir
from specpilot.models.dflash import DFlashNet, DFlashSpec


def config_from_spec(spec: DFlashSpec) -> dict[str, Any]:
    """The config.json of ``spec`` in z-lab's format (what ``spec_from_config`` reads back)."""
    c = spec.layers
    arch = {v: k for k, v in ARCHITECTURES.items()}[spec.kind]
    inner: dict[str, Any] = {
        "block_size": spec.block_size,
        "mask_token_id": spec.mask_token_id,
        "target_layer_ids": list(spec.target_layer_ids),
    }
    for key, value, default in (
        ("output_multiplier", spec.output_multiplier, 1.0),
        ("final_logit_softcapping", spec.logit_softcap, None),
        ("input_embedding_scale", spec.input_embedding_scale, 1.0),
        ("conv_kernel_size", spec.conv_kernel_size, 0),
        ("conv_group_size", spec.conv_group_size, 0),
        ("selector_rank", spec.selector_rank, 0),
        ("selector_top_k", spec.selector_top_k, 0),
    ):
        if value != default:
            inner[key] = value
    windows = [w for w in spec.layer_window if w is not None]
    return {
        "architectures": [arch],
        "auto_map": {"AutoModel": f"dflash.{arch}"},
        "model_type": "qwen3",
        "attention_bias": c.attention_bias,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "tie_word_embeddings": False,
        "layer_types": [
            "full_attention" if w is None and not cz else "sliding_attention"
            for cz, w in zip(spec.layer_causal, spec.layer_window, strict=True)
        ],
        "sliding_window": windows[0] if windows else None,
        "use_sliding_window": bool(windows),
        "num_target_layers": spec.num_target_layers,
        "block_size": spec.block_size,
        "dflash_config": inner,
        "torch_dtype": "bfloat16",
    }


def dflash_tensors(net: DFlashNet, dtype: torch.dtype = torch.bfloat16) -> dict[str, Tensor]:
    """Every weight under its published name (fused matrices split back out), on the CPU."""
    out: dict[str, Tensor] = {}
    for _, src, names in _pairs(net):
        sizes = [int(s[0]) for s in (expected_shapes(net.spec)[n] for n in names)]
        for name, part in zip(names, src.detach().split(sizes, dim=0), strict=True):
            out[name] = part.to("cpu", dtype).contiguous()
    return out


SHARD_BYTES = 15_000_000
"""Largest weights file written: every file of a drafter fits a 16 MB transfer."""


def save_dflash(net: DFlashNet, out: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write ``net`` as a loadable checkpoint: config.json and model.safetensors (or shards
    under ``SHARD_BYTES`` with model.safetensors.index.json), each file written beside its name
    and renamed into place; weights files of an earlier save that are not rewritten go."""
    cfg = config_from_spec(net.spec) | {"torch_dtype": str(dtype).removeprefix("torch.")}
    return save_safetensors_dir(out, cfg, dflash_tensors(net, dtype), SHARD_BYTES)
