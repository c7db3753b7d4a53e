"""The target forward cut into the cost model's components, as closures over the model's weights.

Each closure runs one component **for every layer** at the shapes of a forward of ``T`` tokens at
context ``L`` (batch 1), with the same ops the engine runs, so its time is the component's share
of a real forward. Two code paths, as the engines have two:

* ``eager``  — the ops of :class:`~specpilot.models.transformer.Transformer.forward` (the
  :class:`~specpilot.engine.SpecEngine` path; on the CPU one-row products use the ``[in, out]``
  copies, as the model does);
* ``static`` — the ops of :class:`~specpilot.models.static_forward.StaticForward` (the
  CUDA-graph engine's path: fused Triton norm / RoPE / SiLU kernels on CUDA, residual in the
  GEMM, a fixed attention bucket with an additive mask).

Inputs are random activations of the right shapes; only the weights are the model's. What a full
forward costs beyond the sum of its components (mask and position set-up, views, Python) is the
forward's ``overhead``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from specpilot.kernels import reference
from specpilot.models.rope import apply_rope
from specpilot.models.static_forward import StaticForward, attention_mask
from specpilot.models.transformer import DecoderLayer, Transformer, project, rms_norm

Thunk = Callable[[], object]


@dataclass(slots=True)
class ForwardPieces:
    """Closures for one forward shape: ``components[name]()`` and the whole ``forward()``."""

    tokens: int
    context: int
    attn_len: int
    """Keys attention reads (``context + tokens``; the static path rounds up to its bucket)."""
    components: dict[str, Thunk]
    forward: Thunk


def _layers(model: Transformer) -> list[DecoderLayer]:
    return [lyr for lyr in model.layers if isinstance(lyr, DecoderLayer)]


def _random(shape: tuple[int, ...], model: Transformer, gen: torch.Generator) -> Tensor:
    return (0.5 * torch.randn(shape, generator=gen)).to(device=model.device, dtype=model.dtype)


def eager_pieces(model: Transformer, tokens: int, context: int, seed: int = 0) -> ForwardPieces:
    """Components of ``Transformer.forward_argmax`` for ``[1, tokens]`` at ``context``."""
    cfg, dev, t, lctx = model.cfg, model.device, tokens, context
    gen = torch.Generator().manual_seed(seed)
    s = lctx + t
    cache = model.allocate_cache(1, s)
    for kc, vc in zip(cache.k, cache.v, strict=True):
        kc.copy_(_random(tuple(kc.shape), model, gen))
        vc.copy_(_random(tuple(vc.shape), model, gen))
    cache.commit(0, lctx)
    ids = torch.randint(cfg.vocab_size, (1, t), generator=gen).to(dev)  # [1, T]
    x = _random((1, t, cfg.hidden_size), model, gen)  # [1, T, hidden]
    pos = torch.arange(lctx, s, device=dev)
    cos, sin = model.rope_cos[pos][None, :, None], model.rope_sin[pos][None, :, None]  # [1,T,1,D]
    q_in = _random((1, cfg.num_heads, t, cfg.head_dim), model, gen)  # [1, H, T, D]
    kv_new = _random((1, t, cfg.num_kv_heads, cfg.head_dim), model, gen)  # [1, T, H_kv, D]
    attn_out = _random((1, t, cfg.q_size), model, gen)  # [1, T, q]
    start = torch.tensor([lctx], device=dev)
    mask = Transformer._mask(start, t, s, None) if t > 1 and lctx > 0 else None
    causal = t > 1 and lctx == 0
    logits = _random((1, t, cfg.vocab_size), model, gen)  # [1, T, vocab]
    layers = _layers(model)
    eps = cfg.rms_norm_eps

    def embedding() -> object:
        return F.embedding(ids, model.embed)

    def attn_proj() -> object:
        for layer in layers:
            hn = rms_norm(x, layer.input_norm, eps)
            qkv = project(hn, layer.w_qkv, layer.b_qkv, layer.gemv.get("w_qkv"))
            q, k, _ = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
            q = q.view(1, t, cfg.num_heads, cfg.head_dim)
            k = k.view(1, t, cfg.num_kv_heads, cfg.head_dim)
            if layer.q_norm is not None and layer.k_norm is not None:
                q = rms_norm(q, layer.q_norm, eps)
                k = rms_norm(k, layer.k_norm, eps)
            apply_rope(q, cos, sin)
            apply_rope(k, cos, sin)
            _ = x + project(attn_out, layer.w_o, None, layer.gemv.get("w_o"))
        return None

    def attn_kv() -> object:
        for kc, vc in zip(cache.k, cache.v, strict=True):
            kc[0, :, lctx:s] = kv_new[0].transpose(0, 1)
            vc[0, :, lctx:s] = kv_new[0].transpose(0, 1)
            F.scaled_dot_product_attention(
                q_in,
                kc[:, :, :s],
                vc[:, :, :s],
                attn_mask=mask,
                is_causal=causal,
                enable_gqa=cfg.num_heads != cfg.num_kv_heads,
            ).transpose(1, 2).reshape(1, t, cfg.q_size)
        return None

    def mlp() -> object:
        for layer in layers:
            hn = rms_norm(x, layer.post_attn_norm, eps)
            gate, up = project(hn, layer.w_gate_up, None, layer.gemv.get("w_gate_up")).chunk(
                2, dim=-1
            )
            _ = x + project(F.silu(gate) * up, layer.w_down, None, layer.gemv.get("w_down"))
        return None

    def lm_head() -> object:
        hn = rms_norm(x, model.final_norm, eps)
        return project(hn, model.lm_head, None, model.lm_head_in_out)

    def argmax() -> object:
        return logits.argmax(dim=-1)

    def forward() -> object:
        return model.forward_argmax(ids, cache)  # writes K/V past the committed length only

    comps: dict[str, Thunk] = {
        "embedding": embedding,
        "attn_proj": attn_proj,
        "attn_kv": attn_kv,
        "mlp": mlp,
        "lm_head": lm_head,
        "argmax": argmax,
    }
    return ForwardPieces(t, lctx, s, comps, forward)


def static_pieces(
    model: Transformer, tokens: int, context: int, attn_bucket: int = 128, seed: int = 0
) -> ForwardPieces:
    """Components of ``StaticForward`` (+ argmax) for ``[1, tokens]`` at ``context``."""
    cfg, dev, t, lctx = model.cfg, model.device, tokens, context
    fwd = StaticForward(model)
    gen = torch.Generator().manual_seed(seed)
    attn_len = -(-(lctx + t) // attn_bucket) * attn_bucket
    cache = model.allocate_cache(1, attn_len)
    for kc, vc in zip(cache.k, cache.v, strict=True):
        kc.copy_(_random(tuple(kc.shape), model, gen))
        vc.copy_(_random(tuple(vc.shape), model, gen))
    start = torch.tensor([lctx], device=dev)
    positions = start + torch.arange(t, device=dev)  # [T]
    groups = cfg.num_heads // cfg.num_kv_heads
    mask = attention_mask(start, t, attn_len, groups, model.dtype)  # [1, 1, G*T, S]
    ids = torch.randint(cfg.vocab_size, (1, t), generator=gen).to(dev)  # [1, T]
    x2 = _random((t, cfg.hidden_size), model, gen)  # [M, hidden]
    q_in = _random((1, cfg.num_kv_heads, groups * t, cfg.head_dim), model, gen)  # [1,Hkv,G*T,D]
    attn_out = _random((t, cfg.q_size), model, gen)  # [M, q]
    act = _random((t, cfg.intermediate_size), model, gen)  # [M, I]
    logits = _random((t, cfg.vocab_size), model, gen)  # [M, vocab]
    layers = _layers(model)
    kern = fwd._k  # fused Triton kernels on CUDA, None on the CPU

    def embedding() -> object:
        return F.embedding(ids, model.embed)

    def attn_proj() -> object:
        for i, layer in enumerate(layers):
            hn = fwd.norm(x2, layer.input_norm)
            qkv = fwd.linear(layer, "w_qkv", hn, layer.b_qkv)  # [M, q + 2kv]
            fwd.rope_write(qkv, cfg.num_heads, layer, cache.k[i], cache.v[i], positions, 1)
            fwd.linear_residual(x2, attn_out, layer, "w_o")
        return None

    def attn_kv() -> object:
        for kc, vc in zip(cache.k, cache.v, strict=True):
            F.scaled_dot_product_attention(q_in, kc, vc, attn_mask=mask)
        return None

    def mlp() -> object:
        for layer in layers:
            hn = fwd.norm(x2, layer.post_attn_norm)
            gate_up = fwd.linear(layer, "w_gate_up", hn)  # [M, 2I]
            kern.silu_mul(gate_up) if kern is not None else reference.silu_mul_ref(gate_up)
            fwd.linear_residual(x2, act, layer, "w_down")
        return None

    def lm_head() -> object:
        return fwd.logits(x2)

    def argmax() -> object:
        return logits.argmax(dim=-1)

    def forward() -> object:
        return fwd(ids, cache, start, attn_len).argmax(dim=-1)

    comps: dict[str, Thunk] = {
        "embedding": embedding,
        "attn_proj": attn_proj,
        "attn_kv": attn_kv,
        "mlp": mlp,
        "lm_head": lm_head,
        "argmax": argmax,
    }
    return ForwardPieces(t, lctx, attn_len, comps, forward)
