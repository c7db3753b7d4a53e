"""Dense decoder transformer (Llama 2/3, SmolLM2, Qwen2/2.5, Qwen3) in plain PyTorch: weights,
loading, the KV cache, and the **stock** forward that token forcing trusts.

``Transformer.forward`` takes a block of new tokens per sequence, writes their K/V at the slots
right after each sequence's committed length (``cache.lengths``), attends to the committed prefix
plus the new block causally, and returns logits for the rows the caller asks for. It runs the one
layer body of ``models/forward.py`` with the torch reference ops (the stock rounding order).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor, nn

from specpilot.config import ModelConfig
from specpilot.errors import CheckpointError
from specpilot.models.forward import Forward
from specpilot.models.kv_cache import KVCache
from specpilot.models.layer import DecoderLayer
from specpilot.models.layout import DenseLayout
from specpilot.models.rope import rope_tables

DenseAttention = Callable[[Tensor, Tensor, Tensor, DenseLayout], Tensor | None]


class SmallOps(Protocol):
    """Plug point for the fp32 CPU forward's small ops (``Transformer.small_ops``)."""

    def rms_norm(self, x: Tensor, w: Tensor, eps: float) -> Tensor | None: ...  # [M, N]

    def rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor | None: ...  # [M, H, D]

    def rope_write(
        self,
        qkv: Tensor,  # [M, (Hq + 2 Hkv) D] fused q/k/v rows
        q_heads: int,
        cos: Tensor,  # [M, 1, D]
        sin: Tensor,
        k_cache: Tensor,  # [1, Hkv, S, D]
        v_cache: Tensor,
        start: int,
        attn_len: int = 0,
    ) -> Tensor | None:
        """Roped K and V written at slots ``start .. start + M - 1``; returns the roped q
        ``[M, Hq, D]`` (``attn_len`` 0), or row i's causal attention over the slots
        ``< min(start + i + 1, attn_len)`` ``[M, Hq D]``; None: the torch path runs."""
        ...


GEMV_WEIGHTS = ("w_qkv", "w_o", "w_gate_up", "w_down")
"""The matrices of a layer that also get an ``[in, out]`` copy on the CPU (add_gemv_copies)."""


@dataclass(slots=True)
class ForwardOutput:
    logits: Tensor  # [B, R, vocab] for the requested rows (R = T when all rows)
    hidden: dict[int, Tensor] = field(default_factory=dict)  # layer -> [B, T, hidden]
    final_hidden: Tensor | None = None  # [B, R, hidden] final-normed input of the LM head


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
        # Plug point "linear_weights" for the LM head: final-normed hidden [M, hidden] -> logits
        # [M, vocab] from another storage of the same weights (mechanisms/gguf_blocks.py).
        self.lm_head_fn: Callable[[Tensor], Tensor] | None = None
        # Plug point "kernel_choice": (q [B, H_kv, G*W, D], k_cache, v_cache, DenseLayout) ->
        # attention output [B*W, H*D] in forward-row order, or None to leave that layout to SDPA,
        # for dense layouts that carry their lengths (``Forward.attend``; e.g.
        # mechanisms/decode_attn.py). The stock forward never uses it.
        self.dense_attention: DenseAttention | None = None
        # fp32 CPU RMSNorm / RoPE in one call each (``rms_norm(x, w, eps)``, ``rope(x, cos,
        # sin)``: a tensor, or None to keep the torch ops; mechanisms/gguf_blocks.py).
        self.small_ops: SmallOps | None = None
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

    def weights(self) -> dict[str, Tensor]:
        """Every weight as this network holds it (q/k/v and gate/up fused; a tied LM head once,
        as ``embed``), by parameter name, and the CPU's ``[in, out]`` copies when it has them
        (``gemv.<layer>.<name>``, ``gemv.lm_head``): what a converted copy in the cache keeps
        (``loading/converted.py``) so that a later load maps it instead of rebuilding it."""
        out = {name: p.detach() for name, p in self.named_parameters()}
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, DecoderLayer)
            out |= {f"gemv.{i}.{n}": t for n, t in layer.gemv.items()}
        if self.lm_head_in_out is not None:
            out["gemv.lm_head"] = self.lm_head_in_out
        return out

    @staticmethod
    def weight_shapes(cfg: ModelConfig, gemv: bool = False) -> dict[str, tuple[int, ...]]:
        """Name → shape of :meth:`weights` for ``cfg`` (``gemv``: with the CPU's ``[in, out]``
        copies), computed without allocating any."""
        meta = Transformer(cfg, torch.float32, "meta", max_positions=1)
        if gemv:
            meta.add_gemv_copies()
        return {name: tuple(t.shape) for name, t in meta.weights().items()}

    def adopt_weights(self, weights: Mapping[str, Tensor], align: int = 64) -> None:
        """Take ``weights`` (as :meth:`weights` returned them, any dtype) as this network's.

        A tensor already in this network's dtype, on its device, contiguous and ``align``-byte
        aligned is used as it is, not copied (memory-mapped weights then stay shared with the
        page cache); any other is cast or copied in. Parameter names and shapes must match
        exactly; the ``[in, out]`` copies are taken on the CPU when all of them are given
        (otherwise :meth:`add_gemv_copies` makes them) and ignored elsewhere.
        """
        params = dict(self.named_parameters())
        given = {n for n in weights if not n.startswith("gemv.")}
        if given != set(params):
            missing, extra = sorted(set(params) - given), sorted(given - set(params))
            raise CheckpointError(
                f"The weights do not fit this {self.cfg.arch} network (missing {missing[:3]}, "
                f"unexpected {extra[:3]})."
            )

        def take(name: str, like: Tensor) -> Tensor:
            w = weights[name]
            if tuple(w.shape) != tuple(like.shape):
                raise CheckpointError(
                    f"Weight '{name}' has shape {tuple(w.shape)}, the config implies "
                    f"{tuple(like.shape)}."
                )
            if w.dtype != like.dtype or w.device != like.device:
                return w.to(device=like.device, dtype=like.dtype).contiguous()
            if w.is_contiguous() and w.data_ptr() % align == 0:
                return w
            return w.clone(memory_format=torch.contiguous_format)  # a fresh allocation is aligned

        with torch.no_grad():
            for name, p in params.items():
                p.data = take(name, p)
            gemv = {f"gemv.{i}.{n}" for i in range(len(self.layers)) for n in GEMV_WEIGHTS}
            if self.device.type != "cpu" or not gemv | {"gemv.lm_head"} <= set(weights):
                return
            for i, layer in enumerate(self.layers):
                assert isinstance(layer, DecoderLayer)
                layer.gemv = {n: take(f"gemv.{i}.{n}", getattr(layer, n).t()) for n in GEMV_WEIGHTS}
            self.lm_head_in_out = take("gemv.lm_head", self.lm_head.t())

    @property
    def has_gemv_copies(self) -> bool:
        return self.lm_head_in_out is not None

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
                layer.gemv = {n: getattr(layer, n).t().contiguous() for n in GEMV_WEIGHTS}
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

    def stock_forward(self) -> Forward:
        """The layer body with the torch reference ops: the stock rounding order (cached; a
        mechanism that installs a kernel in ``linear_fns`` is seen through it)."""
        fwd = self.__dict__.get("_stock_fwd")
        if fwd is None:
            fwd = Forward(self, use_triton=False, fuse_residual=False)
            self.__dict__["_stock_fwd"] = fwd
        return fwd

    def forward(
        self,
        tokens: Tensor,  # [B, T] int64
        cache: KVCache,
        positions: Tensor | None = None,  # [B, T] RoPE positions; default: the slots
        logits_rows: Tensor | None = None,  # [B, R] int64 rows of T to project; None = all
        hidden_layers: Sequence[int] = (),
    ) -> ForwardOutput:
        """Write K/V of ``tokens`` at slots ``cache.lengths[b] + t`` and return their logits.

        This is the stock computation that token forcing trusts; mechanisms never alter it (a
        weight format they install must reproduce the weights bit for bit).
        ``cache.lengths`` is not changed: the caller commits what it accepts.
        """
        fwd = self.stock_forward()
        x, hidden = self._final_hidden(tokens, cache, positions, logits_rows, hidden_layers)
        b, r, h = x.shape
        logits = fwd.logits_normed(x.reshape(b * r, h)).view(b, r, -1)
        return ForwardOutput(logits=logits, hidden=hidden, final_hidden=x)

    def forward_argmax(
        self,
        tokens: Tensor,  # [B, T] int64
        cache: KVCache,
        positions: Tensor | None = None,
        logits_rows: Tensor | None = None,  # [B, R]
    ) -> Tensor:  # [B, R] int64: the greedy token after each requested row
        """Like :meth:`forward`, but only the argmax; ``argmax_head`` may compute it faster."""
        x, _ = self._final_hidden(tokens, cache, positions, logits_rows, ())
        if self.argmax_head is not None:
            return self.argmax_head(x)
        b, r, h = x.shape
        return self.stock_forward().logits_normed(x.reshape(b * r, h)).argmax(dim=-1).view(b, r)

    def _final_hidden(
        self,
        tokens: Tensor,
        cache: KVCache,
        positions: Tensor | None,
        logits_rows: Tensor | None,
        hidden_layers: Sequence[int],
    ) -> tuple[Tensor, dict[int, Tensor]]:
        """Final-normed hidden states ``[B, R, hidden]`` and the requested layers' outputs."""
        b, t = tokens.shape
        dev = tokens.device
        lengths = cache.lengths  # host
        host = [int(n) for n in lengths.tolist()]
        attn_len = max(host) + t
        if attn_len > cache.max_seq_len:
            raise ValueError(f"KV cache overflow: {attn_len} > {cache.max_seq_len} slots")
        start = lengths.to(dev)
        fwd = self.stock_forward()
        lay = DenseLayout.build(
            start,
            t,
            attn_len,
            fwd.groups,
            self.dtype,
            host_start=host[0] if b == 1 else None,
            positions=positions,  # K/V still go to the slots; only the rotation moves
        )
        if int(lay.positions.max()) >= self.max_positions:
            raise ValueError(
                f"position {int(lay.positions.max())} beyond the RoPE table ({self.max_positions})"
            )
        x = fwd.embed(tokens.reshape(b * t))
        hidden: dict[int, Tensor] = {}
        wanted = set(hidden_layers)
        for i, layer in enumerate(fwd.layers):
            x = fwd.layer(layer, x, cache.k[i], cache.v[i], lay)
            if i in wanted:
                hidden[i] = x.view(b, t, -1)
        x = x.view(b, t, -1)
        if logits_rows is not None:
            x = x.gather(1, logits_rows[:, :, None].expand(-1, -1, x.shape[-1]))  # [B, R, hidden]
        r = x.shape[1]
        normed = fwd.final_hidden(x.reshape(b * r, -1)).view(b, r, -1)
        return normed, hidden
