"""Lossless mechanisms, each registered once by name (see ``registry.py`` for what they declare).

To add one: write ``mechanisms/<name>.py`` exposing ``MECHANISM = Mechanism(...)`` and add it to
the tuple below. Nothing else in the engine names it.
"""

from __future__ import annotations

from specpilot.mechanisms.adaptive_block import MECHANISM as ADAPTIVE_BLOCK
from specpilot.mechanisms.decode_attn import MECHANISM as SPLIT_KV
from specpilot.mechanisms.exact_argmax import MECHANISM as EXACT_ARGMAX
from specpilot.mechanisms.fp8_prefilter import MECHANISM as FP8_PREFILTER
from specpilot.mechanisms.fused_gemv import MECHANISM as FUSED_GEMV
from specpilot.mechanisms.gguf_blocks import MECHANISM as GGUF_BLOCKS
from specpilot.mechanisms.int8_drafter import MECHANISM as INT8_DRAFTER
from specpilot.mechanisms.l2_prefetch import MECHANISM as L2_PREFETCH
from specpilot.mechanisms.ragged_verify import MECHANISM as RAGGED_VERIFY
from specpilot.mechanisms.registry import (
    COMPONENTS,
    PLUG_POINTS,
    Applicability,
    Knob,
    Mechanism,
    canonical,
)
from specpilot.mechanisms.row_block_len import MECHANISM as ROW_BLOCK_LEN
from specpilot.mechanisms.tiered_budget import MECHANISM as TIERED_BUDGET
from specpilot.mechanisms.tree_verify import MECHANISM as TREE_VERIFY
from specpilot.mechanisms.tree_verify import RAGGED_TREES
from specpilot.mechanisms.two_level import MECHANISM as TWO_LEVEL
from specpilot.mechanisms.w12 import MECHANISM as W12

_ALL: tuple[Mechanism, ...] = (
    W12,
    EXACT_ARGMAX,
    TREE_VERIFY,
    TWO_LEVEL,
    ADAPTIVE_BLOCK,
    RAGGED_VERIFY,
    TIERED_BUDGET,
    ROW_BLOCK_LEN,
    RAGGED_TREES,
    FP8_PREFILTER,
    L2_PREFETCH,
    SPLIT_KV,
    FUSED_GEMV,
    GGUF_BLOCKS,
    INT8_DRAFTER,
)

MECHANISMS: dict[str, Mechanism] = {m.name: m for m in _ALL}
"""Name → mechanism; built once at import, never mutated."""

__all__ = [
    "COMPONENTS",
    "MECHANISMS",
    "PLUG_POINTS",
    "Applicability",
    "Knob",
    "Mechanism",
    "canonical",
]
