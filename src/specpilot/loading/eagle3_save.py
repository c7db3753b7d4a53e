"""Write an EAGLE-3 drafter in the published format (what ``loading/eagle3.py`` reads back, and
what SpecForge / sglang publish): config.json with the ``LlamaForCausalLMEagle3`` keys, and the
weights under their published names (bf16 by default) plus ``d2t`` (int64) and ``t2d`` (bool).

``embed_tokens.weight`` is not written: the drafter uses the target's embedding (sglang's EAGLE-3
worker gives the draft the target's embedding; SpecForge stores a frozen copy of it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from specpilot.loading.eagle3 import ARCHITECTURE, expected_shapes, weight_pairs
from specpilot.loading.save_dir import save_safetensors_dir
from specpilot.models.eagle3 import Eagle3Net, Eagle3Spec

SHARD_BYTES = 15_000_000
"""Largest weights file written: every file of a drafter fits a 16 MB transfer."""


def config_from_spec(spec: Eagle3Spec, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """The config.json of ``spec`` (what ``spec_from_config`` reads back)."""
    c = spec.layer
    rope: dict[str, Any] | None = None
    if c.rope_scaling is not None:
        r = c.rope_scaling
        rope = {
            "rope_type": "llama3",
            "factor": r.factor,
            "low_freq_factor": r.low_freq_factor,
            "high_freq_factor": r.high_freq_factor,
            "original_max_position_embeddings": r.original_max_position_embeddings,
        }
    cfg: dict[str, Any] = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "hidden_act": "silu",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": rope,
        "max_position_embeddings": c.max_position_embeddings,
        "pretraining_tp": 1,
        "tie_word_embeddings": False,
        "vocab_size": spec.vocab_size,
        "draft_vocab_size": spec.draft_vocab_size,
        "target_hidden_size": spec.target_hidden_size,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(spec.aux_layer_ids),
            "use_aux_hidden_state": True,
        },
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if c.bos_token_id is not None:
        cfg["bos_token_id"] = c.bos_token_id
    if c.eos_token_ids:
        cfg["eos_token_id"] = list(c.eos_token_ids)
    return cfg


def eagle3_tensors(net: Eagle3Net, dtype: torch.dtype = torch.bfloat16) -> dict[str, Tensor]:
    """Every tensor under its published name (fused matrices split back out), on the CPU."""
    shapes = expected_shapes(net.spec)
    out: dict[str, Tensor] = {}
    for src, names in weight_pairs(net):
        sizes = [shapes[n][0] for n in names]
        for name, part in zip(names, src.detach().split(sizes, dim=0), strict=True):
            out[name] = part.to("cpu", dtype).contiguous()
    out["lm_head.weight"] = net.draft_head.detach().to("cpu", dtype).contiguous()
    out["d2t"] = net.d2t.to("cpu", torch.int64).contiguous()
    out["t2d"] = net.t2d.to("cpu", torch.bool).contiguous()
    return out


def save_eagle3(net: Eagle3Net, out: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write ``net`` as a loadable checkpoint directory (config.json + safetensors, files under
    ``SHARD_BYTES``; see ``loading/save_dir.py``)."""
    return save_safetensors_dir(
        out, config_from_spec(net.spec, dtype), eagle3_tensors(net, dtype), SHARD_BYTES
    )


__all__ = ["config_from_spec", "eagle3_tensors", "save_eagle3"]
