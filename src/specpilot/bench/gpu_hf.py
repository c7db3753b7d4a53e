"""HF transformers ``generate`` on the same synthetic weights, for side-by-side timings.

The HF model is built on the meta device and its parameters are *assigned* views of our tensors
(q/k/v and gate/up are row slices of our fused matrices), so it costs no extra device memory and
runs the very same weights. Only the rotary buffers are rebuilt on the device.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from specpilot.bench import hf_dir
from specpilot.config import ModelConfig
from specpilot.models.layer import DecoderLayer
from specpilot.models.transformer import Transformer
from specpilot.synthetic import DRAFT_MODEL_FOR_TARGET, build_draft_model


def hf_config(cfg: ModelConfig, dtype: torch.dtype) -> Any:
    """``cfg`` as a transformers config (from the same ``config.json`` ``bench/hf_dir.py`` writes)."""
    import transformers

    fields = dict(hf_dir.hf_config(cfg, dtype))
    return transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)


def hf_state_dict(model: Transformer) -> dict[str, Tensor]:
    """HF-named views of ``model``'s weights (the inverse of ``load_hf_state_dict``)."""
    cfg = model.cfg
    sd: dict[str, Tensor] = {
        "model.embed_tokens.weight": model.embed,
        "model.norm.weight": model.final_norm,
    }
    if not cfg.tie_word_embeddings:
        sd["lm_head.weight"] = model.lm_head
    split = [cfg.q_size, cfg.kv_size, cfg.kv_size]
    for i, layer in enumerate(model.layers):
        assert isinstance(layer, DecoderLayer)
        pre, att = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        sd[pre + "input_layernorm.weight"] = layer.input_norm
        sd[pre + "post_attention_layernorm.weight"] = layer.post_attn_norm
        for name, w in zip("qkv", layer.w_qkv.split(split), strict=True):
            sd[att + f"{name}_proj.weight"] = w
        if layer.b_qkv is not None:
            for name, bias in zip("qkv", layer.b_qkv.split(split), strict=True):
                sd[att + f"{name}_proj.bias"] = bias
        if layer.q_norm is not None and layer.k_norm is not None:
            sd[att + "q_norm.weight"] = layer.q_norm
            sd[att + "k_norm.weight"] = layer.k_norm
        sd[att + "o_proj.weight"] = layer.w_o
        gate, up = layer.w_gate_up.chunk(2)
        sd[pre + "mlp.gate_proj.weight"] = gate
        sd[pre + "mlp.up_proj.weight"] = up
        sd[pre + "mlp.down_proj.weight"] = layer.w_down
    return sd


def hf_model(model: Transformer) -> Any:
    """An HF ``*ForCausalLM`` sharing ``model``'s weights (no copy)."""
    from transformers import AutoModelForCausalLM

    config = hf_config(model.cfg, model.dtype)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config, dtype=model.dtype)
    missing, unexpected = hf.load_state_dict(hf_state_dict(model), strict=False, assign=True)
    missing = [m for m in missing if not (m == "lm_head.weight" and model.cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"HF weight mapping failed: missing {missing}, unexpected {unexpected}")
    if model.cfg.tie_word_embeddings:
        hf.lm_head.weight = hf.model.embed_tokens.weight
    rotary = hf.model.rotary_emb
    hf.model.rotary_emb = type(rotary)(hf.config).to(model.device)  # built off the meta device
    return hf.eval()


def hf_generate(
    hf: Any,
    prompt: Sequence[int],
    max_new_tokens: int,
    device: torch.device,
    **kwargs: Any,
) -> tuple[list[int], float]:
    """Greedy HF ``generate`` (no EOS); returns new tokens and seconds (prefill included)."""
    ids = torch.tensor([list(prompt)], device=device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            eos_token_id=None,
            pad_token_id=0,
            **kwargs,
        )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return [int(t) for t in out[0, ids.shape[1] :].tolist()], time.perf_counter() - t0


def prefix_agree(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def hf_side(
    target: Transformer,
    name: str,
    args: argparse.Namespace,
    prompt: list[int],
    ar_tokens: list[int],
    deadline: float,
) -> dict[str, Any]:
    """HF eager (and static-cache + compile, assisted) decode rates on the target's weights,
    for the GPU suite (``bench/gpu_suite.py``); each part skipped when the budget runs short."""
    dev, n = target.device, args.hf_tokens
    out: dict[str, Any] = {"new_tokens": n, "rate": "decode tok/s = (n-1)/(t(n) - t(1))"}
    hf = hf_model(target)
    hf_generate(hf, prompt, 2, dev)  # warm-up
    _, t1 = hf_generate(hf, prompt, 1, dev)
    toks, tn = hf_generate(hf, prompt, n, dev)
    out["eager_tok_s"] = (n - 1) / max(tn - t1, 1e-9)
    out["eager_agree_prefix_with_ours"] = prefix_agree(toks, ar_tokens)
    compile_shapes = [s for s in args.hf_compile_shapes.split(",") if s]
    if name in compile_shapes and dev.type == "cuda":
        if time.perf_counter() < deadline - 240:
            try:
                t0 = time.perf_counter()
                hf_generate(hf, prompt, n, dev, cache_implementation="static")
                out["static_compile_first_call_s"] = time.perf_counter() - t0
                _, t1 = hf_generate(hf, prompt, 1, dev, cache_implementation="static")
                toks, tn = hf_generate(hf, prompt, n, dev, cache_implementation="static")
                out["static_compile_tok_s"] = (n - 1) / max(tn - t1, 1e-9)
            except Exception as e:  # report, never abort the suite
                out["static_compile_error"] = f"{type(e).__name__}: {e}"[:400]
        else:
            out["static_compile_skipped"] = "time budget"
    draft_shape = DRAFT_MODEL_FOR_TARGET.get(name)
    if draft_shape and not args.no_assisted:
        if time.perf_counter() < deadline - 60:
            try:
                dtype = target.dtype
                draft = build_draft_model(
                    draft_shape, dev, dtype, max_positions=target.max_positions
                )
                hd = hf_model(draft)
                _, ta = hf_generate(hf, prompt, n, dev, assistant_model=hd)
                out["assisted_draft_shape"] = draft_shape
                out["assisted_tok_s_incl_prefill"] = n / ta
                out["assisted_note"] = "random draft weights: acceptance ~0, machinery cost only"
                del hd, draft
            except Exception as e:
                out["assisted_error"] = f"{type(e).__name__}: {e}"[:400]
        else:
            out["assisted_skipped"] = "time budget"
    del hf
    return out
