"""The EAGLE-3 kind of ``train-drafter``: the network (``models/eagle3.py``), its draft vocabulary,
its TTT ("training-time test") loss and its published format (``loading/eagle3*.py``), as
SpecForge's online recipe trains it (``OnlineEagle3Model``; SafeAILab/EAGLE ``traineagle3``).

* **Draft vocabulary.** The ``draft_vocab`` most frequent tokens of the regenerated responses
  (ties and never-seen tokens by increasing id, as SpecForge fills a short count), sorted:
  draft id d is target id ``d + d2t[d]``; ``t2d`` marks them. The full vocabulary is allowed.
* **Features.** The target's layer outputs ``aux_layer_ids`` (low, mid, high) → ``fc`` → ``g``.
* **TTT.** Step 0 is the inference forward over the sequence: row i reads ``(g_i, x_{i+1})`` at
  RoPE position i under causal attention, its output ``h⁰_i`` scores ``x_{i+2}``. Step k feeds
  each row its own previous output and the next true token, ``(h^{k-1}_i, x_{i+1+k})``, at RoPE
  position ``i + k``, and predicts ``x_{i+2+k}``; its query sees the step-0 keys of rows ``≤ i``
  and the keys of row i at steps ``1..k`` — exactly what the drafter's own cache holds when it
  drafts step k after a context ending at row i (SpecForge's ``cache_hidden`` attention). All
  steps run the one layer body (``Eagle3Net.step``): step k's K/V sit at slots ``k·S + i``.
* **Loss** (SpecForge's, not the greedy tokens): soft cross-entropy against the target's own
  distribution at the label's position, softmaxed over the draft vocabulary; a row trains when
  its input token and its label are response tokens and the target's argmax lies in the draft
  vocabulary. Step k weighs ``0.8^k``; the loss is the weighted mean over the trained rows.
* **Optimizer** (SpecForge ``train_eagle3``): lr 1e-4, clip 0.5; the schedule is the shared one.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specpilot.drafters.base import Drafter
from specpilot.drafters.eagle3 import Eagle3Drafter
from specpilot.errors import CheckpointError, SpecPilotError
from specpilot.models.eagle3 import Eagle3Net, Eagle3Spec, spec_for_target
from specpilot.models.forward import Forward
from specpilot.models.kv_cache import KVCache
from specpilot.models.layout import DenseLayout
from specpilot.train.checkpoint import write_text_atomic
from specpilot.train.recipe import SPEC_FILE, LossOut, copy_weights, make_trainable, run_spec

if TYPE_CHECKING:
    from specpilot.loading.tokenizer import TextTokenizer
    from specpilot.models.transformer import Transformer
    from specpilot.train.data import Sample
    from specpilot.train.settings import TrainSettings

DEFAULT_DRAFT_VOCAB = 16_000
"""Draft vocabulary when ``--draft-vocab`` is not given (capped at the target's): the size of
the published Qwen2.5-0.5B recipe, about a third of SmolLM2's 49,152 tokens."""
STEP_DECAY = 0.8
"""TTT step k's loss weight is ``STEP_DECAY ** k`` (SpecForge's ``ploss_weight``)."""
VOCAB_FILE = "draft_vocab.json"


def draft_vocab(samples: Sequence[Sample], vocab_size: int, n: int) -> tuple[Tensor, float]:
    """The ``n`` most frequent response tokens as sorted target ids ``[n]`` int64, and the share
    of the response tokens they cover."""
    flat = [t for s in samples for t in s.tokens[s.prompt_len :]]
    ids = torch.tensor(flat, dtype=torch.int64)
    if ids.numel() and not bool(((ids >= 0) & (ids < vocab_size)).all()):
        raise SpecPilotError(f"The responses hold token ids outside the target's {vocab_size}.")
    counts = torch.bincount(ids, minlength=vocab_size)  # [V]
    order = torch.argsort(counts, descending=True, stable=True)  # ties: lower id first
    chosen = order[:n].sort().values
    return chosen, float(counts[chosen].sum()) / max(1, ids.numel())


def ttt_layout(batch: int, s: int, step: int, groups: int, device: torch.device) -> DenseLayout:
    """TTT step ``step``'s ``S`` rows per sequence: K/V at slots ``step·S + i``, RoPE at ``i +
    step``; row i sees step 0's rows ``<= i`` and its own row of steps ``1..step`` (a bool mask,
    broadcast over the batch: autocast may run attention in another dtype than the cache's)."""
    i = torch.arange(s, device=device)
    keys = torch.arange((step + 1) * s, device=device)  # [L]
    row, from_step0 = keys % s, keys < s
    visible = torch.where(from_step0[None, :], row[None, :] <= i[:, None], row[None, :] == i[:, None])  # fmt: skip
    n = visible.shape[1]
    mask = visible[None, None].expand(1, groups, s, n).reshape(1, 1, groups * s, n)
    positions, slots = (i + step).repeat(batch), (i + step * s).repeat(batch)
    return DenseLayout(batch, s, n, positions, mask, None, slots)


def ttt_hidden(
    net: Eagle3Net, fwd: Forward, aux: Tensor, tokens: Tensor, steps: int
) -> list[Tensor]:
    """Pre-norm midlayer outputs ``[b*S, H]`` of TTT steps ``0..steps-1``, from the target's
    features ``aux [3, b, S, H_t]`` of ``tokens [b, S]``."""
    _, b, s, _ = aux.shape
    cfg, dev = net.cfg, tokens.device
    g = net.features(aux.to(net.dtype)).reshape(b * s, -1).float()  # fp32 residual under autocast
    empty = torch.zeros(b, cfg.num_kv_heads, s, cfg.head_dim, dtype=torch.float32, device=dev)
    ks: list[Tensor] = []
    vs: list[Tensor] = []
    outs: list[Tensor] = []
    for k in range(steps):
        ahead = tokens[:, 1 + k :]
        nxt = torch.cat([ahead, ahead.new_zeros(b, s - ahead.shape[1])], dim=1)  # [b, S] x_{i+1+k}
        # A fresh cache per step (earlier steps' K/V copied in): attention saved for the backward
        # pass keeps reading what it read.
        kc = torch.cat([*ks, empty], dim=2)  # [b, H_kv, (k+1)S, D]
        vc = torch.cat([*vs, empty], dim=2)
        cache = KVCache([kc], [vc], torch.zeros(b, dtype=torch.int64))
        g = net.step(fwd, g, nxt.reshape(-1), cache, ttt_layout(b, s, k, fwd.groups, dev))
        ks.append(kc[:, :, k * s :])
        vs.append(vc[:, :, k * s :])
        outs.append(g)
    return outs


@torch.no_grad()
def target_probs(
    target: Transformer, net: Eagle3Net, last: Tensor, chunk: int = 4096
) -> tuple[Tensor, Tensor]:
    """From the target's last layer output ``last [b, S, H]``: its next-token distribution over
    the draft vocabulary ``[b*S, Vd]`` (float32) and whether its argmax is in it ``[b*S]``."""
    fwd = target.stock_forward()
    x = fwd.final_hidden(last.reshape(-1, last.shape[-1]))  # [M, H]
    vd = net.spec.draft_vocab_size
    ids = torch.arange(vd, device=net.d2t.device) + net.d2t  # [Vd] target ids
    logits = F.linear(x, target.lm_head.index_select(0, ids.to(x.device))).float()  # [M, Vd]
    if vd == net.spec.vocab_size:
        return logits.softmax(-1), torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
    best = torch.cat([F.linear(x[j : j + chunk], target.lm_head).argmax(-1) for j in range(0, x.shape[0], chunk)])  # fmt: skip
    return logits.softmax(-1), net.t2d.to(x.device)[best]


def ttt_loss(
    net: Eagle3Net,
    fwd: Forward,
    hidden: Tensor,  # [4, b, S, H_t]: the aux layers, then the target's last layer
    tokens: Tensor,  # [b, S] int64
    loss_mask: Tensor,  # [b, S] bool: response tokens
    steps: int,
) -> LossOut:
    """EAGLE-3's TTT loss over ``steps`` unrolled steps (see the module doc)."""
    _, b, s, _ = hidden.shape
    probs, in_vocab = target_probs(net.target, net, hidden[3])  # [b*S, Vd], [b*S]
    outs = ttt_hidden(net, fwd, hidden[:3], tokens, steps)
    i = torch.arange(s, device=tokens.device)
    in_vocab = in_vocab.view(b, s)
    total = outs[0].new_zeros(())
    weight, trained_rows = 0.0, 0
    acc: list[float] = []
    for k, h in enumerate(outs):
        src, label = (i + 1 + k).clamp(max=s - 1), (i + 2 + k).clamp(max=s - 1)  # [S]
        trained = (i + 2 + k < s) & loss_mask[:, src] & loss_mask[:, label] & in_vocab[:, src]
        rows = trained.reshape(-1).nonzero().squeeze(1)  # [R] rows b*S + i
        logits = net.draft_scores(fwd, h.index_select(0, rows)).float()  # [R, Vd]
        want = probs.index_select(0, rows + 1 + k)  # the target at position i + 1 + k
        ce = -(want * F.log_softmax(logits, dim=-1)).sum(-1)  # [R]
        total = total + STEP_DECAY**k * ce.sum()
        weight += STEP_DECAY**k * rows.numel()
        trained_rows += int(rows.numel())
        with torch.no_grad():
            hit = (logits.argmax(-1) == want.argmax(-1)).float()
            acc.append(float(hit.mean()) if rows.numel() else math.nan)
    return LossOut(total / max(weight, 1e-6), acc, trained_rows)


class Eagle3Recipe:
    kind = "eagle3"
    default_lr = 1e-4  # SpecForge train_eagle3 --learning-rate
    max_grad_norm = 0.5  # SpecForge --max-grad-norm

    def __init__(self) -> None:
        self.ttt_length = 7
        self._fwd: Forward | None = None

    def create(
        self, target: Transformer, tokenizer: TextTokenizer, settings: TrainSettings, out: Path
    ) -> nn.Module:
        from specpilot.loading.eagle3 import check_compatible, spec_from_config
        from specpilot.loading.eagle3_save import config_from_spec

        s = settings
        self.ttt_length = s.ttt_length
        if s.seq_len + s.ttt_length > target.max_positions:
            raise SpecPilotError(
                f"--seq-len {s.seq_len} plus --ttt-length {s.ttt_length} passes the target's "
                f"{target.max_positions} positions; give a shorter --seq-len."
            )
        spec = run_spec(
            out,
            lambda cfg, where: spec_from_config(cfg, target.cfg.num_layers, where),
            lambda: new_spec(target, s.draft_vocab, s.intermediate),
            lambda spec: config_from_spec(spec, torch.float32),
        )
        check_compatible(spec, target.cfg, str(out / SPEC_FILE), {})  # resumed for another?
        return self.build(target, spec, s.seed)

    def build(self, target: Transformer, spec: Eagle3Spec, seed: int) -> Eagle3Net:
        """A freshly initialised fp32 network, parameters trainable."""
        net = Eagle3Net(spec, target, torch.float32)
        make_trainable(net, seed)
        self._fwd = Forward(net, use_triton=False, fuse_residual=False)
        return net

    def fit(self, net: nn.Module, samples: Sequence[Sample], out: Path) -> str | None:
        """The draft vocabulary from the responses, or the one an earlier run chose."""
        assert isinstance(net, Eagle3Net)
        vd, path = net.spec.draft_vocab_size, out / VOCAB_FILE
        if path.is_file():
            ids = torch.tensor(json.loads(path.read_text())["target_ids"], dtype=torch.int64)
            if ids.shape != (vd,):
                raise CheckpointError(f"{path} lists {ids.numel()} draft tokens, not {vd}.")
            line = f"draft vocabulary: the {vd:,} tokens of {path}"
        else:
            ids, share = draft_vocab(samples, net.spec.vocab_size, vd)
            write_text_atomic(path, json.dumps({"target_ids": ids.tolist(), "coverage": share}) + "\n")  # fmt: skip
            line = f"draft vocabulary: {vd:,} tokens, {100 * share:.2f}% of the response tokens"
        net.set_vocab((ids - torch.arange(vd)).to(net.d2t.device))
        return line

    def hidden_layers(self, net: nn.Module) -> tuple[int, ...]:
        assert isinstance(net, Eagle3Net)
        return (*net.spec.aux_layer_ids, net.target.cfg.num_layers - 1)

    def loss(
        self,
        net: nn.Module,
        hidden: Tensor,
        tokens: Tensor,
        loss_mask: Tensor,
        gen: torch.Generator,
    ) -> LossOut:
        assert isinstance(net, Eagle3Net) and self._fwd is not None
        return ttt_loss(net, self._fwd, hidden, tokens, loss_mask, self.ttt_length)

    def eval_drafter(self, target: Transformer, net: nn.Module) -> Drafter:
        assert isinstance(net, Eagle3Net)
        drafter = Eagle3Drafter(Eagle3Net(net.spec, target))
        self.sync(drafter, net)
        return drafter

    def sync(self, drafter: Drafter, net: nn.Module) -> None:
        assert isinstance(drafter, Eagle3Drafter) and isinstance(net, Eagle3Net)
        copy_weights(drafter.net, net)
        drafter.net.set_vocab(net.d2t)  # in place too

    def save(self, net: nn.Module, out: Path) -> Path:
        from specpilot.loading.eagle3_save import save_eagle3

        assert isinstance(net, Eagle3Net)
        return save_eagle3(net, out)

    def load(self, target: Transformer, path: Path) -> Drafter:
        return Eagle3Drafter.load(target, path)


def new_spec(target: Transformer, draft: int | None, intermediate: int | None) -> Eagle3Spec:
    """A midlayer at the target's shape; ``draft`` tokens of draft vocabulary (None: the default,
    capped at the target's vocabulary)."""
    v = target.cfg.vocab_size
    n = min(DEFAULT_DRAFT_VOCAB, v) if draft is None else draft
    if n > v:
        raise SpecPilotError(
            f"--draft-vocab {n} is larger than the target's vocabulary of {v} tokens; give at "
            f"most {v} (all of it: {v})."
        )
    return spec_for_target(target.cfg, n, intermediate)
