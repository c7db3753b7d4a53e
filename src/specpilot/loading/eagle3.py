"""EAGLE-3 checkpoints: config.json + safetensors as SpecForge, SafeAILab/EAGLE and sglang
publish them (``LlamaForCausalLMEagle3``; never pickle).

``config.json``: ``architectures`` ``["LlamaForCausalLMEagle3"]``, the Llama keys of the one
midlayer (``hidden_size``, ``intermediate_size``, ``num_hidden_layers`` = 1,
``num_attention_heads``, ``num_key_value_heads``, optional ``head_dim``, ``rms_norm_eps``,
``rope_theta``, ``rope_scaling``, ``max_position_embeddings``), ``vocab_size`` (the target's),
``draft_vocab_size`` (None: the full vocabulary), optional ``target_hidden_size`` and the target
layers ``eagle_config.eagle_aux_hidden_state_layer_ids`` (also read at the top level). Those ids
are layer outputs, as sglang reads them (it captures the input of layer ``id + 1``); without
them EAGLE-3's default, HF ``hidden_states[2, N//2, N-3]`` (``models/eagle3.py``).

Tensors (unprefixed; a ``model.`` prefix is accepted): ``fc.weight [H, 3·H_t]``,
``midlayer.{hidden_norm,input_layernorm,post_attention_layernorm}.weight [H]``,
``midlayer.self_attn.{q,k,v}_proj.weight [·, 2H]``, ``midlayer.self_attn.o_proj.weight``,
``midlayer.mlp.{gate,up,down}_proj.weight``, ``norm.weight``, ``lm_head.weight [Vd, H]``,
``d2t [Vd]`` (int: target id = d + d2t[d]), ``t2d [V]`` (bool). ``embed_tokens.weight`` is
ignored (the target's is used). A full-vocabulary drafter without ``lm_head`` / ``d2t`` uses the
target's head and the identity map, as sglang does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from specpilot.config import ModelConfig
from specpilot.errors import CheckpointError, IncompatibleDrafterError
from specpilot.models.eagle3 import Eagle3Net, Eagle3Spec, default_aux_layers
from specpilot.models.transformer import Transformer

ARCHITECTURE = "LlamaForCausalLMEagle3"
MAPS = ("d2t", "t2d")


def aux_layer_ids(cfg: dict[str, Any]) -> list[int] | None:
    """``eagle_config.eagle_aux_hidden_state_layer_ids``, else the top-level key, else None."""
    inner = cfg.get("eagle_config") or {}
    ids = inner.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    return None if ids is None else [int(i) for i in ids]


def spec_from_config(
    cfg: dict[str, Any], num_target_layers: int, where: str = "config.json"
) -> Eagle3Spec:
    """Parse an EAGLE-3 config.json (default layers from the target's ``num_target_layers``);
    one sentence naming ``where`` on anything it cannot use."""
    archs = cfg.get("architectures") or []
    if ARCHITECTURE not in archs:
        raise CheckpointError(
            f"{where} names architectures {archs}, not {ARCHITECTURE}; it is not an EAGLE-3 "
            "checkpoint."
        )
    try:
        if int(cfg.get("num_hidden_layers", 1)) != 1:
            raise ValueError(f"{cfg['num_hidden_layers']} layers (EAGLE-3 has one midlayer)")
        for key in ("attention_bias", "mlp_bias", "bias", "tie_word_embeddings"):
            if cfg.get(key):
                raise ValueError(f"{key} (no published EAGLE-3 drafter has it)")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg['hidden_act']!r} (only silu is supported)")
        rope = cfg.get("rope_scaling") or {}
        if str(rope.get("rope_type", rope.get("type", "default"))) not in ("default", "llama3"):
            raise ValueError(f"RoPE type {rope.get('rope_type')!r} (default or llama3 only)")
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        vocab = int(cfg["vocab_size"])
        layer = ModelConfig.from_hf(
            {**cfg, "model_type": "llama", "num_hidden_layers": 1, "attention_bias": False,
             "tie_word_embeddings": False, "head_dim": int(cfg.get("head_dim") or hidden // heads)},
            where,
        )  # fmt: skip
        ids = aux_layer_ids(cfg) or default_aux_layers(num_target_layers)
        return Eagle3Spec(
            layer=layer,
            aux_layer_ids=tuple(ids),
            draft_vocab_size=int(cfg.get("draft_vocab_size") or vocab),
            target_hidden_size=int(cfg.get("target_hidden_size") or hidden),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{where} is not a usable EAGLE-3 config ({e}).") from None


def expected_shapes(spec: Eagle3Spec) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of ``spec`` holds, by its published (unprefixed) name."""
    c = spec.layer
    h, q, kv, i = c.hidden_size, c.q_size, c.kv_size, c.intermediate_size
    m, a = "midlayer.", "midlayer.self_attn."
    return {
        "fc.weight": (h, 3 * spec.target_hidden_size),
        m + "hidden_norm.weight": (h,), m + "input_layernorm.weight": (h,),
        m + "post_attention_layernorm.weight": (h,),
        a + "q_proj.weight": (q, 2 * h), a + "k_proj.weight": (kv, 2 * h),
        a + "v_proj.weight": (kv, 2 * h), a + "o_proj.weight": (h, q),
        m + "mlp.gate_proj.weight": (i, h), m + "mlp.up_proj.weight": (i, h),
        m + "mlp.down_proj.weight": (h, i),
        "norm.weight": (h,),
        "lm_head.weight": (spec.draft_vocab_size, h),
        "d2t": (spec.draft_vocab_size,), "t2d": (spec.vocab_size,),
    }  # fmt: skip


def _full_vocab(spec: Eagle3Spec) -> bool:
    return spec.draft_vocab_size == spec.vocab_size


def _names(root: Path) -> dict[str, tuple[Path, str, tuple[int, ...]]]:
    """Published name → (shard, stored name, shape), from the safetensors headers only."""
    from safetensors import SafetensorError, safe_open

    from specpilot.loading.hf import _shard_files

    out: dict[str, tuple[Path, str, tuple[int, ...]]] = {}
    for shard in _shard_files(root):
        try:
            with safe_open(str(shard), framework="pt") as f:
                for n in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    out[n.removeprefix("model.")] = (shard, n, tuple(f.get_slice(n).get_shape()))
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            raise CheckpointError(f"{shard} is truncated or corrupt ({e}).") from None
    return out


def check_compatible(
    spec: Eagle3Spec, target: ModelConfig, where: str, shapes: dict[str, tuple[int, ...]]
) -> None:
    """One sentence, before any weight is read, for a drafter trained for another target;
    ``shapes``: published name → stored shape (the vocabulary maps are checked by theirs)."""
    n = target.num_layers

    def no(why: str) -> IncompatibleDrafterError:
        return IncompatibleDrafterError(f"The EAGLE-3 drafter {where} {why}; give a drafter "
                                        "trained for this target.")  # fmt: skip

    if spec.vocab_size != target.vocab_size:
        raise no(
            f"has a vocabulary of {spec.vocab_size} tokens, the target one of {target.vocab_size}"
        )
    if "t2d" in shapes and shapes["t2d"] != (target.vocab_size,):
        raise no(f"maps a vocabulary of {list(shapes['t2d'])} tokens (t2d), the target has "
                 f"{target.vocab_size}")  # fmt: skip
    if "d2t" in shapes and shapes["d2t"] != (spec.draft_vocab_size,):
        raise no(f"has d2t of shape {list(shapes['d2t'])} for a draft vocabulary of "
                 f"{spec.draft_vocab_size}")  # fmt: skip
    if spec.hidden_size != target.hidden_size:
        raise no(f"has hidden size {spec.hidden_size}, the target {target.hidden_size}")
    if spec.target_hidden_size != target.hidden_size:
        raise no(f"reads target features of width {spec.target_hidden_size}, the target's are "
                 f"{target.hidden_size}")  # fmt: skip
    bad = [i for i in spec.aux_layer_ids if not 0 <= i < n]
    if bad:
        raise no(f"reads target layers {bad}, but the target has layers 0..{n - 1}")


def read_eagle3_dir(root: Path, target: ModelConfig) -> tuple[Eagle3Spec, dict[str, Tensor]]:
    """Parse and check a checkpoint directory (config, compatibility, tensor names and shapes),
    then read its tensors."""
    from specpilot.loading.hf import _read_json, _read_shard

    root = root.expanduser()
    if not root.is_dir():
        raise CheckpointError(f"EAGLE-3 checkpoint directory {root} does not exist.")
    where = root / "config.json"
    if not where.is_file():
        raise CheckpointError(
            f"{root} has no config.json; --draft-model must name an EAGLE-3 checkpoint directory."
        )
    spec = spec_from_config(_read_json(where), target.num_layers, str(where))
    stored = _names(root)
    check_compatible(spec, target, str(root), {n: s[2] for n, s in stored.items()})
    want = expected_shapes(spec)
    optional = {"lm_head.weight", *MAPS} if _full_vocab(spec) else set()
    for name, shape in want.items():
        got = stored.get(name)
        if got is None:
            if name in optional:
                continue
            raise CheckpointError(f"{root} has no tensor {name}, which its EAGLE-3 config needs.")
        if got[2] != shape:
            raise CheckpointError(
                f"{root}: tensor {name} has shape {list(got[2])}, but the config implies "
                f"{list(shape)}."
            )
    tensors: dict[str, Tensor] = {}
    for shard in {s[0] for n, s in stored.items() if n in want}:
        wanted = {s[1] for n, s in stored.items() if n in want and s[0] == shard}
        tensors |= {n.removeprefix("model."): t for n, t in _read_shard(shard, wanted).items()}
    return spec, tensors


def weight_pairs(net: Eagle3Net) -> list[tuple[Tensor, list[str]]]:
    """Each of ``net``'s matrices (the lm_head aside) and the published tensors fused into it,
    in row order (what the loader concatenates and the writer splits back)."""
    a, m = "midlayer.self_attn.", "midlayer."
    layer = net.midlayer
    return [
        (net.fc, ["fc.weight"]),
        (layer.input_norm, [m + "hidden_norm.weight"]),
        (net.embed_norm, [m + "input_layernorm.weight"]),
        (layer.post_attn_norm, [m + "post_attention_layernorm.weight"]),
        (layer.w_qkv, [a + f"{x}_proj.weight" for x in "qkv"]),
        (layer.w_o, [a + "o_proj.weight"]),
        (layer.w_gate_up, [m + "mlp.gate_proj.weight", m + "mlp.up_proj.weight"]),
        (layer.w_down, [m + "mlp.down_proj.weight"]),
        (net.final_norm, ["norm.weight"]),
    ]


def load_eagle3(
    path: str | Path, target: Transformer, dtype: torch.dtype | None = None
) -> Eagle3Net:
    """The network of checkpoint ``path`` on ``target``'s device (in its dtype by default)."""
    root = Path(path).expanduser()
    spec, t = read_eagle3_dir(root, target.cfg)
    net = Eagle3Net(spec, target, dtype)
    with torch.no_grad():
        for dst, names in weight_pairs(net):
            dst.copy_(torch.cat([t[n] for n in names], dim=0))
        head = t.get("lm_head.weight")
        net.draft_head.copy_(head if head is not None else target.lm_head)
    d2t = t.get("d2t", torch.zeros(spec.draft_vocab_size, dtype=torch.int64)).to(torch.int64)
    ids = torch.arange(spec.draft_vocab_size) + d2t  # [Vd] target ids
    if not bool(((ids >= 0) & (ids < spec.vocab_size)).all()):
        raise CheckpointError(f"{root}: d2t maps draft ids outside the target's vocabulary.")
    net.set_vocab(d2t.to(net.d2t.device))
    return net


__all__ = [
    "check_compatible",
    "load_eagle3",
    "read_eagle3_dir",
    "spec_from_config",
    "weight_pairs",
]
