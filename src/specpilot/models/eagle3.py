"""The EAGLE-3 drafter network: one decoder "midlayer" that drafts a token per step from the
target's hidden states of three layers and, after the first step, from its own output
(Li et al., arXiv 2503.01840; SafeAILab/EAGLE, SpecForge, sglang ``llama_eagle3.py``).

* **Features.** The outputs of target layers ``aux_layer_ids`` (low, mid, high; HF
  ``hidden_states[id + 1]``) are concatenated per token and projected by ``fc``
  (``[H, 3·H_target]``, no bias) to ``g``.
* **Row j** (KV slot j, RoPE position j) reads ``g_j`` and the target embedding of the *next*
  token ``x_{j+1}``: q/k/v project ``[input_layernorm(embed(x_{j+1})) ; hidden_norm(g_j)]``
  (``2H`` wide) under causal attention over the rows before it; the residual is ``g_j`` itself;
  then ``post_attention_layernorm``, the SwiGLU MLP and its residual give ``h_j``.
* **Output.** ``lm_head(norm(h_j))`` scores the ``draft_vocab_size`` tokens of the draft
  vocabulary; draft id d is target id ``d + d2t[d]``. Row j predicts ``x_{j+2}``.
* **Autoregressive steps.** The next row uses ``h_j`` (pre-norm) in place of the target's
  feature of the token it just drafted: ``(h_j, embed(draft))`` at slot j + 1, and so on.

The midlayer is the one layer body (``models/forward.py``) with its ``attn_prefix`` plug: the
normed embedding columns go in front of the normed hidden state. The embedding is the target's;
``lm_head`` is the drafter's own (over the draft vocabulary).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specpilot.config import ModelConfig
from specpilot.models.drafter_net import DrafterNet, drafter_layers
from specpilot.models.forward import Forward
from specpilot.models.kv_cache import KVCache
from specpilot.models.layer import DecoderLayer
from specpilot.models.layout import DenseLayout
from specpilot.models.transformer import Transformer

KIND = "eagle3"


def default_aux_layers(num_target_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default low / mid / high layers as layer-output ids: HF ``hidden_states``
    ``[2, N//2, N-3]`` are the outputs of layers ``1, N//2 - 1, N - 4`` (SmolLM2, 30 layers:
    1, 14, 26). Clamped into the layers for tiny targets."""
    n = num_target_layers
    return tuple(min(max(i, 0), n - 1) for i in (1, n // 2 - 1, n - 4))  # type: ignore[return-value]


@dataclass(frozen=True, slots=True)
class Eagle3Spec:
    """Everything an EAGLE-3 checkpoint's config.json says about the drafter."""

    layer: ModelConfig
    """The midlayer (Llama: no q/k norm, no bias); ``vocab_size`` is the target's."""
    aux_layer_ids: tuple[int, ...]
    """Target layers (layer-output ids) whose outputs ``fc`` reads, low | mid | high."""
    draft_vocab_size: int
    """Rows of the drafter's ``lm_head`` (``d2t`` maps them to target ids)."""
    target_hidden_size: int
    """Width of each target feature (``fc`` reads ``3 ×`` this)."""

    def __post_init__(self) -> None:
        if len(self.aux_layer_ids) != 3:
            raise ValueError(f"EAGLE-3 reads 3 target layers, not {list(self.aux_layer_ids)}")
        if not 1 <= self.draft_vocab_size <= self.layer.vocab_size:
            raise ValueError(
                f"draft_vocab_size {self.draft_vocab_size} is not within the vocabulary of "
                f"{self.layer.vocab_size}"
            )

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.layer.vocab_size

    def num_params(self) -> int:
        """Stored parameters (the embedding excluded: it is the target's; d2t/t2d excluded)."""
        h = self.hidden_size
        mid = self.layer.matrix_params(in_width=2 * h) + 3 * h  # q/k/v read [embeds ; hidden]
        return 3 * self.target_hidden_size * h + mid + h + self.draft_vocab_size * h


class Eagle3Net(DrafterNet):
    """The drafter's weights (``fc``, the midlayer, ``norm``, ``lm_head``, ``d2t``/``t2d``) plus
    the target's embedding, shared and never registered as a parameter."""

    def __init__(
        self, spec: Eagle3Spec, target: Transformer, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__(spec.layer, target, dtype)
        dev, dt = target.device, self.dtype
        c, h = spec.layer, spec.hidden_size
        self.spec = spec

        def p(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(shape, dtype=dt, device=dev), requires_grad=False)

        self.midlayer = DecoderLayer(c, dt, dev)
        self.midlayer.w_qkv = p(c.q_size + 2 * c.kv_size, 2 * h)  # reads [embeds ; hidden]
        self.layers = nn.ModuleList([self.midlayer])
        self.embed_norm = p(h)  # midlayer.input_layernorm (the midlayer's input_norm: hidden_norm)
        self.fc = p(h, 3 * spec.target_hidden_size)
        self.final_norm = p(h)
        self.draft_head = p(spec.draft_vocab_size, h)
        self.d2t: Tensor  # [Vd] int64: target id = d + d2t[d]
        self.t2d: Tensor  # [V] bool: target ids in the draft vocabulary
        self.register_buffer("d2t", torch.zeros(spec.draft_vocab_size, dtype=torch.int64, device=dev))  # fmt: skip
        self.register_buffer("t2d", torch.zeros(spec.vocab_size, dtype=torch.bool, device=dev))

    # --------------------------------------------------------------- what Forward reads
    @property
    def lm_head(self) -> Tensor:  # [Vd, H] the drafter's own
        return self.draft_head

    @property
    def lm_head_in_out(self) -> Tensor | None:
        return None

    def init_random(self, seed: int, std: float = 0.02, norm_std: float = 0.1) -> None:
        """Seeded weights (N(0, std) matrices, N(1, norm_std) norms) and a seeded draft
        vocabulary: ``draft_vocab_size`` distinct target ids in increasing order."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        with torch.no_grad():
            for prm in self.parameters():
                if prm.dim() == 1:
                    prm.copy_(1.0 + norm_std * torch.randn(prm.shape, generator=gen))
                else:
                    prm.copy_(std * torch.randn(prm.shape, generator=gen))
            v, vd = self.spec.vocab_size, self.spec.draft_vocab_size
            ids = torch.randperm(v, generator=gen)[:vd].sort().values  # [Vd]
            self.set_vocab(ids - torch.arange(vd))

    def set_vocab(self, d2t: Tensor) -> None:  # d2t [Vd] int64; t2d follows from it
        with torch.no_grad():
            self.d2t.copy_(d2t)
            self.t2d.zero_()
            self.t2d[torch.arange(len(d2t), device=self.d2t.device) + self.d2t] = True

    # --------------------------------------------------------------- pieces of one draft
    def features(self, hidden: Tensor) -> Tensor:  # [3, B, T, H_t] -> g [B, T, H]
        n, b, t, ht = hidden.shape
        feats = hidden.permute(1, 2, 0, 3).reshape(b, t, n * ht)  # low | mid | high
        return F.linear(feats, self.fc)

    def step(
        self, fwd: Forward, g: Tensor, tokens: Tensor, cache: KVCache, lay: DenseLayout
    ) -> Tensor:  # g [M, H] (fc'd or the last output), tokens [M] target ids -> h [M, H]
        """Rows ``(g_j, x_{j+1})`` through the midlayer at the layout's slots; pre-norm output."""
        prefix = fwd.norm(fwd.embed(tokens), self.embed_norm)  # [M, H]
        return fwd.layer(self.midlayer, g, cache.k[0], cache.v[0], lay, attn_prefix=prefix)

    def draft_scores(self, fwd: Forward, h: Tensor) -> Tensor:  # [M, H] -> [M, Vd]
        return fwd.logits(h)

    def to_target(self, d: Tensor) -> Tensor:  # draft ids [...] -> target ids [...]
        return d + self.d2t[d]


def spec_for_target(
    target: ModelConfig,
    draft_vocab_size: int | None = None,
    intermediate_size: int | None = None,
    aux_layer_ids: Sequence[int] | None = None,
) -> Eagle3Spec:
    """A midlayer at ``target``'s width, heads and RoPE (what a trainer builds)."""
    layer = drafter_layers(target, "llama", False, 1, intermediate_size)
    ids = tuple(aux_layer_ids) if aux_layer_ids else default_aux_layers(target.num_layers)
    return Eagle3Spec(layer, ids, draft_vocab_size or target.vocab_size, target.hidden_size)


__all__: Sequence[str] = (
    "KIND",
    "Eagle3Net",
    "Eagle3Spec",
    "default_aux_layers",
    "spec_for_target",
)
