"""DFlash's training objective (SpecForge ``OnlineDFlashModel``; DRAFTERS.md §1, Training).

For each sequence, up to ``n_anchors`` anchor positions t are drawn where ``loss_mask[t]`` and
``loss_mask[t+1]`` hold (a response token that has a response token after it: at inference the
anchor is the last committed token). Anchor t's block is ``[x_t, mask × (B-1)]`` at positions
``t .. t+B-1``; it sees the context features of positions ``< t`` and, bidirectionally, its own
block, nothing of other blocks. Row j predicts ``x_{t+j}``; its cross-entropy weighs
``exp(-(j-1)/γ)`` (row 0 is the anchor itself and weighs 0; labels past the sequence or outside
the loss mask weigh 0). The loss is the weighted mean.

All blocks of a batch run in one forward of the one layer body: a sequence's K/V cache holds the
``S`` context rows at slots ``0..S-1`` and the ``N·B`` block rows after them, under the mask above.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from specpilot.models.dflash import DFlashNet
from specpilot.models.forward import Forward
from specpilot.models.layout import DenseLayout
from specpilot.train.recipe import LossOut


@dataclass(slots=True)
class Blocks:
    """The anchors of a batch and what their blocks feed and predict."""

    anchors: Tensor  # [b, N] int64 anchor positions (0 where not kept)
    keep: Tensor  # [b, N] bool: a real anchor
    inputs: Tensor  # [b, N*B] int64: anchor token, then mask tokens
    positions: Tensor  # [b, N*B] int64: anchor + j
    labels: Tensor  # [b, N, B] int64: x_{anchor+j}
    weights: Tensor  # [b, N, B] float32: decayed CE weight (0: not trained)


def sample_anchors(
    loss_mask: Tensor, n_anchors: int, gen: torch.Generator
) -> tuple[Tensor, Tensor]:
    """``loss_mask [b, S]`` → (anchors ``[b, N]`` sorted, keep ``[b, N]``), N ≤ ``n_anchors``."""
    valid = loss_mask[:, :-1] & loss_mask[:, 1:]  # [b, S-1]
    counts = valid.sum(dim=1)
    n = max(1, min(n_anchors, int(counts.max())))
    noise = torch.rand(valid.shape, generator=gen).to(valid.device)
    noise = torch.where(valid, noise, torch.full_like(noise, 2.0))  # invalid ones sort last
    picked = noise.argsort(dim=1)[:, :n]  # [b, N]: a random subset of the valid positions
    keep = torch.arange(n, device=valid.device)[None, :] < counts[:, None]
    return torch.where(keep, picked, torch.zeros_like(picked)), keep


def make_blocks(
    tokens: Tensor, loss_mask: Tensor, anchors: Tensor, keep: Tensor, block: int, mask_id: int,
    gamma: float,
) -> Blocks:  # fmt: skip
    """Inputs, positions, labels and weights of every anchor's block (see the module doc)."""
    b, s = tokens.shape
    n = anchors.shape[1]
    j = torch.arange(block, device=tokens.device)
    pos = anchors[:, :, None] + j  # [b, N, B]
    inside = pos < s
    safe = pos.clamp(max=s - 1)
    labels = tokens.gather(1, safe.reshape(b, -1)).view(b, n, block)
    masked = loss_mask.gather(1, safe.reshape(b, -1)).view(b, n, block)
    decay = torch.exp(-(j - 1).clamp(min=0).float() / gamma) * (j > 0).float()  # [B]
    weights = decay * (keep[:, :, None] & inside & masked).float()
    inputs = torch.full((b, n, block), mask_id, dtype=torch.int64, device=tokens.device)
    inputs[:, :, 0] = tokens.gather(1, anchors)
    return Blocks(anchors, keep, inputs.view(b, -1), pos.view(b, -1), labels, weights)


def block_layout(blocks: Blocks, s: int, block: int, groups: int) -> DenseLayout:
    """The layout of every block row: K/V at slots ``S + i``, RoPE at ``anchor + j``, and the
    mask (a bool one: autocast may run attention in another dtype than the cache's)."""
    b, w = blocks.inputs.shape
    dev = blocks.inputs.device
    keys = torch.arange(s + w, device=dev)  # [S + W]
    row_block = torch.arange(w, device=dev) // block  # [W]
    anchor = blocks.anchors.repeat_interleave(block, dim=1)  # [b, W]
    ctx = keys[None, None, :] < anchor[:, :, None]  # context strictly before the anchor
    own = (keys[None, :] >= s) & ((keys[None, :] - s) // block == row_block[:, None])  # [W, S+W]
    visible = ctx | own[None]  # [b, W, S+W]
    mask = visible[:, None, None].expand(b, 1, groups, w, s + w).reshape(b, 1, groups * w, s + w)
    slots = (s + torch.arange(w, device=dev)).repeat(b)
    return DenseLayout(b, w, s + w, blocks.positions.reshape(-1), mask, None, slots, block)


def block_hidden(
    net: DFlashNet, fwd: Forward, hidden: Tensor, blocks: Blocks, dtype: torch.dtype
) -> Tensor:
    """Final-normed drafter rows ``[b*N*B, H]`` for the blocks, context ``hidden [n, b, S, H]``."""
    _, b, s, _ = hidden.shape
    w = blocks.inputs.shape[1]
    cfg = net.cfg
    shape = (b, cfg.num_kv_heads, s + w, cfg.head_dim)
    k = [torch.zeros(shape, dtype=dtype, device=hidden.device) for _ in fwd.layers]
    v = [torch.zeros(shape, dtype=dtype, device=hidden.device) for _ in fwd.layers]
    ctx = net.context(fwd, hidden)  # [b*S, H]
    writes = DenseLayout.writes(torch.zeros(b, dtype=torch.int64, device=hidden.device), s)
    lay = block_layout(blocks, s, net.spec.block_size, fwd.groups)
    x = fwd.embed(blocks.inputs.reshape(-1)).float()  # an fp32 residual stream under autocast
    if net.spec.input_embedding_scale != 1.0:
        x = x * net.spec.input_embedding_scale
    for i, layer in enumerate(fwd.layers):
        fwd.write_kv(layer, ctx, k[i], v[i], writes)
        x = fwd.layer(layer, x, k[i], v[i], lay)
    return fwd.final_hidden(x)


def dflash_loss(
    net: DFlashNet, fwd: Forward, hidden: Tensor, blocks: Blocks, dtype: torch.dtype
) -> LossOut:
    """The weighted block cross-entropy (only rows with weight > 0 reach the LM head)."""
    h = block_hidden(net, fwd, hidden, blocks, dtype)  # [b*N*B, H]
    wts = blocks.weights.reshape(-1)
    rows = wts.nonzero().squeeze(1)
    logits = net.logits(fwd, h.index_select(0, rows)).float()  # [R, V]
    labels = blocks.labels.reshape(-1).index_select(0, rows)
    ce = F.cross_entropy(logits, labels, reduction="none")
    w = wts.index_select(0, rows)
    loss = (ce * w).sum() / w.sum().clamp(min=1e-6)
    with torch.no_grad():
        block = blocks.labels.shape[2]
        j = rows % block
        hit = (logits.argmax(-1) == labels).float()
        acc = [
            float(hit[j == i].mean()) if bool((j == i).any()) else math.nan for i in range(1, block)
        ]
    return LossOut(loss, acc, int(rows.numel()))
