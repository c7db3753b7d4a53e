"""DFlash / DFlash2 checkpoints: config.json + safetensors as z-lab publishes them (never pickle).

``config.json``: ``architectures`` ``["DFlashDraftModel"]`` or ``["DFlash2DraftModel"]``, the
Qwen3 keys of the drafter's layers (``hidden_size``, ``intermediate_size``,
``num_hidden_layers``, heads, ``head_dim``, ``rms_norm_eps``, ``rope_theta`` or
``rope_parameters``, ``attention_bias``, ``layer_types``, ``sliding_window``, ``is_causal``),
``num_target_layers``, ``block_size`` and ``dflash_config {mask_token_id, target_layer_ids,
block_size, ...}``; a key is looked up in ``dflash_config`` first, then at the top level, as
z-lab's model does. DFlash2 adds ``conv_kernel_size``, ``conv_group_size``, ``selector_rank``
and ``selector_top_k``; optional ``output_multiplier``, ``final_logit_softcapping`` and
``input_embedding_scale``.

Tensors (unprefixed; a ``model.`` prefix is accepted): ``fc.weight [H, n·H]``,
``hidden_norm.weight``, ``norm.weight``, per layer ``layers.i.self_attn.{q,k,v,o}_proj.weight``,
``layers.i.self_attn.{q,k}_norm.weight``, ``layers.i.mlp.{gate,up,down}_proj.weight``,
``layers.i.{input,post_attention}_layernorm.weight``; DFlash2 also
``layers.i.{attention,mlp}_conv.base_kernel [2, K, H]`` and ``.kernel_projection.weight``, and
``candidate_selector.hidden_projection.weight [r, H]`` with the two codebooks ``[V, r]`` stored
without ``.weight``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from specpilot.config import ModelConfig
from specpilot.errors import CheckpointError, IncompatibleDrafterError
from specpilot.models.dflash import KINDS, DFlashNet, DFlashSpec, default_target_layers
from specpilot.models.transformer import Transformer

ARCHITECTURES = {"DFlashDraftModel": "dflash", "DFlash2DraftModel": "dflash2"}
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def _draft_value(cfg: dict[str, Any], name: str, default: Any = None) -> Any:
    """``dflash_config[name]``, else ``cfg[name]``, else ``default`` (z-lab's lookup order)."""
    inner = cfg.get("dflash_config") or {}
    if name in inner and inner[name] is not None:
        return inner[name]
    value = cfg.get(name)
    return default if value is None else value


def _layer_types(cfg: dict[str, Any], n: int) -> tuple[tuple[bool, ...], tuple[int | None, ...]]:
    """(causal, window) per layer. Without ``layer_types``, Qwen3's rule: layers from
    ``max_window_layers`` on slide when ``use_sliding_window`` is set."""
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if not types:
        slide = bool(cfg.get("use_sliding_window")) and window is not None
        first = int(cfg.get("max_window_layers", 28))
        types = [
            "sliding_attention" if slide and i >= first else "full_attention" for i in range(n)
        ]
    if len(types) != n or any(t not in ("full_attention", "sliding_attention") for t in types):
        raise ValueError(f"layer_types must list {n} of full_attention / sliding_attention")
    forced = cfg.get("is_causal")
    causal = tuple(t == "sliding_attention" if forced is None else bool(forced) for t in types)
    windows = tuple(int(window) if t == "sliding_attention" and window else None for t in types)
    return causal, windows


def spec_from_config(cfg: dict[str, Any], where: str = "config.json") -> DFlashSpec:
    """Parse a DFlash config.json; one sentence naming ``where`` on anything it cannot use."""
    archs = cfg.get("architectures") or []
    kinds = [ARCHITECTURES[a] for a in archs if a in ARCHITECTURES]
    if not kinds:
        raise CheckpointError(
            f"{where} names architectures {archs}, not DFlashDraftModel or DFlash2DraftModel; "
            "it is not a DFlash checkpoint."
        )
    try:
        if cfg.get("attention_bias"):
            raise ValueError("attention_bias (no published DFlash drafter has it)")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg['hidden_act']!r} (only silu is supported)")
        n = int(cfg["num_hidden_layers"])
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if str(rope.get("rope_type", rope.get("type", "default"))) not in ("default", "llama3"):
            raise ValueError(f"RoPE type {rope.get('rope_type')!r} (default or llama3 only)")
        hf = {
            **cfg,
            "model_type": "qwen3",
            "vocab_size": int(cfg.get("vocab_size") or 1),
            "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
            "tie_word_embeddings": False,
            "attention_bias": False,
            "head_dim": int(cfg.get("head_dim") or hidden // heads),
        }
        layers = ModelConfig.from_hf(hf)
        ids = _draft_value(cfg, "target_layer_ids")
        n_target = cfg.get("num_target_layers")
        if ids is None:
            if n_target is None:
                raise ValueError("neither target_layer_ids nor num_target_layers")
            ids = default_target_layers(int(n_target), n)
        mask = _draft_value(cfg, "mask_token_id")
        if mask is None:
            raise ValueError("no mask_token_id")
        causal, windows = _layer_types(cfg, n)
        softcap = _draft_value(cfg, "final_logit_softcapping")
        return DFlashSpec(
            kind=kinds[0],
            layers=layers,
            target_layer_ids=tuple(int(i) for i in ids),
            block_size=int(_draft_value(cfg, "block_size", 16)),
            mask_token_id=int(mask),
            layer_causal=causal,
            layer_window=windows,
            num_target_layers=None if n_target is None else int(n_target),
            output_multiplier=float(_draft_value(cfg, "output_multiplier", 1.0)),
            logit_softcap=None if softcap is None else float(softcap),
            input_embedding_scale=float(_draft_value(cfg, "input_embedding_scale", 1.0)),
            conv_kernel_size=int(_draft_value(cfg, "conv_kernel_size", 0)),
            conv_group_size=int(_draft_value(cfg, "conv_group_size", 0)),
            selector_rank=int(_draft_value(cfg, "selector_rank", 0)),
            selector_top_k=int(_draft_value(cfg, "selector_top_k", 0)),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{where} is not a usable DFlash config ({e}).") from None


def block_size_of(path: Path) -> int:
    """The block size a checkpoint directory's config.json names (16 when it names none)."""
    from specpilot.loading.hf import _read_json

    where = path.expanduser() / "config.json"
    if not where.is_file():
        raise CheckpointError(
            f"{path} has no config.json; --draft-model must name a DFlash checkpoint directory."
        )
    return int(_draft_value(_read_json(where), "block_size", 16))


def expected_shapes(spec: DFlashSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of ``spec`` holds, by its published (unprefixed) name."""
    c = spec.layers
    h, q, kv, i, d = c.hidden_size, c.q_size, c.kv_size, c.intermediate_size, c.head_dim
    out: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, len(spec.target_layer_ids) * h),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
    }
    per = {
        "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
        "self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,),
        "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i),
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
    }  # fmt: skip
    if spec.conv_kernel_size:
        kk, groups = spec.conv_kernel_size, h // spec.conv_group_size
        for conv in ("attention_conv", "mlp_conv"):
            per[f"{conv}.base_kernel"] = (2, kk, h)
            per[f"{conv}.kernel_projection.weight"] = (2 * kk * groups, h)
    for li in range(c.num_layers):
        out |= {f"layers.{li}.{name}": shape for name, shape in per.items()}
    if spec.selector_rank:
        r, v = spec.selector_rank, c.vocab_size
        out["candidate_selector.hidden_projection.weight"] = (r, h)
        out["candidate_selector.predecessor_codebook"] = (v, r)
        out["candidate_selector.successor_codebook"] = (v, r)
    return out


def _canonical(name: str) -> str:
    name = name.removeprefix("model.")
    for cb in ("predecessor_codebook", "successor_codebook"):
        if name == f"candidate_selector.{cb}.weight":
            return f"candidate_selector.{cb}"
    return name


def read_dflash_dir(path: str | Path) -> tuple[DFlashSpec, dict[str, Tensor]]:
    """Parse a checkpoint directory; every tensor checked against the config's shapes."""
    from specpilot.loading.hf import _read_json, _read_shard, _shard_files

    root = Path(path).expanduser()
    if not (root / "config.json").is_file():
        raise CheckpointError(
            f"{root} has no config.json; --draft-model must name a DFlash checkpoint directory."
        )
    spec = spec_from_config(_read_json(root / "config.json"), str(root / "config.json"))
    want = expected_shapes(spec)
    tensors: dict[str, Tensor] = {}
    for shard in _shard_files(root):
        from safetensors import safe_open

        with safe_open(str(shard), framework="pt") as f:
            names = {_canonical(n): n for n in f.keys()}  # noqa: SIM118
        got = _read_shard(shard, {names[n] for n in names if n in want})
        tensors |= {_canonical(n): t for n, t in got.items()}
    for name, shape in want.items():
        t = tensors.get(name)
        if t is None:
            raise CheckpointError(
                f"{root} has no tensor {name}, which its {spec.kind} config needs."
            )
        if tuple(t.shape) != shape:
            raise CheckpointError(
                f"{root}: tensor {name} has shape {list(t.shape)}, but the config implies "
                f"{list(shape)}."
            )
    return spec, tensors


def check_compatible(spec: DFlashSpec, target: ModelConfig, where: str) -> None:
    """One sentence, before any slow work, for a drafter trained for another target."""
    n = target.num_layers

    def no(why: str) -> IncompatibleDrafterError:
        return IncompatibleDrafterError(f"The DFlash drafter {where} {why}; give a drafter "
                                        "trained for this target.")  # fmt: skip

    if spec.vocab_size not in (1, target.vocab_size):
        raise no(
            f"has a vocabulary of {spec.vocab_size} tokens, the target one of {target.vocab_size}"
        )
    if spec.hidden_size != target.hidden_size:
        raise no(f"has hidden size {spec.hidden_size}, the target {target.hidden_size}")
    bad = [i for i in spec.target_layer_ids if not 0 <= i < n]
    if bad:
        raise no(f"reads target layers {bad}, but the target has layers 0..{n - 1}")
    if spec.num_target_layers is not None and spec.num_target_layers != n:
        raise no(f"was trained on a target of {spec.num_target_layers} layers, not {n}")
    if not 0 <= spec.mask_token_id < target.vocab_size:
        raise no(f"uses mask token {spec.mask_token_id}, outside the target's vocabulary")


def load_dflash(
    path: str | Path, target: Transformer, kind: str | None = None, dtype: torch.dtype | None = None
) -> DFlashNet:
    """The network of checkpoint ``path`` on ``target``'s device (in its dtype by default)."""
    from specpilot.loading.hf import _read_json

    root = Path(path).expanduser()
    if not root.is_dir():
        raise CheckpointError(f"DFlash checkpoint directory {root} does not exist.")
    if (root / "config.json").is_file():  # the cheap checks first, before reading weights
        spec = spec_from_config(_read_json(root / "config.json"), str(root / "config.json"))
        if kind is not None and kind != spec.kind:
            raise CheckpointError(
                f"{root} is a {spec.kind} checkpoint; select it with --drafter {spec.kind}."
            )
        check_compatible(spec, target.cfg, str(root))
    spec, tensors = read_dflash_dir(root)
    if spec.vocab_size == 1:  # a config without vocab_size: the target's
        import dataclasses

        layers = dataclasses.replace(spec.layers, vocab_size=target.cfg.vocab_size)
        spec = dataclasses.replace(spec, layers=layers)
    net = DFlashNet(spec, target, dtype)
    load_tensors(net, tensors)
    return net


def _pairs(net: DFlashNet) -> list[tuple[str, Tensor, list[str]]]:
    """(destination, the published names whose concatenation fills it) for every weight."""
    out: list[tuple[str, Tensor, list[str]]] = [
        ("fc", net.fc, ["fc.weight"]),
        ("hidden_norm", net.hidden_norm, ["hidden_norm.weight"]),
        ("norm", net.final_norm, ["norm.weight"]),
    ]
    for li, layer in enumerate(net.decoder_layers()):
        p, a = f"layers.{li}.", f"layers.{li}.self_attn."
        out += [
            (p + "in", layer.input_norm, [p + "input_layernorm.weight"]),
            (p + "post", layer.post_attn_norm, [p + "post_attention_layernorm.weight"]),
            (a + "qkv", layer.w_qkv, [a + f"{x}_proj.weight" for x in "qkv"]),
            (a + "o", layer.w_o, [a + "o_proj.weight"]),
            (
                p + "gate_up",
                layer.w_gate_up,
                [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
            ),
            (p + "down", layer.w_down, [p + "mlp.down_proj.weight"]),
        ]
        assert layer.q_norm is not None and layer.k_norm is not None
        out += [(a + "qn", layer.q_norm, [a + "q_norm.weight"]),
                (a + "kn", layer.k_norm, [a + "k_norm.weight"])]  # fmt: skip
        for conv_name in ("attention_conv", "mlp_conv"):
            conv = getattr(layer, conv_name)
            if conv is not None:
                c = p + conv_name
                out += [(c + ".b", conv.base_kernel, [c + ".base_kernel"]),
                        (c + ".p", conv.kernel_projection, [c + ".kernel_projection.weight"])]  # fmt: skip
    sel = net.selector
    if sel is not None:
        s = "candidate_selector."
        out += [
            (s + "hp", sel.hidden_projection, [s + "hidden_projection.weight"]),
            (s + "pc", sel.predecessor_codebook, [s + "predecessor_codebook"]),
            (s + "sc", sel.successor_codebook, [s + "successor_codebook"]),
        ]
    return out


def load_tensors(net: DFlashNet, tensors: dict[str, Tensor]) -> None:
    """Copy published tensors in (cast to the network's dtype), fusing q/k/v and gate/up."""
    with torch.no_grad():
        for _, dst, names in _pairs(net):
            dst.copy_(torch.cat([tensors[n] for n in names], dim=0))


__all__ = [
    "KINDS",
    "check_compatible",
    "load_dflash",
    "read_dflash_dir",
    "spec_from_config",
]
