"""The target forward cut into the cost model's components, as closures over the engine's own
:class:`~specpilot.models.forward.Forward`.

Each closure runs one component **for every layer** at the shapes of a verify forward of ``T``
tokens at ``L`` committed KV entries (batch 1), with the pieces of the one layer body the engine
runs: fused Triton norm / RoPE + K/V write / SiLU·mul with the residual in the GEMM on CUDA, the
torch references on the CPU, a mechanism's kernel wherever one is installed in
``DecoderLayer.linear_fns``. The attention length follows the engine's runner: exact when eager,
rounded up to the attention bucket (an additive mask) when replayed from CUDA graphs.

* ``embedding`` — the token gather;
* ``attn_proj`` — input norm, QKV GEMM (+ bias), RoPE (+ q/k norm) with the K/V write and the
  query placement, O GEMM with the residual;
* ``attn_kv`` — attention over the cache as ``Forward.attend`` runs it (masked SDPA and the
  read-back of its rows, or the model's ``dense_attention`` kernel, e.g. split-KV);
* ``mlp`` — post-attention norm, gate/up GEMM, SiLU·mul, down GEMM with the residual;
* ``lm_head`` — final norm and LM head (with an ``argmax_head`` installed: that head, which
  includes the argmax, and no separate ``argmax``);
* ``argmax`` — the argmax over the logits.

The whole ``forward`` closure is the body of the engine's verify step (``Engine.run_verify``):
the layout built on the device, embedding, every layer, argmax into a persistent buffer. Inputs
are random activations of the right shapes; only the weights are the model's. What the whole
forward costs beyond the sum of its components (layout and mask set-up, views, Python) is the
forward's ``overhead``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from specpilot.models.forward import Forward
from specpilot.models.kv_cache import KVCache
from specpilot.models.layer import DecoderLayer
from specpilot.models.layout import DenseLayout
from specpilot.models.transformer import Transformer

Thunk = Callable[[], object]


@dataclass(slots=True)
class ForwardPieces:
    """Closures for one forward shape: ``components[name]()`` and the whole ``forward()``."""

    tokens: int
    context: int
    attn_len: int
    """Keys attention reads (``context + tokens``; rounded up to the bucket under graphs)."""
    components: dict[str, Thunk]
    forward: Thunk


def attention_length(tokens: int, context: int, graphs: bool, attn_bucket: int) -> int:
    """The attention length the engine uses for this forward (``Engine.bucket``)."""
    need = context + tokens
    return -(-need // attn_bucket) * attn_bucket if graphs else need


def random_cache(model: Transformer, slots: int, seed: int = 0) -> KVCache:
    """A one-row KV cache of ``slots`` slots filled with random K/V."""
    gen = torch.Generator().manual_seed(seed + 1)
    cache = model.allocate_cache(1, slots)
    for kc, vc in zip(cache.k, cache.v, strict=True):
        kc.copy_(_random(tuple(kc.shape), model, gen))
        vc.copy_(_random(tuple(vc.shape), model, gen))
    return cache


def _random(shape: tuple[int, ...], model: Transformer, gen: torch.Generator) -> Tensor:
    return (0.5 * torch.randn(shape, generator=gen)).to(device=model.device, dtype=model.dtype)


def forward_pieces(
    fwd: Forward,
    tokens: int,
    context: int,
    graphs: bool = False,
    attn_bucket: int = 128,
    seed: int = 0,
    cache: KVCache | None = None,
) -> ForwardPieces:
    """Components of a verify forward of ``[1, tokens]`` after ``context`` KV entries, run by
    ``fwd`` as the engine runs it (``graphs``: the engine replays CUDA graphs, so the attention
    length is bucketed and the layout is built without host-known lengths). ``cache``: a
    one-row KV cache to attend over (the engine's is as long as its slots, and attention reads
    a slice of it); default: one of exactly the attention length, filled with random K/V.
    Pieces write only slots ``context ..``, so pieces of several widths can share one."""
    model, cfg = fwd.model, fwd.cfg
    dev, t, lctx = model.device, tokens, context
    if tokens < 1 or context < 0:
        raise ValueError(f"need tokens >= 1 and context >= 0, got {tokens} and {context}")
    if context + tokens > model.max_positions:
        raise ValueError(
            f"context {context} + {tokens} tokens beyond the RoPE table ({model.max_positions})"
        )
    gen = torch.Generator().manual_seed(seed)
    attn_len = attention_length(t, lctx, graphs, attn_bucket)
    if cache is None:
        cache = random_cache(model, attn_len, seed)
    attn_len = min(attn_len, cache.max_seq_len)  # the engine's bucket stops at its capacity
    if lctx + t > attn_len:
        raise ValueError(f"context {lctx} + {t} tokens beyond the cache ({cache.max_seq_len})")
    start = torch.tensor([lctx], device=dev)  # [1] committed KV entries
    host_start = None if graphs else lctx  # eager batch 1: the engine passes the host length
    lay = DenseLayout.build(start, t, attn_len, fwd.groups, model.dtype, host_start=host_start)
    ids = torch.randint(cfg.vocab_size, (1, t), generator=gen).to(dev)  # [1, T]
    x = _random((t, cfg.hidden_size), model, gen)  # [M, hidden] residual rows
    q_block = _random((1, cfg.num_kv_heads, fwd.groups * t, cfg.head_dim), model, gen)
    attn_rows = _random((t, cfg.q_size), model, gen)  # [M, q]
    logits = _random((t, cfg.vocab_size), model, gen)  # [M, vocab]
    argmax_out = torch.zeros(1, t, dtype=torch.int64, device=dev)  # [1, T]
    layers: list[DecoderLayer] = fwd.layers

    def embedding() -> object:
        return fwd.embed(ids.reshape(t))

    def attn_proj() -> object:
        for i, layer in enumerate(layers):
            hn = fwd.norm(x, layer.input_norm)
            qkv = fwd.linear(layer, "w_qkv", hn, layer.b_qkv)  # [M, q + 2kv]
            fwd.rope_write(layer, qkv, cache.k[i], cache.v[i], lay, cfg.num_heads)
            fwd.linear_residual(x, attn_rows, layer, "w_o")
        return None

    def attn_kv() -> object:  # what the layer body runs: SDPA + gather, or a plugged kernel
        for kc, vc in zip(cache.k, cache.v, strict=True):
            fwd.attend(q_block, kc, vc, lay)  # [M, H*D]
        return None

    def mlp() -> object:
        for layer in layers:
            hn = fwd.norm(x, layer.post_attn_norm)
            act = fwd.silu_mul(fwd.linear(layer, "w_gate_up", hn))  # [M, I]
            fwd.linear_residual(x, act, layer, "w_down")
        return None

    def lm_head() -> object:
        return fwd.logits(x)

    def head_argmax() -> object:  # an installed argmax head: final norm, head and argmax
        return fwd.argmax(x, may_abstain=True)  # timed as the verify runs it (graph-safe)

    def argmax() -> object:
        return logits.argmax(dim=-1)

    def forward() -> object:
        lay_f = DenseLayout.build(
            start, t, attn_len, fwd.groups, model.dtype, host_start=host_start
        )
        h = fwd.run_layers(fwd.embed(ids.reshape(t)), cache, lay_f)
        lay_f.to_block(fwd.argmax(h, may_abstain=True)[:, None], argmax_out[:, :, None])
        return argmax_out

    comps: dict[str, Thunk] = {
        "embedding": embedding,
        "attn_proj": attn_proj,
        "attn_kv": attn_kv,
        "mlp": mlp,
    }
    if model.argmax_head is None:
        comps |= {"lm_head": lm_head, "argmax": argmax}
    else:
        comps["lm_head"] = head_argmax
    return ForwardPieces(t, lctx, attn_len, comps, forward)
