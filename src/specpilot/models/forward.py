"""The one forward of the target (and of every drafter built from decoder layers).

:class:`Forward` runs the decoder layers over the rows of a layout (``models/layout.py``: dense,
packed or tree) with one layer body: RMSNorm → qkv → RoPE (+ q/k norm) and K/V write → attention
over the cache (GQA group folded into the query rows, an additive mask) → o → RMSNorm →
gate/up → SiLU·mul → down. Prefill, AR steps, chain, ragged and tree verify, the block
drafter's block and token forcing all run this body; what differs is the layout. Its attention
steps (RoPE, the K/V write, attention over the cache) are ``models/attention.py``'s, mixed in;
what it reads of a network is ``models/network.py``'s protocol.

It has no host sync and fixed shapes per call site, so the engine can capture it in CUDA graphs.
Two ways to run the small ops, numerically the stock ones up to rounding:

* ``use_triton`` (default on CUDA): RMSNorm, RoPE + K/V write (+ query placement) and SiLU·mul
  are fused Triton kernels (``kernels/decode_triton.py``), and residual adds ride on the GEMM
  (``addmm``, ``fuse_residual``);
* otherwise the torch references (``kernels/reference.py``): the **stock** rounding order, which
  ``Transformer.forward`` (what token forcing trusts) always uses.

Plug points read here: ``DecoderLayer.linear_fns`` (a mechanism's kernel for a matrix, e.g. W12),
``DecoderLayer.fused_steps`` (kernels that fold a norm, SiLU·mul or the residual add into a
matrix's GEMV for few rows, ``mechanisms/fused_gemv.py``; the Triton path only),
``DecoderLayer.phase_hooks`` (work launched before a step of the layer body that changes no value,
e.g. the L2 prefetch of ``mechanisms/l2_prefetch.py``; the steps are ``PHASE_POINTS``),
``Transformer.argmax_head`` (the LM-head argmax) and ``Transformer.dense_attention`` (attention
for dense layouts, e.g. ``mechanisms/decode_attn.py``; Triton path only). On the CPU a one-row
product uses the layer's ``[in, out]`` copy when the model keeps one
(``Transformer.add_gemv_copies``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Generic

import torch
import torch.nn.functional as F
from torch import Tensor

from specpilot.kernels import reference, triton_usable
from specpilot.models.attention import AttentionSteps
from specpilot.models.kv_cache import KVCache
from specpilot.models.layer import DecoderLayer, FusedSteps
from specpilot.models.layout import DenseLayout, Layout
from specpilot.models.network import NetT


def _no_hook(point: str) -> None:
    return None


def _phase_hooks(layer: DecoderLayer) -> Callable[[str], None]:
    """``at(point)``: calls the layer's hook for that point of ``PHASE_POINTS``, if it has one."""
    hooks = layer.phase_hooks
    if not hooks:
        return _no_hook

    def at(point: str) -> None:
        fn = hooks.get(point)
        if fn is not None:
            fn()

    return at


class Forward(AttentionSteps, Generic[NetT]):
    """The layer body and the whole passes over a :class:`Transformer`'s weights (or another
    :class:`Network`'s: a DFlash drafter's)."""

    def __init__(
        self,
        model: NetT,
        use_triton: bool | None = None,
        fuse_residual: bool | None = None,
        layers: Sequence[DecoderLayer] | None = None,
    ) -> None:
        """``layers``: the decoder layers to run (default: the model's; a block drafter passes
        its own, with the target's embedding, final norm and LM head)."""
        self.model: NetT = model
        self.cfg = model.cfg
        self.layers: list[DecoderLayer] = list(layers if layers is not None else model.layers)  # type: ignore[arg-type]
        self.use_triton = triton_usable(model.device) if use_triton is None else use_triton
        self._k: ModuleType | None = None
        if self.use_triton:
            from specpilot.kernels import decode_triton

            self._k = decode_triton
        self.groups = self.cfg.num_heads // self.cfg.num_kv_heads
        # "GEMM, round, add" versus the add fused into the GEMM differ by rounding only; on the
        # CPU the stock order is kept, so fp32 results track the stock path exactly.
        cuda = model.device.type == "cuda"
        self.fuse_residual = cuda if fuse_residual is None else fuse_residual
        self.head_fn: Callable[[Tensor], Tensor] | None = None
        """This forward's own LM head (``[M, hidden] -> [M, vocab]``), before the model's
        ``lm_head_fn``: a drafter's approximate head (``mechanisms/int8_drafter.py``) that the
        target's forward, sharing the model, never sees."""

    # ------------------------------------------------------------------ pieces
    def norm(self, x: Tensor, weight: Tensor) -> Tensor:  # [M, N] -> [M, N]
        if self._k is not None:
            return self._k.rms_norm(x, weight, self.cfg.rms_norm_eps)
        ops = getattr(self.model, "small_ops", None)
        y = None if ops is None else ops.rms_norm(x, weight, self.cfg.rms_norm_eps)
        return reference.rms_norm_ref(x, weight, self.cfg.rms_norm_eps) if y is None else y

    @staticmethod
    def linear(layer: DecoderLayer, name: str, a: Tensor, b: Tensor | None = None) -> Tensor:
        """``a [M, K] @ W.T (+ b)`` for the layer's matrix ``name``: a mechanism's kernel when one
        is installed in ``layer.linear_fns``, the ``[in, out]`` copy for one row, else F.linear."""
        fn = layer.linear_fns.get(name)
        if fn is not None:
            return fn(a, b)
        w_in_out = layer.gemv.get(name)
        if w_in_out is not None and a.shape[0] == 1:
            y = a @ w_in_out
            return y if b is None else y + b
        return F.linear(a, getattr(layer, name), b)

    def fused(self, layer: DecoderLayer, name: str, rows: int) -> FusedSteps | None:
        """The layer's fused kernels when they serve matrix ``name`` for ``rows`` rows: only on
        the Triton path (the stock forward keeps the stock ops)."""
        f = layer.fused_steps
        if f is None or not self.use_triton:
            return None
        return f if f.takes(name, rows) else None

    def linear_residual(self, x: Tensor, a: Tensor, layer: DecoderLayer, name: str) -> Tensor:
        """``x + a @ W.T`` for ``x [M, N]``, ``a [M, K]``, ``W = layer.<name> [N, K]``."""
        fused = self.fused(layer, name, a.shape[0])
        if fused is not None:
            return fused.linear_residual(name, x, a)
        if self.fuse_residual and name not in layer.linear_fns:
            return torch.addmm(x, a, getattr(layer, name).t())
        return x + self.linear(layer, name, a)

    def silu_mul(self, gate_up: Tensor) -> Tensor:  # [M, 2I] -> [M, I]
        if self._k is not None:
            return self._k.silu_mul(gate_up)
        return reference.silu_mul_ref(gate_up)

    # ------------------------------------------------------------------ the layer body
    def layer(
        self,
        layer: DecoderLayer,
        x: Tensor,  # [M, hidden] residual stream
        k_cache: Tensor,  # [B, H_kv, S, D]
        v_cache: Tensor,
        lay: Layout,
        attn_prefix: Tensor | None = None,  # [M, P] normed columns before the normed x
    ) -> Tensor:
        """``attn_prefix``: EAGLE-3's midlayer, whose q/k/v read ``[prefix ; norm(x)]`` (the
        normed token embedding, then the normed hidden state; ``w_qkv`` is ``[q + 2kv, P + H]``)
        while the residual stays ``x``. None for every other network."""
        cfg = self.cfg
        at = _phase_hooks(layer)
        conv_a, conv_m = layer.attention_conv, layer.mlp_conv  # DFlash2's block mixes, or None
        rows = lay.block if isinstance(lay, DenseLayout) and lay.block else lay.width
        plain_a = attn_prefix is None and conv_a is None
        fused = self.fused(layer, "w_qkv", x.shape[0]) if plain_a else None
        at("input_norm")
        if fused is not None:  # RMSNorm in the qkv GEMV's prologue
            at("w_qkv")
            qkv = fused.norm_linear("w_qkv", x, layer.input_norm, layer.b_qkv)
        else:
            hn = self.norm(x, layer.input_norm)
            if attn_prefix is not None:
                hn = torch.cat([attn_prefix, hn], dim=-1)  # [M, P + hidden]
            if conv_a is not None:
                hn, dyn_a = conv_a.prepare(hn, rows)
            at("w_qkv")
            qkv = self.linear(layer, "w_qkv", hn, layer.b_qkv)  # [M, q + 2kv]
        at("attention")
        attn = self.rope_write_attend(layer, qkv, k_cache, v_cache, lay)  # [M, H*D] or None
        if attn is None:
            q = self.rope_write(layer, qkv, k_cache, v_cache, lay, cfg.num_heads)
            attn = self.attend(q, k_cache, v_cache, lay)  # [M, H*D]
        at("w_o")
        if conv_a is None:
            x = self.linear_residual(x, attn, layer, "w_o")
        else:
            x = x + conv_a.finish(self.linear(layer, "w_o", attn), dyn_a, rows)
        at("post_attn_norm")
        fused = self.fused(layer, "w_gate_up", x.shape[0]) if conv_m is None else None
        if fused is not None:  # RMSNorm in the gate_up GEMV's prologue
            at("w_gate_up")
            gate_up = fused.norm_linear("w_gate_up", x, layer.post_attn_norm, None)
        else:
            hn = self.norm(x, layer.post_attn_norm)
            if conv_m is not None:
                hn, dyn_m = conv_m.prepare(hn, rows)
            at("w_gate_up")
            gate_up = self.linear(layer, "w_gate_up", hn)  # [M, 2I]
        at("silu_mul")
        fused = self.fused(layer, "w_down", x.shape[0]) if conv_m is None else None
        if fused is not None:  # SiLU·mul in the down GEMV's prologue, the residual in its epilogue
            at("w_down")
            return fused.silu_linear_residual("w_down", x, gate_up)
        act = self.silu_mul(gate_up)  # [M, I]
        at("w_down")
        if conv_m is None:
            return self.linear_residual(x, act, layer, "w_down")
        return x + conv_m.finish(self.linear(layer, "w_down", act), dyn_m, rows)

    def write_kv(
        self,
        layer: DecoderLayer,
        x: Tensor,  # [M, hidden] already normed context rows
        k_cache: Tensor,
        v_cache: Tensor,
        lay: Layout,
    ) -> None:
        """Project rows to K/V only (no attention, no MLP) and write them at the layout's slots
        (a block drafter's context rows)."""
        q = self.cfg.q_size
        w_kv = layer.w_qkv[q:]
        b_kv = None if layer.b_qkv is None else layer.b_qkv[q:]
        self.rope_write(layer, F.linear(x, w_kv, b_kv), k_cache, v_cache, lay, 0)

    # ------------------------------------------------------------------ whole passes
    def run_layers(
        self,
        x: Tensor,  # [M, hidden]
        cache: KVCache,
        lay: Layout,
        hidden_layers: Sequence[int] = (),
        hidden_out: Tensor | None = None,  # [len(hidden_layers), B, >= W, hidden]
    ) -> Tensor:
        """Every layer over the layout's rows; the chosen layers' outputs copied to
        ``hidden_out`` in block order (a layer listed twice, as EAGLE-3's default low / mid /
        high gives on a small target, fills both). Returns the last layer's output."""
        if lay.attn_len > cache.max_seq_len:
            raise ValueError(
                f"attention length {lay.attn_len} beyond the cache ({cache.max_seq_len})"
            )
        for i, layer in enumerate(self.layers):
            x = self.layer(layer, x, cache.k[i], cache.v[i], lay)
            if hidden_out is not None:
                for j in (j for j, want in enumerate(hidden_layers) if want == i):  # repeats too
                    lay.to_block(x, hidden_out[j])
        return x

    def embed(self, tokens: Tensor) -> Tensor:  # [M] int64 -> [M, hidden]
        return F.embedding(tokens, self.model.embed)

    def final_hidden(self, x: Tensor) -> Tensor:  # [M, hidden] -> final-normed [M, hidden]
        return self.norm(x, self.model.final_norm)

    def logits(self, x: Tensor) -> Tensor:  # [M, hidden] -> [M, vocab]
        """Final norm and LM head."""
        return self.logits_normed(self.final_hidden(x))

    def logits_normed(self, h: Tensor) -> Tensor:  # final-normed [M, hidden] -> [M, vocab]
        """The LM head (the ``[in, out]`` copy for one row when the model keeps one)."""
        m = self.model
        fn = self.head_fn or getattr(m, "lm_head_fn", None)
        if fn is not None:
            return fn(h)
        if m.lm_head_in_out is not None and h.shape[0] == 1:
            return h @ m.lm_head_in_out
        return F.linear(h, m.lm_head)

    def argmax(
        self,
        x: Tensor,  # [M, hidden]
        may_abstain: bool = False,
        valid: Tensor | None = None,  # [M] bool: rows whose ids the caller reads
    ) -> Tensor:  # [M] int64
        """The greedy token after each row; the ``lm_head_argmax`` plug point when installed.
        ``may_abstain``: the caller honours the head's ``abstain_flag`` (the engine's verify), so
        a head that has one may answer with its graph-safe ``abstaining`` call; ``valid`` (with
        it): only those rows may make it abstain, the ids of the others may be anything
        (None: every row counts)."""
        head = self.model.argmax_head
        if head is not None:
            h = self.final_hidden(x)[None]  # [1, M, hidden]
            if may_abstain and hasattr(head, "abstain_flag"):
                rows = None if valid is None else valid[None]  # [1, M]
                return head.abstaining(h, rows)[0]  # type: ignore[attr-defined]
            return head(h)[0]
        return self.logits(x).argmax(dim=-1)

    def dense(
        self,
        tokens: Tensor,  # [B, T] int64
        cache: KVCache,
        start: Tensor,  # [B] int64 device: committed KV entries per sequence
        attn_len: int,
        hidden_layers: Sequence[int] = (),
        hidden_out: Tensor | None = None,  # [len(hidden_layers), B, >= T, hidden]
        host_start: int | None = None,
        causal: bool = True,
    ) -> Tensor:
        """Last-layer output ``[B*T, hidden]`` of a block written at slots ``start + t``."""
        b, t = tokens.shape
        lay = DenseLayout.build(
            start, t, attn_len, self.groups, self.model.dtype, causal, host_start
        )
        x = self.embed(tokens.reshape(b * t))
        return self.run_layers(x, cache, lay, hidden_layers, hidden_out)
