"""Cost model of split-KV attention (``decode_attn.py``) against SDPA over the bucket, per layer.

A forward of ``W`` rows per sequence over committed lengths ``start_b`` and an attention bucket
``attn_len``:

* **split-KV**: one launch reading K and V of the ``min(start_b + W, attn_len)`` keys each row
  sees, q, the output, and for rows with several valid splits their fp32 partials (written, then
  read by the merging program): ``t = launch_s + bytes / BW_eff``;
* **SDPA** (when its time is not measured): two launches (attention, then the ``gather``
  transpose copy) reading K and V of all ``attn_len`` keys, the additive mask, q, and writing
  and copying the output: ``t = 2 launch_s + bytes / BW_eff``;

with ``BW_eff = min(BW, programs · BW / SMs)``: a program (CTA) streams at most its SM's share
of the bandwidth (SDPA runs one program per sequence and KV head for up to 128 query rows;
split-KV one per valid split). Saved per forward: ``layers · (t_sdpa − t_split)``, where the
measured SDPA time (the bench passes it, with its copy) replaces the modelled one.
Assumptions, printed beside every prediction: one CTA per SM streams at most ``BW / SMs``; the
launch latency is the same for every kernel; partials and mask cost their bytes once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specpilot.config import ModelConfig
from specpilot.kernels.decode_attn_plan import (
    DEFAULT_CONFIG,
    DecodeAttnConfig,
    block_d,
    cdiv,
    split_plan,
    valid_splits,
)
from specpilot.mechanisms.saving import StepSaving

ASSUMPTIONS = (
    "one CTA per SM streams at most bandwidth/SMs; every launch costs the same latency; "
    "partials and the mask cost their bytes once"
)
SDPA_QUERY_BLOCK = 128
"""Query rows per SDPA program (flash kernels' tile)."""


@dataclass(frozen=True, slots=True)
class AttnTime:
    bytes: int
    programs: int
    launches: int
    seconds: float


@dataclass(frozen=True, slots=True)
class DecodeAttnPrediction(StepSaving):
    split_kv: AttnTime
    """Per layer."""
    sdpa: AttnTime
    """Per layer: modelled, or the measured seconds with the modelled bytes."""
    sdpa_measured: bool
    layers: int

    @property
    def saved_s(self) -> float:
        """Time taken off one forward (all layers; negative: the kernel loses)."""
        return self.layers * (self.sdpa.seconds - self.split_kv.seconds)


def _time(
    nbytes: int, programs: int, launches: int, bw: float, sms: int, launch_s: float
) -> AttnTime:
    eff = min(bw, max(programs, 1) * bw / sms)
    return AttnTime(nbytes, programs, launches, launches * launch_s + nbytes / eff)


def predict(
    cfg: ModelConfig,
    starts: Sequence[int],
    width: int,
    attn_len: int,
    bandwidth_Bps: float,
    launch_s: float,
    num_sms: int,
    knobs: DecodeAttnConfig = DEFAULT_CONFIG,
    dtype_bytes: int = 2,
    sdpa_s: float | None = None,
) -> DecodeAttnPrediction:
    """Split-KV vs SDPA per layer for rows at committed lengths ``starts`` (one per sequence),
    ``width`` rows each, bucket ``attn_len``; ``sdpa_s``: measured SDPA + gather per layer."""
    if bandwidth_Bps <= 0 or launch_s < 0 or num_sms <= 0:
        raise ValueError("bandwidth and SM count must be positive, launch time non-negative")
    b, hkv, d = len(starts), cfg.num_kv_heads, cfg.head_dim
    rows = cfg.num_heads // hkv * width
    io = 2 * b * rows * hkv * d * dtype_bytes  # q read, output written
    splits, split_len = split_plan(attn_len, b, hkv, rows, knobs, num_sms)
    kv = 0
    programs = 0
    partial = 0
    for start in starts:
        end = min(start + width, attn_len)
        kv += 2 * hkv * end * d * dtype_bytes
        n = min(valid_splits(end, split_len), splits)
        programs += hkv * n
        if n > 1:
            partial += 2 * hkv * n * rows * (block_d(d) + 2) * 4
    split_t = _time(kv + io + partial, programs, 1, bandwidth_Bps, num_sms, launch_s)
    sdpa_bytes = (
        2 * b * hkv * attn_len * d * dtype_bytes  # K and V of the whole bucket
        + b * rows * attn_len * dtype_bytes  # the additive mask
        + io
        + b * rows * hkv * d * dtype_bytes * 2  # the gather copy (read + write)
    )
    sdpa_programs = b * hkv * cdiv(rows, SDPA_QUERY_BLOCK)
    sdpa_t = _time(sdpa_bytes, sdpa_programs, 2, bandwidth_Bps, num_sms, launch_s)
    if sdpa_s is not None:
        sdpa_t = AttnTime(sdpa_t.bytes, sdpa_t.programs, sdpa_t.launches, sdpa_s)
    return DecodeAttnPrediction(split_t, sdpa_t, sdpa_s is not None, cfg.num_layers)


__all__ = ["ASSUMPTIONS", "AttnTime", "DecodeAttnPrediction", "predict"]
