"""Which mechanisms attack which cost-model component.

Registered mechanisms (``specpilot.mechanisms.MECHANISMS``) declare their component; they are
listed first. The rest is a static map: what the one engine does by construction (CUDA graphs,
static shapes, fused kernels, device accept: status ``engine``, on by default on CUDA rather than
a registry entry), and what is not built yet (``planned``).
"""

from __future__ import annotations

from dataclasses import dataclass

_WEIGHTS = (
    ("W12", "w12", "lossless 12-bit weights: a quarter fewer weight bytes per step"),
    ("two-level verify", "two-level", "an INT8 copy corrects the draft, the exact target verifies"),
    ("L2 prefetch", "l2-prefetch", "prefetch the next layer's weights into L2 across kernels"),
)

PLANNED: dict[str, tuple[tuple[str, str, str], ...]] = {
    "embedding": (),
    "attn_proj": _WEIGHTS,
    "mlp": _WEIGHTS,
    "attn_kv": (
        ("split-KV attention", "split-kv", "flash-decoding style split of long contexts"),
        ("tree verify", "tree-verify", "one context read serves more candidate tokens"),
    ),
    "lm_head": (
        (
            "exact-argmax head",
            "exact-argmax",
            "certified exact argmax that skips most vocabulary rows",
        ),
        ("W12", "w12", "lossless 12-bit weights for the LM head matrix"),
    ),
    "argmax": (("exact-argmax head", "exact-argmax", "argmax fused into the LM-head GEMM"),),
    "draft": (
        ("drafter schedule", "adaptive-block", "per-request drafter block length / draft budget"),
        ("CUDA graphs", "cuda-graphs", "static shapes and graph replay for the drafter"),
        ("tree verify", "tree-verify", "more accepted tokens per draft forward"),
    ),
    "verify": (
        ("tree verify", "tree-verify", "verify a tree of candidates: more tokens per cycle"),
        ("two-level verify", "two-level", "cheap first pass, exact check after"),
    ),
    "accept_commit": (
        ("device accept", "device-accept", "accept and commit on the device, no host round trip"),
        ("CUDA graphs", "cuda-graphs", "one replay for the accept step"),
    ),
    "overhead": (
        ("CUDA graphs", "cuda-graphs", "one replay per phase instead of one launch per op"),
        ("static shapes", "static-shapes", "fixed shapes per graph key, no host sync in a cycle"),
        (
            "kernel fusion",
            "kernel-fusion",
            "norm + RoPE + KV write, SiLU·mul, residual in the GEMM",
        ),
    ),
}
"""Component → (label, registry name it will have, what it does) of the mechanisms that attack
it. Once a mechanism of that registry name is registered, it is listed as registered instead."""

ENGINE_PATH = frozenset({"cuda-graphs", "static-shapes", "kernel-fusion", "device-accept"})
"""Built into the one engine (``engine/runner.py``, ``engine/accept.py``, ``models/forward.py``),
not registry entries."""


@dataclass(frozen=True, slots=True)
class MechanismRef:
    name: str
    status: str
    """``registered`` (in the mechanism registry), ``engine`` (the engine's own) or ``planned``."""
    detail: str = ""


def mechanisms_for(component: str) -> tuple[MechanismRef, ...]:
    """Registered mechanisms declaring ``component``, then the planned ones for it."""
    from specpilot.mechanisms import MECHANISMS

    registered = [
        MechanismRef(m.name, "registered", m.summary)
        for m in MECHANISMS.values()
        if m.component == component
    ]
    out = list(registered)
    for label, reg_name, detail in PLANNED.get(component, ()):
        if any(r.name == reg_name for r in out):
            continue
        mech = MECHANISMS.get(reg_name)
        if mech is not None:
            out.append(MechanismRef(reg_name, "registered", mech.summary))
        else:
            status = "engine" if reg_name in ENGINE_PATH else "planned"
            out.append(MechanismRef(label, status, detail))
    return tuple(out)
