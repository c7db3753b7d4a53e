"""The DFlash / DFlash2 drafter network: decoder layers at the target's width that draft a whole
block in one forward, reading the target's hidden states (z-lab, arXiv 2602.06036).

* **Context features.** The outputs of the target layers ``target_layer_ids`` (HF
  ``hidden_states[id + 1]``) are concatenated per token, projected by ``fc`` (``[H, n·H]``, no
  bias) and normed (``hidden_norm``). Every drafter layer projects these context rows to K/V with
  its own ``k_proj`` / ``v_proj`` (then ``k_norm`` and RoPE at the token's position); context rows
  get no input norm, no attention and no MLP.
* **The block** ``[anchor, mask × (B-1)]`` (embedded with the target's embedding, times
  ``input_embedding_scale``) runs through the layers: pre-norm attention over the context K/V and
  the block's own K/V — non-causal in ``full_attention`` layers; in ``sliding_attention`` layers
  causal unless the config says ``is_causal: false``, and limited to ``sliding_window`` keys —
  then the SwiGLU MLP; then the drafter's own final ``norm`` and the target's LM head (times
  ``output_multiplier``, soft-capped by ``final_logit_softcapping``). Row j (j ≥ 1) drafts the
  token at position ``anchor + j``.
* **DFlash2** adds a dynamic convolution over the block rows around attention and the MLP
  (``models/block_conv.py``) and a low-rank candidate selector: per position, the top-k tokens of
  the logits rescored by ``logit(b) + <pred[prev] ⊙ proj(h), succ[b]>``, greedily from the anchor.

The layers are the one layer body (``models/forward.py``); this module holds the weights, the
shared target tensors and the masks. Embedding and LM head are the target's and never stored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specpilot.config import ModelConfig
from specpilot.models.block_conv import BlockConv
from specpilot.models.drafter_net import DrafterNet, drafter_layers
from specpilot.models.forward import Forward
from specpilot.models.kv_cache import KVCache
from specpilot.models.layer import DecoderLayer
from specpilot.models.layout import DenseLayout, additive
from specpilot.models.transformer import Transformer

KINDS = ("dflash", "dflash2")


def default_target_layers(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """DFlash's default: one per drafter layer, spread from layer 1 to layer N-3 (N//2 alone).
    SmolLM2 (30 layers) with 5 drafter layers: (1, 8, 14, 20, 27)."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    lo, span = 1, num_target_layers - 4
    return tuple(round(lo + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers))


@dataclass(frozen=True, slots=True)
class DFlashSpec:
    """Everything a DFlash checkpoint's config.json says about the drafter."""

    kind: str
    """``dflash`` (``DFlashDraftModel``) or ``dflash2`` (``DFlash2DraftModel``)."""
    layers: ModelConfig
    """The drafter's decoder layers (Qwen3: q/k RMSNorm); ``vocab_size`` is the target's."""
    target_layer_ids: tuple[int, ...]
    """Target layers whose outputs are the context features, in concatenation order."""
    block_size: int
    """Rows of the block it was trained with (anchor included): at most ``block_size - 1`` drafts."""
    mask_token_id: int
    layer_causal: tuple[bool, ...]
    """Per layer: causal inside the block (sliding layers by default)."""
    layer_window: tuple[int | None, ...]
    """Per layer: sliding window in positions, or None (full attention)."""
    num_target_layers: int | None = None
    output_multiplier: float = 1.0
    logit_softcap: float | None = None
    input_embedding_scale: float = 1.0
    conv_kernel_size: int = 0
    """DFlash2: taps K of the dynamic convolution (0: none)."""
    conv_group_size: int = 0
    """DFlash2: channels per dynamic-kernel group."""
    selector_rank: int = 0
    """DFlash2: rank r of the candidate selector (0: none)."""
    selector_top_k: int = 0
    """DFlash2: candidates rescored per position."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown DFlash kind {self.kind!r}")
        n = self.layers.num_layers
        if len(self.layer_causal) != n or len(self.layer_window) != n:
            raise ValueError(f"layer types must name each of the {n} drafter layers")
        if self.block_size < 2:
            raise ValueError(f"block_size must be at least 2, got {self.block_size}")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids is empty")
        if (
            self.kind == "dflash2"
            and min(
                self.conv_kernel_size, self.conv_group_size, self.selector_rank, self.selector_top_k
            )
            < 1
        ):
            raise ValueError("a DFlash2 drafter needs conv_kernel_size, conv_group_size, "
                             "selector_rank and selector_top_k")  # fmt: skip

    @property
    def hidden_size(self) -> int:
        return self.layers.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.layers.vocab_size

    def num_params(self) -> int:
        """Stored parameters (embedding and LM head excluded: they are the target's)."""
        c, h = self.layers, self.hidden_size
        per = c.matrix_params() + 2 * h + 2 * c.head_dim  # + input/post norms, q/k norms
        if self.conv_kernel_size:
            per += 2 * (
                2 * self.conv_kernel_size * h
                + 2 * self.conv_kernel_size * h * h // self.conv_group_size
            )
        sel = (2 * c.vocab_size + h) * self.selector_rank
        return c.num_layers * per + len(self.target_layer_ids) * h * h + 2 * h + sel


class SelectorWeights(nn.Module):
    """DFlash2's candidate selector: ``hidden_projection [r, H]``, two codebooks ``[V, r]``."""

    def __init__(self, spec: DFlashSpec, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        r, h, v = spec.selector_rank, spec.hidden_size, spec.vocab_size
        self.top_k = spec.selector_top_k
        self.hidden_projection = nn.Parameter(torch.empty(r, h, dtype=dtype, device=device))
        self.predecessor_codebook = nn.Parameter(torch.empty(v, r, dtype=dtype, device=device))
        self.successor_codebook = nn.Parameter(torch.empty(v, r, dtype=dtype, device=device))

    def scores(
        self, proj: Tensor, unary: Tensor, cand: Tensor, prev: Tensor
    ) -> Tensor:  # proj [B, r], unary [B, top], cand [B, top], prev [B] -> [B, top]
        pred = F.embedding(prev, self.predecessor_codebook) * proj  # [B, r]
        succ = F.embedding(cand, self.successor_codebook)  # [B, top, r]
        return unary + torch.einsum("br,bkr->bk", pred, succ)


class DFlashNet(DrafterNet):
    """The drafter's own weights (``fc``, ``hidden_norm``, layers, ``norm``, DFlash2 parts) plus
    the target's embedding and LM head, shared and never registered as parameters."""

    def __init__(
        self, spec: DFlashSpec, target: Transformer, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__(spec.layers, target, dtype)
        dev, dt = target.device, self.dtype
        h = spec.hidden_size
        self.spec = spec
        self.layers = nn.ModuleList(DecoderLayer(spec.layers, dt, dev) for _ in spec.layer_causal)
        self.fc = nn.Parameter(torch.empty(h, len(spec.target_layer_ids) * h, dtype=dt, device=dev))
        self.hidden_norm = nn.Parameter(torch.empty(h, dtype=dt, device=dev))
        self.final_norm = nn.Parameter(torch.empty(h, dtype=dt, device=dev))
        if spec.conv_kernel_size:
            for layer in self.layers:
                assert isinstance(layer, DecoderLayer)
                k, g = spec.conv_kernel_size, spec.conv_group_size
                layer.attention_conv = BlockConv(h, k, g, dt, dev)
                layer.mlp_conv = BlockConv(h, k, g, dt, dev)
        self.selector = SelectorWeights(spec, dt, dev) if spec.selector_rank else None
        for prm in self.parameters():
            prm.requires_grad_(False)

    # --------------------------------------------------------------- what Forward reads
    @property
    def lm_head(self) -> Tensor:
        return self.target.lm_head

    @property
    def lm_head_in_out(self) -> Tensor | None:
        return self.target.lm_head_in_out if self.dtype == self.target.dtype else None

    def decoder_layers(self) -> list[DecoderLayer]:
        return [lyr for lyr in self.layers if isinstance(lyr, DecoderLayer)]

    def init_random(self, seed: int, std: float = 0.02, norm_std: float = 0.1) -> None:
        """Seeded weights: N(0, std) matrices, N(1, norm_std) norms, identity convs."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        with torch.no_grad():
            for name, prm in self.named_parameters():
                if prm.dim() == 1 and "norm" in name:
                    vals = 1.0 + norm_std * torch.randn(prm.shape, generator=gen)
                else:
                    vals = std * torch.randn(prm.shape, generator=gen)
                prm.copy_(vals)
            for layer in self.decoder_layers():
                for conv in (layer.attention_conv, layer.mlp_conv):
                    if conv is not None:
                        conv.init_identity()

    # --------------------------------------------------------------- pieces of one draft
    def context(self, fwd: Forward, hidden: Tensor) -> Tensor:
        """``hidden [n_sel, B, T, H]`` target states → normed context rows ``[B*T, H]``."""
        n, b, t, h = hidden.shape
        feats = hidden.permute(1, 2, 0, 3).reshape(b * t, n * h)  # [B*T, n_sel*H]
        return fwd.norm(F.linear(feats, self.fc), self.hidden_norm)

    def write_context(
        self, fwd: Forward, hidden: Tensor, start: Tensor, cache: KVCache
    ) -> None:  # hidden [n_sel, B, T, H], start [B]: context K/V at slots start + t
        ctx = self.context(fwd, hidden)
        lay = DenseLayout.writes(start, hidden.shape[2])
        for i, layer in enumerate(fwd.layers):
            fwd.write_kv(layer, ctx, cache.k[i], cache.v[i], lay)

    def layer_layouts(self, lay: DenseLayout, queries: Tensor) -> list[DenseLayout]:
        """One layout per layer: ``lay`` (the non-causal block) where the layer attends fully,
        else the same rows under its causal / sliding-window mask. ``queries [B, T]``: the
        position of each block row (keys sit at their positions)."""
        spec, out = self.spec, []
        masks: dict[tuple[bool, int | None], DenseLayout] = {}
        for causal, window in zip(spec.layer_causal, spec.layer_window, strict=True):
            if not causal and window is None:
                out.append(lay)
                continue
            key = (causal, window)
            if key not in masks:
                assert lay.mask is not None
                visible = lay.mask[:, 0, : lay.width] == 0  # [B, T, S] the block's own rule
                keys = torch.arange(lay.attn_len, device=queries.device)[None, None, :]
                q = queries[:, :, None]
                if causal:
                    visible = visible & (keys <= q)
                if window is not None:
                    visible = visible & (q - keys < window)
                    if not causal:
                        visible = visible & (keys - q < window)
                groups = lay.mask.shape[2] // lay.width
                mask = additive(visible, groups, lay.mask.dtype)
                masks[key] = dataclasses.replace(lay, mask=mask, _cos_sin=None)
            out.append(masks[key])
        return out

    def run_block(
        self, fwd: Forward, tokens: Tensor, cache: KVCache, lay: DenseLayout, queries: Tensor
    ) -> Tensor:
        """The block ``tokens [B, T]`` through every layer; final-normed rows ``[B*T, H]``."""
        x = fwd.embed(tokens.reshape(-1))
        if self.spec.input_embedding_scale != 1.0:
            x = x * self.spec.input_embedding_scale
        for i, (layer, lay_i) in enumerate(
            zip(fwd.layers, self.layer_layouts(lay, queries), strict=True)
        ):
            x = fwd.layer(layer, x, cache.k[i], cache.v[i], lay_i)
        return fwd.final_hidden(x)

    def logits(self, fwd: Forward, h: Tensor) -> Tensor:  # normed [M, H] -> [M, V]
        out = fwd.logits_normed(h)
        spec = self.spec
        if spec.output_multiplier != 1.0:
            out = out * spec.output_multiplier
        if spec.logit_softcap is not None and spec.logit_softcap > 0:
            out = torch.tanh(out / spec.logit_softcap) * spec.logit_softcap
        return out

    def select(
        self, h: Tensor, logits: Tensor, anchor: Tensor, ranks: int = 1
    ) -> Tensor:  # h [B, k, H], logits [B, k, V], anchor [B] -> [B, k, ranks]
        """DFlash2's greedy walk: the chosen token per position (rank 0), then the next best
        candidates under the same predecessor (for trees)."""
        sel = self.selector
        assert sel is not None
        unary, cand = logits.topk(sel.top_k, dim=-1)  # [B, k, top]
        proj = F.linear(h, sel.hidden_projection)  # [B, k, r]
        prev, out = anchor, []
        for p in range(h.shape[1]):
            scores = sel.scores(proj[:, p], unary[:, p], cand[:, p], prev)  # [B, top]
            order = scores.topk(min(ranks, sel.top_k), dim=-1).indices  # [B, R]
            picked = cand[:, p].gather(-1, order)  # [B, R]
            prev = picked[:, 0]
            out.append(picked)
        return torch.stack(out, dim=1)


def spec_for_target(
    target: ModelConfig,
    num_layers: int,
    block_size: int,
    mask_token_id: int,
    intermediate_size: int | None = None,
    target_layer_ids: Sequence[int] | None = None,
    kind: str = "dflash",
    **dflash2: int,
) -> DFlashSpec:
    """A full-attention drafter at ``target``'s width, heads and RoPE (what the trainer builds);
    ``dflash2``: ``conv_kernel_size``, ``conv_group_size``, ``selector_rank``, ``selector_top_k``."""
    layers = drafter_layers(target, "qwen3", True, num_layers, intermediate_size)
    ids = target_layer_ids or default_target_layers(target.num_layers, num_layers)
    return DFlashSpec(
        kind=kind,
        layers=layers,
        target_layer_ids=tuple(ids),
        block_size=block_size,
        mask_token_id=mask_token_id,
        layer_causal=(False,) * num_layers,
        layer_window=(None,) * num_layers,
        num_target_layers=target.num_layers,
        **dflash2,
    )


def uses_window(spec: DFlashSpec) -> bool:
    return any(
        c or w is not None for c, w in zip(spec.layer_causal, spec.layer_window, strict=True)
    )


def positions_of(start: Tensor, t: int) -> Tensor:  # start [B] -> [B, T] positions start + j
    return start[:, None] + torch.arange(t, device=start.device)


__all__: Sequence[str] = (
    "KINDS",
    "DFlashNet",
    "DFlashSpec",
    "default_target_layers",
    "positions_of",
    "spec_for_target",
    "uses_window",
)
