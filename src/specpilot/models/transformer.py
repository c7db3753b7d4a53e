"""Dense decoder transformer (Llama 2/3, SmolLM2, Qwen2/2.5, Qwen3) in plain PyTorch.

One forward serves prefill, AR decode, chain verify and tree verify: it takes a block of new
tokens per sequence, writes their K/V at the slots right after each sequence's committed length
(``cache.lengths``), attends to the committed prefix plus the new block (causally, or through a
tree mask), and returns logits only for the rows the caller asks for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specpilot.config import ModelConfig
from specpilot.errors import CheckpointError
from specpilot.models.kv_cache import KVCache
from specpilot.models.rope import apply_rope, rope_tables


@dataclass(slots=True)
class ForwardOutput:
    logits: Tensor  # [B, R, vocab] for the requested rows (R = T when all rows)
    hidden: dict[int, Tensor] = field(default_factory=dict)  # layer -> [B, T, hidden]
    final_hidden: Tensor | None = None  # [B, R, hidden] final-normed input of the LM head


def project(x: Tensor, w: Tensor, b: Tensor | None, w_in_out: Tensor | None) -> Tensor:
    """``x @ w^T + b``; a one-row ``x`` uses the ``[in, out]`` copy of ``w`` when there is one."""
    if w_in_out is None or x.numel() != x.shape[-1]:
        return F.linear(x, w, b)
    y = x @ w_in_out
    return y if b is None else y + b


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm computed in float32 and cast back, as the HF reference does."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class DecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU MLP. q/k/v and gate/up are fused into one GEMM each."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        h, qkv = cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size

        def p(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)

        self.cfg = cfg
        self.gemv: dict[str, Tensor] = {}  # name -> [in, out] copy for one-row products (CPU)
        # Plug point "linear_weights": name -> fn(x [.., in], bias) computing F.linear(x, w, bias)
        # from another storage of bit-identical weights (e.g. mechanisms/w12.py).
        self.linear_fns: dict[str, Callable[[Tensor, Tensor | None], Tensor]] = {}
        self.input_norm = p(h)
        self.post_attn_norm = p(h)
        self.w_qkv = p(qkv, h)
        self.b_qkv = p(qkv) if cfg.attention_bias else None
        self.q_norm = p(cfg.head_dim) if cfg.qk_norm else None
        self.k_norm = p(cfg.head_dim) if cfg.qk_norm else None
        self.w_o = p(h, cfg.q_size)
        self.w_gate_up = p(2 * cfg.intermediate_size, h)
        self.w_down = p(h, cfg.intermediate_size)

    def forward(
        self,
        x: Tensor,  # [B, T, hidden]
        cos: Tensor,  # [B, T, 1, D]
        sin: Tensor,  # [B, T, 1, D]
        k_cache: Tensor,  # [B, H_kv, S_max, D]
        v_cache: Tensor,  # [B, H_kv, S_max, D]
        write: tuple[Tensor, Tensor] | slice,  # (batch idx [B,1], slots [B,T]) or slice (B == 1)
        attn_len: int,
        mask: Tensor | None,  # [B, 1, T, attn_len] bool, or None for "attend to all"
        causal: bool,
    ) -> Tensor:
        cfg = self.cfg
        b, t, _ = x.shape
        hn = rms_norm(x, self.input_norm, cfg.rms_norm_eps)
        qkv = self._project("w_qkv", hn, self.b_qkv)  # [B, T, q + 2kv]
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.view(b, t, cfg.num_heads, cfg.head_dim)
        k = k.view(b, t, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(b, t, cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = rms_norm(q, self.q_norm, cfg.rms_norm_eps)
            k = rms_norm(k, self.k_norm, cfg.rms_norm_eps)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        if isinstance(write, slice):  # batch 1, contiguous slots: a plain copy
            k_cache[0, :, write] = k[0].transpose(0, 1)
            v_cache[0, :, write] = v[0].transpose(0, 1)
        else:
            bidx, slots = write
            k_cache.permute(0, 2, 1, 3)[bidx, slots] = k
            v_cache.permute(0, 2, 1, 3)[bidx, slots] = v
        attn = F.scaled_dot_product_attention(
            q.transpose(1, 2),  # [B, H, T, D]
            k_cache[:, :, :attn_len],
            v_cache[:, :, :attn_len],
            attn_mask=mask,
            is_causal=causal,
            enable_gqa=cfg.num_heads != cfg.num_kv_heads,
        )  # [B, H, T, D]
        x = x + self._project("w_o", attn.transpose(1, 2).reshape(b, t, cfg.q_size))
        hn = rms_norm(x, self.post_attn_norm, cfg.rms_norm_eps)
        gate, up = self._project("w_gate_up", hn).chunk(2, dim=-1)
        return x + self._project("w_down", F.silu(gate) * up)

    def _project(self, name: str, x: Tensor, b: Tensor | None = None) -> Tensor:
        fn = self.linear_fns.get(name)
        if fn is not None:
            return fn(x, b)
        return project(x, getattr(self, name), b, self.gemv.get(name))


class Transformer(nn.Module):
    """The network. Weights are loaded from HF-named tensors with :meth:`load_hf_state_dict`."""

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        max_positions: int | None = None,
    ) -> None:
        super().__init__()
        dev = torch.device(device)
        self.cfg = cfg
        self.dtype = dtype
        self.embed = nn.Parameter(
            torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=dev),
            requires_grad=False,
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, dev) for _ in range(cfg.num_layers))
        self.final_norm = nn.Parameter(
            torch.empty(cfg.hidden_size, dtype=dtype, device=dev), requires_grad=False
        )
        self.lm_head = (
            self.embed
            if cfg.tie_word_embeddings
            else nn.Parameter(
                torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=dev),
                requires_grad=False,
            )
        )
        self.lm_head_in_out: Tensor | None = None
        # Plug point "lm_head_argmax": final-normed hidden [B, R, hidden] -> token ids [B, R].
        # It must return exactly the argmax of ``forward``'s logits (lowest id on ties).
        self.argmax_head: Callable[[Tensor], Tensor] | None = None
        cos, sin = rope_tables(cfg, max_positions or cfg.max_position_embeddings, dev)
        self.rope_cos: Tensor = cos  # [P, D] float32 (plain attributes: never saved or cast)
        self.rope_sin: Tensor = sin

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def max_positions(self) -> int:
        return int(self.rope_cos.shape[0])

    # ------------------------------------------------------------------ weights
    def load_hf_state_dict(self, sd: dict[str, Tensor]) -> None:
        """Copy HF-named tensors in (casting to this model's dtype), fusing qkv and gate/up."""
        cfg = self.cfg

        def take(name: str) -> Tensor:
            if name not in sd:
                raise CheckpointError(
                    f"The checkpoint has no tensor '{name}'; is it a {cfg.arch} model?"
                )
            return sd[name]

        def put(dst: Tensor, src: Tensor, name: str) -> None:
            if tuple(dst.shape) != tuple(src.shape):
                raise CheckpointError(
                    f"Tensor '{name}' has shape {tuple(src.shape)}, the config implies {tuple(dst.shape)}."
                )
            dst.copy_(src)

        with torch.no_grad():
            put(self.embed, take("model.embed_tokens.weight"), "model.embed_tokens.weight")
            put(self.final_norm, take("model.norm.weight"), "model.norm.weight")
            if not cfg.tie_word_embeddings:
                put(self.lm_head, take("lm_head.weight"), "lm_head.weight")
            for i, layer in enumerate(self.layers):
                assert isinstance(layer, DecoderLayer)
                pre = f"model.layers.{i}."
                att = pre + "self_attn."
                put(
                    layer.input_norm,
                    take(pre + "input_layernorm.weight"),
                    pre + "input_layernorm.weight",
                )
                put(
                    layer.post_attn_norm,
                    take(pre + "post_attention_layernorm.weight"),
                    pre + "post_attention_layernorm.weight",
                )
                qkv = torch.cat([take(att + f"{n}_proj.weight") for n in "qkv"], dim=0)
                put(layer.w_qkv, qkv, att + "{q,k,v}_proj.weight")
                if layer.b_qkv is not None:
                    put(
                        layer.b_qkv,
                        torch.cat([take(att + f"{n}_proj.bias") for n in "qkv"]),
                        att + "{q,k,v}_proj.bias",
                    )
                if layer.q_norm is not None and layer.k_norm is not None:
                    put(layer.q_norm, take(att + "q_norm.weight"), att + "q_norm.weight")
                    put(layer.k_norm, take(att + "k_norm.weight"), att + "k_norm.weight")
                put(layer.w_o, take(att + "o_proj.weight"), att + "o_proj.weight")
                mlp = pre + "mlp."
                gate_up = torch.cat(
                    [take(mlp + "gate_proj.weight"), take(mlp + "up_proj.weight")], dim=0
                )
                put(layer.w_gate_up, gate_up, mlp + "{gate,up}_proj.weight")
                put(layer.w_down, take(mlp + "down_proj.weight"), mlp + "down_proj.weight")

    def add_gemv_copies(self) -> None:
        """Keep an ``[in, out]`` copy of every matrix for one-row products (AR steps, drafting).

        On the CPU, MKL streams a one-row product over an ``[in, out]`` matrix about 1.3x faster
        with two threads than over the checkpoint's ``[out, in]``, while multi-row products (verify)
        are faster over ``[out, in]``; so both are kept, at twice the weight memory. Values are
        identical; only the reduction order of the one-row products changes. Call after loading.
        """
        with torch.no_grad():
            for layer in self.layers:
                assert isinstance(layer, DecoderLayer)
                layer.gemv = {
                    n: getattr(layer, n).t().contiguous()
                    for n in ("w_qkv", "w_o", "w_gate_up", "w_down")
                }
            self.lm_head_in_out = self.lm_head.t().contiguous()

    def init_random(self, seed: int, std: float = 0.02) -> None:
        """Seeded random weights (tests and synthetic deployments); norms near 1."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() == 1 and "norm" in name:
                    vals = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
                else:
                    vals = std * torch.randn(p.shape, generator=gen)
                p.copy_(vals)

    # ------------------------------------------------------------------ forward
    def allocate_cache(self, batch_size: int, max_seq_len: int) -> KVCache:
        return KVCache.allocate(self.cfg, batch_size, max_seq_len, self.dtype, self.device)

    def forward(
        self,
        tokens: Tensor,  # [B, T] int64
        cache: KVCache,
        positions: Tensor | None = None,  # [B, T] RoPE positions; default: the slots
        tree_mask: Tensor | None = None,  # [B, T, T] bool among the new tokens; default: causal
        logits_rows: Tensor | None = None,  # [B, R] int64 rows of T to project; None = all
        hidden_layers: Sequence[int] = (),
    ) -> ForwardOutput:
        """Write K/V of ``tokens`` at slots ``cache.lengths[b] + t`` and return their logits.

        This is the stock computation that token forcing trusts; mechanisms never alter it (a
        weight format they install must reproduce the weights bit for bit).
        ``cache.lengths`` is not changed: the caller commits what it accepts.
        """
        x, hidden = self._final_hidden(
            tokens, cache, positions, tree_mask, logits_rows, hidden_layers
        )
        logits = project(x, self.lm_head, None, self.lm_head_in_out)
        return ForwardOutput(logits=logits, hidden=hidden, final_hidden=x)

    def forward_argmax(
        self,
        tokens: Tensor,  # [B, T] int64
        cache: KVCache,
        positions: Tensor | None = None,
        tree_mask: Tensor | None = None,
        logits_rows: Tensor | None = None,  # [B, R]
    ) -> Tensor:  # [B, R] int64: the greedy token after each requested row
        """Like :meth:`forward`, but only the argmax; ``argmax_head`` may compute it faster."""
        x, _ = self._final_hidden(tokens, cache, positions, tree_mask, logits_rows, ())
        if self.argmax_head is not None:
            return self.argmax_head(x)
        return project(x, self.lm_head, None, self.lm_head_in_out).argmax(dim=-1)

    def _final_hidden(
        self,
        tokens: Tensor,
        cache: KVCache,
        positions: Tensor | None,
        tree_mask: Tensor | None,
        logits_rows: Tensor | None,
        hidden_layers: Sequence[int],
    ) -> tuple[Tensor, dict[int, Tensor]]:
        """Final-normed hidden states ``[B, R, hidden]`` and the requested layers' outputs."""
        b, t = tokens.shape
        dev = tokens.device
        lengths = cache.lengths  # host
        max_len = int(lengths.max()) if b > 1 else int(lengths[0])
        attn_len = max_len + t
        if attn_len > cache.max_seq_len:
            raise ValueError(f"KV cache overflow: {attn_len} > {cache.max_seq_len} slots")
        start = lengths.to(dev)
        slots = start[:, None] + torch.arange(t, device=dev)  # [B, T]
        pos = slots if positions is None else positions
        if int(pos.max()) >= self.max_positions:
            raise ValueError(
                f"position {int(pos.max())} beyond the RoPE table ({self.max_positions})"
            )

        mask: Tensor | None = None
        causal = False
        write: tuple[Tensor, Tensor] | slice
        if b == 1 and tree_mask is None:
            write = slice(max_len, max_len + t)
            causal = t > 1 and max_len == 0
            if t > 1 and max_len > 0:
                mask = self._mask(start, t, attn_len, None)
        else:
            write = (torch.arange(b, device=dev)[:, None], slots)
            mask = self._mask(start, t, attn_len, tree_mask)

        cos = self.rope_cos[pos].unsqueeze(2)  # [B, T, 1, D]
        sin = self.rope_sin[pos].unsqueeze(2)
        x = F.embedding(tokens, self.embed)  # [B, T, hidden]
        hidden: dict[int, Tensor] = {}
        wanted = set(hidden_layers)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache.k[i], cache.v[i], write, attn_len, mask, causal)
            if i in wanted:
                hidden[i] = x
        if logits_rows is not None:
            x = x.gather(1, logits_rows[:, :, None].expand(-1, -1, x.shape[-1]))  # [B, R, hidden]
        return rms_norm(x, self.final_norm, self.cfg.rms_norm_eps), hidden

    @staticmethod
    def _mask(start: Tensor, t: int, attn_len: int, tree_mask: Tensor | None) -> Tensor:
        """Boolean mask ``[B, 1, T, attn_len]``: the committed prefix, then the new block."""
        dev = start.device
        rel = torch.arange(attn_len, device=dev)[None, None, :] - start[:, None, None]  # [B, 1, S]
        if tree_mask is None:
            q = torch.arange(t, device=dev)[None, :, None]  # [1, T, 1]
            mask = (rel < 0) | (rel <= q)  # [B, T, S]
        else:
            inside = (rel >= 0) & (rel < t)
            idx = rel.clamp(0, t - 1).expand(-1, t, -1)  # [B, T, S]
            mask = (rel < 0) | (inside & tree_mask.gather(2, idx))
        return mask[:, None]
