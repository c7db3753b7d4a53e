"""Write a model as a Hugging Face directory (config.json, safetensors shards, a tokenizer), so
that a synthetic deployment is loaded and served by the commands exactly like a user's model.

The weights are the model's own (e.g. seeded random ones at a real shape, ``synthetic.py``),
written under HF names with q/k/v and gate/up split back out of the fused matrices (an exact
copy). The tokenizer comes from a saved HF tokenizer folder (e.g. SmolLM2's, converted from its
GGUF); when the model's vocabulary is larger, placeholder tokens ``<extra_i>`` fill it up so that
every id the model can emit decodes, to text as a real model's tokens do (plain added tokens, not
special ones that a server skips: a random model emits them most of the time, and text that never
comes would hold a streamed answer's first chunk back, making its time to first text a window
late).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from specpilot.config import ModelConfig
from specpilot.models.layer import DecoderLayer
from specpilot.models.transformer import Transformer

SHARD_BYTES = 2 << 30
"""Largest safetensors shard written (bytes)."""


def hf_config(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    """The ``config.json`` of ``cfg`` in Hugging Face's format (what ``ModelConfig.from_hf`` reads)."""
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
    out: dict[str, Any] = {
        "architectures": [arch[cfg.arch]],
        "model_type": cfg.arch,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attention_bias,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_ids)
        if len(cfg.eos_token_ids) != 1
        else cfg.eos_token_ids[0],
    }
    rs = cfg.rope_scaling
    if rs is not None:
        out["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": rs.factor,
            "low_freq_factor": rs.low_freq_factor,
            "high_freq_factor": rs.high_freq_factor,
            "original_max_position_embeddings": rs.original_max_position_embeddings,
        }
    return out


def hf_tensors(model: Transformer) -> dict[str, torch.Tensor]:
    """Every weight under its HF name, split out of the fused q/k/v and gate/up matrices."""
    cfg = model.cfg
    q, kv = cfg.q_size, cfg.kv_size
    out: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": model.embed,
        "model.norm.weight": model.final_norm,
    }
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = model.lm_head
    for i, layer in enumerate(model.layers):
        assert isinstance(layer, DecoderLayer)
        pre, att = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        out[pre + "input_layernorm.weight"] = layer.input_norm
        out[pre + "post_attention_layernorm.weight"] = layer.post_attn_norm
        for name, part in zip("qkv", layer.w_qkv.split([q, kv, kv]), strict=True):
            out[att + f"{name}_proj.weight"] = part
        if layer.b_qkv is not None:
            for name, part in zip("qkv", layer.b_qkv.split([q, kv, kv]), strict=True):
                out[att + f"{name}_proj.bias"] = part
        if layer.q_norm is not None and layer.k_norm is not None:
            out[att + "q_norm.weight"] = layer.q_norm
            out[att + "k_norm.weight"] = layer.k_norm
        out[att + "o_proj.weight"] = layer.w_o
        gate, up = layer.w_gate_up.chunk(2, dim=0)
        out[pre + "mlp.gate_proj.weight"] = gate
        out[pre + "mlp.up_proj.weight"] = up
        out[pre + "mlp.down_proj.weight"] = layer.w_down
    return out


def write_tokenizer(src: Path, out: Path, vocab_size: int) -> None:
    """Save the HF tokenizer of folder ``src`` into ``out``, padded to ``vocab_size`` ids."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(src), local_files_only=True)
    missing = vocab_size - len(tok)
    if missing > 0:
        tok.add_tokens([f"<extra_{i}>" for i in range(missing)], special_tokens=False)
    tok.save_pretrained(str(out))


def write_hf_dir(model: Transformer, out: Path, tokenizer: Path | None = None) -> Path:
    """Write ``model`` (and the tokenizer of folder ``tokenizer``) as a HF directory ``out``."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config(model.cfg, model.dtype), indent=2))
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in hf_tensors(model).items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = t.detach().to("cpu").contiguous()
        size += nbytes
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map |= {name: fname for name in shard}
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    if tokenizer is not None:
        write_tokenizer(tokenizer, out, model.cfg.vocab_size)
    return out
