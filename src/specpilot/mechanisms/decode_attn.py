"""Split-KV attention: flash-decoding over each sequence's exact length for dense query blocks.

AR steps and chain verify attend a block of ``W`` rows per sequence to its cache. The stock layer
body runs SDPA over the whole attention bucket (a multiple of 128 keys, so that one CUDA graph
serves every length inside it) with an additive mask, at one query block per KV head (8 CTAs on
Llama-3-8B, most SMs idle), then copies the output from ``[B, H_kv, G*W, D]`` to the
``[B*W, H*D]`` rows ``w_o`` reads (``DenseLayout.gather``). ``kernels/decode_attn.py`` instead
splits the keys across ``(B, H_kv, splits)`` programs, reads only keys below ``start + W`` (device
lengths), merges the splits in one launch and writes ``[B*W, H*D]`` directly: one kernel per
layer instead of SDPA plus a transpose copy, and bytes read proportional to the true length.
``decode_attn_cost.py`` predicts its time (K/V bytes at bandwidth plus a launch latency) against
the measured SDPA time.

Plug point ``kernel_choice``: ``install`` sets ``Transformer.dense_attention``; ``Forward.attend``
uses it on the Triton path for every ``DenseLayout`` built by ``DenseLayout.build`` (AR steps,
chain verify, draft models and block drafters over the target; causal or not) of at most
``MAX_ROWS`` query rows per sequence (a wider prefill chunk is declined: SDPA). Packed (ragged,
tree) layouts and layouts with a mask of their own keep SDPA, and the stock forward that token
forcing trusts (torch reference ops) never uses the kernel. Knobs: ``keys_per_split`` (0: about
two programs per SM), ``block_n`` (keys per inner step), ``warps`` (0: both by the launch's query
rows, ``kernels/decode_attn_plan.tiling_for_rows``).

Why it is lossless: every query row sees exactly the keys the layout's mask lets it see
(``< start + j + 1``, clipped to the attention length) and computes the same softmax(q·kᵀ/√D)·v
in fp32 with another summation order (and ``p`` rounded once to bf16 before ``p·v`` in bf16
models, as SDPA's flash kernels do). The verify argmax is still the target's own up to kernel
rounding: zero difference expected in fp32 (``ieee`` dot, no TF32), counted as near-ties by token
forcing in bf16. The splits are merged in a fixed order, so results are deterministic.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from specpilot.errors import SpecPilotError
from specpilot.kernels.decode_attn_plan import MAX_ROWS
from specpilot.mechanisms.registry import Applicability, Knob, Mechanism

if TYPE_CHECKING:
    from specpilot.kernels.decode_attn_plan import DecodeAttnConfig
    from specpilot.mechanisms.parts import EngineParts
    from specpilot.models.layout import DenseLayout
    from specpilot.models.transformer import Transformer


@dataclass(slots=True)
class SplitKVAttention:
    """The ``dense_attention`` a model gets: one kernel launch per layer and forward."""

    cfg: DecodeAttnConfig
    calls: int = 0
    """Launches so far (eager runs and captures; a graph replay does not call it)."""
    _counters: dict[tuple[torch.device, int], Tensor] = field(default_factory=dict)

    def counters(self, device: torch.device, n: int) -> Tensor:  # [n] int32
        """Arrival counters for ``n`` (sequence, KV head) pairs, allocated once per size: every
        launch re-arms what it used, so graphs captured on them stay valid."""
        key = (device, n)
        buf = self._counters.get(key)
        if buf is None:
            from specpilot.kernels.decode_attn import counter_buffer

            buf = self._counters[key] = counter_buffer(n, 1, device)
        return buf

    def __call__(
        self, q: Tensor, k_cache: Tensor, v_cache: Tensor, lay: DenseLayout
    ) -> Tensor | None:
        """``q [B, H_kv, G*W, D]`` over ``[B, H_kv, S, D]`` caches → ``[B*W, H*D]``; None for a
        block wider than ``MAX_ROWS`` query rows (a prefill chunk: SDPA)."""
        from specpilot.kernels.decode_attn import decode_attention

        assert lay.start is not None
        b, hkv, rows = q.shape[:3]
        if rows > MAX_ROWS:
            return None
        self.calls += 1  # launches only
        return decode_attention(
            q, k_cache, v_cache, lay.start, lay.width, lay.attn_len,
            self.counters(q.device, b * hkv), lay.causal, self.cfg,
        )  # fmt: skip


def install(
    model: Transformer, keys_per_split: int = 0, block_n: int = 0, warps: int = 0
) -> SplitKVAttention:
    """Put the split-KV kernel in ``model.dense_attention``; returns it (``uninstall`` undoes)."""
    from specpilot.kernels import triton_usable
    from specpilot.kernels.decode_attn_plan import DecodeAttnConfig

    if not triton_usable(model.device):
        raise SpecPilotError(
            "Split-KV attention is a Triton kernel: it needs a CUDA device (or TRITON_INTERPRET=1)."
        )
    if model.dense_attention is not None:
        raise SpecPilotError("Another mechanism already chose this model's attention kernel.")
    try:
        cfg = DecodeAttnConfig(keys_per_split=keys_per_split, block_n=block_n, num_warps=warps)
    except ValueError as e:
        raise SpecPilotError(f"split-kv: {e}.") from None
    attn = SplitKVAttention(cfg)
    model.dense_attention = attn
    return attn


def uninstall(model: Transformer) -> None:
    """Back to SDPA. Graphs captured meanwhile still launch the kernel they captured, on the
    instance's arrival counters: keep the instance ``install`` returned alive while they can
    replay (a graph holds the counters' address, not the tensor)."""
    model.dense_attention = None


def _apply(build: EngineParts, knobs: Mapping[str, Any]) -> None:
    attn = install(build.target.model, **knobs)  # the knobs are install's keyword arguments
    c = attn.cfg
    split = f"{c.keys_per_split} keys" if c.keys_per_split else "auto"
    build.notes.append(
        f"split-kv: dense attention by split-KV flash decoding ({split} per split, "
        f"{c.block_n or 'auto'} keys per step, {c.num_warps or 'auto'} warps)"
    )


MECHANISM = Mechanism(
    name="split-kv",
    component="attn_kv",
    plug_point="kernel_choice",
    lossless=(
        "Every query row attends to exactly the keys the layout's mask shows it (below its "
        "sequence's committed length plus its causal position) and computes the same softmax "
        "attention in fp32 in another summation order; splits merge in a fixed order. Outputs "
        "differ from SDPA by rounding only (none expected in fp32; bf16 differences are "
        "near-ties for token forcing). Argument in mechanisms/decode_attn.py."
    ),
    apply=_apply,
    knobs=(
        Knob(
            "keys_per_split",
            0,
            choices=(0, 64, 128, 256, 512, 1024),
            doc="keys per split (0: enough splits for about two programs per SM)",
        ),
        Knob(
            "block_n",
            0,
            choices=(0, 16, 32, 64, 128),
            doc="keys per inner step of a program (0: by query rows, as measured on the H200)",
        ),
        Knob("warps", 0, choices=(0, 2, 4, 8), doc="warps per program (0: by query rows)"),
    ),
    applies=Applicability(devices=("cuda",)),
    summary="flash-decoding attention split over the keys, reading only each row's true length",
)

__all__ = ["MECHANISM", "SplitKVAttention", "install", "uninstall"]
