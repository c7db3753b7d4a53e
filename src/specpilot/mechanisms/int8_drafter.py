"""INT8 drafter: the drafter's decoder matrices, and the LM head it drafts through, read from an
INT8 copy (``mechanisms/int8_copy.py``: weight-only, one fp32 scale per output row).

Where it pays: a learned drafter's step is a memory-bound forward of its own layers plus the LM
head, at the block's width. On the H200 the block drafter of the 8B shape took 0.247 × an AR step
per cycle (its bf16 bytes alone 0.18×; issue 26 asks for ≤ 0.15×), and the INT8 GEMM there ran
1.23–1.55× bf16 on the 8B linear shapes at M = 16 and 2.0× on the LM head (docs/BENCHMARKS.md,
INT8 copy). Predicted: the drafter's matrices at about 0.67× their time and its head at 0.5×; the
rest of its step (attention over the context, norms, the K/V writes) unchanged. Not measured on a
GPU yet.

Why it is lossless: a drafter only proposes. Every committed token is still the target's own
argmax, computed by the target's untouched weights in the verify; a draft the INT8 copy bends is
rejected there, which can lower the acceptance (the tune measures τ with the speed, under real
acceptance) but never change a committed token. What would break that is an INT8 copy inside the
*target's* forward, so a drafter that runs the target's own layers (the early-exit draft model) is
refused, and the head goes to the drafter's own ``Forward`` (``Forward.head_fn``), never to the
model the target's engine runs. Token forcing gates every trial, as for every mechanism.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from specpilot.errors import SpecPilotError
from specpilot.mechanisms.int8_copy import Int8Linear
from specpilot.mechanisms.registry import Applicability, Knob, Mechanism
from specpilot.models.forward import Forward

if TYPE_CHECKING:
    from specpilot.drafters.base import Drafter
    from specpilot.mechanisms.parts import EngineParts

MATRICES = ("w_qkv", "w_o", "w_gate_up", "w_down")
DRAFTERS = ("block", "dflash", "draft-model")


def drafter_forward(drafter: Drafter | None) -> Forward[Any] | None:
    """The ``Forward`` a drafter runs its own layers with, through wrappers (``.inner``:
    simulated acceptance); None for a drafter without one (n-gram)."""
    d: Any = drafter
    for _ in range(4):
        if d is None:
            return None
        fwd = getattr(d, "fwd", None)
        if isinstance(fwd, Forward):
            return fwd
        d = getattr(d, "inner", None)
    return None


def _apply(parts: EngineParts, knobs: Mapping[str, Any]) -> None:
    fwd = drafter_forward(parts.drafter)
    if fwd is None:
        raise SpecPilotError("int8-drafter: this drafter runs no layers of its own to copy.")
    target_layers = {id(layer) for layer in parts.target.model.layers}
    if any(id(layer) in target_layers for layer in fwd.layers):
        raise SpecPilotError(
            "int8-drafter: the drafter runs the target's own layers (an early-exit draft model); "
            "an INT8 copy there would change the target's forward."
        )
    taken = sorted({n for layer in fwd.layers for n in set(MATRICES) & set(layer.linear_fns)})
    if taken or fwd.head_fn is not None:
        raise SpecPilotError(
            f"int8-drafter: {taken or 'the head'} already have a kernel installed."
        )
    max_m = int(knobs["max_m"])
    copied = 0
    for layer in fwd.layers:
        for name in MATRICES:
            layer.linear_fns[name] = Int8Linear(getattr(layer, name), max_m)
            copied += 1
    if knobs["head"]:  # [M, hidden] -> [M, vocab], on the drafter's Forward only
        fwd.head_fn = Int8Linear(fwd.model.lm_head, max_m)
    parts.notes.append(
        f"int8-drafter: {copied} drafter matrices{' and its LM head' if knobs['head'] else ''}"
    )


MECHANISM = Mechanism(
    name="int8-drafter",
    component="draft",
    plug_point="drafter_weights",
    lossless=(
        "Only the drafter's own matrices and the LM head it drafts through read an INT8 copy; the "
        "target's forward is untouched (a drafter running the target's layers is refused), so a "
        "bent draft is rejected by the verify and every committed token is still the target's "
        "argmax. Argument in mechanisms/int8_drafter.py."
    ),
    apply=_apply,
    knobs=(
        Knob(
            "head",
            True,
            choices=(True, False),
            doc="the drafter's LM head from an INT8 copy too (2.0x bf16 on the H200's 8B head)",
        ),
        Knob(
            "max_m",
            64,
            choices=(16, 64, 256),
            doc="rows per call up to which the INT8 kernel runs (a block drafter's step: block "
            "rows per request); more rows (prefill) use the bf16 weights",
        ),
    ),
    applies=Applicability(devices=("cuda",), dtypes=("bf16", "bfloat16"), drafters=DRAFTERS),
    summary="the drafter's weights and drafting LM head from an INT8 copy (drafts only)",
)

__all__ = ["MECHANISM", "drafter_forward"]
