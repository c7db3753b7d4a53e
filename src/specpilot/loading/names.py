"""The tensor names every loader returns: Hugging Face's, whatever the file format was.

One naming scheme means the networks load a HF directory and a GGUF through the same code, and
tests can compare the two tensor by tensor.
"""

from __future__ import annotations

from collections.abc import Mapping

from specpilot.config import ModelConfig


def expected_tensor_names(cfg: ModelConfig) -> list[str]:
    """HF names of every tensor a model of ``cfg`` needs; ``lm_head.weight`` only when untied."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        names += [p + f"self_attn.{x}_proj.weight" for x in ("q", "k", "v", "o")]
        if cfg.attention_bias:
            names += [p + f"self_attn.{x}_proj.bias" for x in ("q", "k", "v")]
        if cfg.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
    return names


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of each tensor in ``expected_tensor_names`` (HF layout: ``[out_features, in_features]``)."""
    h, i, v, d = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    per_layer = {
        "self_attn.q_proj.weight": (cfg.q_size, h),
        "self_attn.k_proj.weight": (cfg.kv_size, h),
        "self_attn.v_proj.weight": (cfg.kv_size, h),
        "self_attn.o_proj.weight": (h, cfg.q_size),
        "self_attn.q_proj.bias": (cfg.q_size,),
        "self_attn.k_proj.bias": (cfg.kv_size,),
        "self_attn.v_proj.bias": (cfg.kv_size,),
        "self_attn.q_norm.weight": (d,),
        "self_attn.k_norm.weight": (d,),
        "mlp.gate_proj.weight": (i, h),
        "mlp.up_proj.weight": (i, h),
        "mlp.down_proj.weight": (h, i),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
    }
    shapes: dict[str, tuple[int, ...]] = {}
    for name in expected_tensor_names(cfg):
        if name.startswith("model.layers."):
            shapes[name] = per_layer[name.split(".", 3)[3]]
        elif name == "model.norm.weight":
            shapes[name] = (h,)
        else:  # embed_tokens, lm_head
            shapes[name] = (v, h)
    return shapes


def check_tensors(cfg: ModelConfig, tensors: Mapping[str, object], where: str) -> None:
    """Raise CheckpointError naming ``where`` if a needed tensor is missing or misshapen."""
    from specpilot.errors import CheckpointError

    for name, shape in expected_shapes(cfg).items():
        t = tensors.get(name)
        if t is None:
            raise CheckpointError(
                f"{where} has no tensor {name}, which this {cfg.arch} config needs."
            )
        got = tuple(getattr(t, "shape", ()))
        if got != shape:
            raise CheckpointError(
                f"{where}: tensor {name} has shape {list(got)}, but the config implies {list(shape)}."
            )
