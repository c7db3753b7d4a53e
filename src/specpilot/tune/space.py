"""Search directions: a knob group or a mechanism family that attacks a cost-model component.

A direction turns a dict of parameter values into a new :class:`EngineConfig` derived from a base
config. Directions are built from the config's own knobs (draft length, n-gram sizes) and from
every registered mechanism that applies to the deployment.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specpilot.engine.config import DEFAULT_SEGMENT_TOKENS, EngineConfig
from specpilot.mechanisms import MECHANISMS, Knob

SEGMENT_CHOICES = (16, 32, 64, 128, 256, 512)
"""Segment sizes tried in batched mode (prompt tokens a newly admitted request feeds per step)."""


@dataclass(frozen=True, slots=True)
class Direction:
    name: str
    attacks: tuple[str, ...]
    """Cost-model components this direction can shrink."""
    params: tuple[Knob, ...]
    derive: Callable[[EngineConfig, dict[str, Any]], EngineConfig]
    """base config + parameter values -> candidate config."""
    probe: bool = False
    """A switch to another drafter: its first round tries its defaults alone (one trial), and it
    gets a full round of proposals only later, since a drafter that cannot pay on this machine
    loses by a wide margin and its trials are the slowest of the search."""
    seeds: tuple[dict[str, Any], ...] = ()
    """Full parameter sets proposed right after the defaults (a mechanism's measured points for
    this device, ``Mechanism.seeds``)."""


def config_hash(cfg: EngineConfig) -> str:
    return hashlib.sha256(cfg.to_json().encode()).hexdigest()[:16]


def _with_k(base: EngineConfig, p: dict[str, Any]) -> EngineConfig:
    return dataclasses.replace(base, k=int(p["k"]))


def _with_ngram(base: EngineConfig, p: dict[str, Any]) -> EngineConfig:
    if base.deployment.drafter != "ngram":  # n-gram sizes mean nothing to another drafter
        return base
    lo, hi = sorted((int(p["min_n"]), int(p["max_n"])))
    return dataclasses.replace(base, drafter_knobs={**base.drafter_knobs, "min_n": lo, "max_n": hi})


def _with_early_exit(base: EngineConfig, p: dict[str, Any]) -> EngineConfig:
    """Switch to the early-exit draft model (the target's first ``exit_layers`` layers)."""
    dep = dataclasses.replace(base.deployment, drafter="draft-model", draft_model=None)
    return dataclasses.replace(
        base, deployment=dep, k=int(p["k"]), drafter_knobs={"exit_layers": int(p["exit_layers"])}
    )


def _with_learned(base: EngineConfig, p: dict[str, Any]) -> EngineConfig:
    """Switch to the learned drafter that ships for the target (``drafters/shipped.py``)."""
    from specpilot.drafters.shipped import SHIPPED, shipped_drafter

    kind = SHIPPED[base.deployment.target][0]
    path = shipped_drafter(base.deployment.target, kind)
    dep = dataclasses.replace(base.deployment, drafter=kind, draft_model=str(path))
    return dataclasses.replace(base, deployment=dep, k=int(p["k"]), drafter_knobs={})


def _with_segment(base: EngineConfig, p: dict[str, Any]) -> EngineConfig:
    seg = int(p["segment_tokens"])
    return dataclasses.replace(base, segment_tokens=None if seg == DEFAULT_SEGMENT_TOKENS else seg)


def _with_gate(base: EngineConfig, p: dict[str, Any]) -> EngineConfig:
    """The speculation gate's knobs (``engine/gate.py``); ``enabled`` off drafts every cycle."""
    if not p["enabled"]:
        return dataclasses.replace(base, gate={"enabled": False})
    gate = {"margin": float(p["margin"]), "off_tokens": int(p["off_tokens"])}
    return dataclasses.replace(base, gate=gate)


GATED_DRAFTERS = ("ngram", "draft-model")
"""Drafters the gate can pause (they catch up when drafting resumes)."""


def skipped_mechanisms(base: EngineConfig, device: str, arch: str) -> list[str]:
    """Every registered mechanism this tune does not search, each with the reason (it does not
    apply to this deployment's device, dtype, drafter, mode or architecture, or its cost-model
    screen says it cannot win here)."""
    dep = base.deployment
    drafter = dep.drafter if dep.drafter else "none"
    out = []
    for name, mech in sorted(MECHANISMS.items()):
        a = mech.applies
        if a.allows(device, dep.dtype, drafter, dep.mode, arch):
            why_not = mech.screened_out(base)
            if why_not is not None:
                out.append(f"{name}: {why_not}")
            continue
        why = [
            f"{what} {value} (it applies to {', '.join(allowed)})"
            for what, value, allowed in (
                ("device", device, a.devices),
                ("dtype", dep.dtype, a.dtypes),
                ("drafter", drafter, a.drafters),
                ("mode", dep.mode, a.modes),
                ("architecture", arch, a.archs),
            )
            if allowed and value not in allowed
        ]
        out.append(f"{name}: not for {'; '.join(why)}")
    return out


def early_exit_layers(num_layers: int) -> tuple[int, ...]:
    """Candidate exit depths: about 1/4, 2/5, 8/15 and 2/3 of the target's layers."""
    fracs = (1 / 4, 2 / 5, 8 / 15, 2 / 3)
    return tuple(sorted({min(max(1, round(num_layers * f)), num_layers - 1) for f in fracs}))


def tree_width(knobs: Mapping[str, Any] | None) -> int:
    """Rows a ``tree-verify`` with these knobs verifies: ``1 + max_nodes`` (0 without a tree)."""
    return 1 + int(knobs["max_nodes"]) if knobs and "max_nodes" in knobs else 0


def verify_width(cfg: EngineConfig) -> int:
    """Rows a verify of ``cfg`` runs at most: ``k + 1``, or a static tree's ``1 + max_nodes``."""
    return max(cfg.k + 1, tree_width(cfg.mechanisms.get("tree-verify")))


def _mechanism_direction(name: str, device: str, base: EngineConfig) -> Direction:
    """A mechanism's knobs; with ``Mechanism.joint_k`` and a drafting deployment the draft
    length too, for the base's drafter (another drafter a later best switched to, e.g. a DFlash
    block whose length is fixed, keeps its ``k``)."""
    mech = MECHANISMS[name]
    seeds = tuple(mech.resolve_knobs(s) for s in mech.seeds.get(device, ()))
    # a simulated profile fixes the draft length (its block): no joint k there
    fixed_k = base.deployment.simulate_acceptance is not None
    joint = mech.joint_k and base.deployment.drafter != "none" and base.k > 0 and not fixed_k
    width_seed = None
    knobs = mech.knobs
    if mech.width_seed is not None and base.deployment.drafter != "none" and base.k > 0:
        # a drafting deployment verifies k + 1 rows a cycle: the width seed is its first trial,
        # the registry's defaults (a kernel for width 1: the gate's AR steps) come after it
        width_seed = mech.resolve_knobs(mech.width_seed(verify_width(base)))
        seeds = (mech.resolve_knobs({}), *seeds)
        knobs = tuple(dataclasses.replace(kn, default=width_seed[kn.name]) for kn in knobs)
    params = knobs + ((Knob("k", min(base.k, 16), low=1, high=16),) if joint else ())

    def derive(cfg: EngineConfig, p: dict[str, Any]) -> EngineConfig:
        knobs = {n: v for n, v in p.items() if n != "k"}
        if width_seed is not None and knobs == width_seed and mech.width_seed is not None:
            # the width seed on a config that verifies wider (a tree won): its width, not base's
            knobs = mech.resolve_knobs(mech.width_seed(verify_width(cfg)))
        same = cfg.deployment.drafter == base.deployment.drafter
        k = int(p["k"]) if joint and same and "k" in p else cfg.k
        return dataclasses.replace(cfg, k=k, mechanisms={**cfg.mechanisms, name: knobs})

    return Direction(
        name=f"mechanism:{name}",
        attacks=(mech.component,) + (("verify",) if joint else ()),
        params=params,
        derive=derive,
        seeds=seeds,
    )


def directions_for(
    base: EngineConfig, device: str, arch: str, num_layers: int | None = None
) -> list[Direction]:
    """Every direction that applies to the deployment of ``base``. Given the target's
    ``num_layers``, an n-gram deployment without a draft model also gets the early-exit draft
    model (the same-tokenizer drafter that is always on hand) as a direction. In batched mode the
    scheduler's segment size is a direction too. Every mechanism that applies to the deployment
    is searched unless its cost-model screen rules it out (``skipped_mechanisms`` lists the
    others and why). Under simulated acceptance
    the profile fixes the draft length and the drafter's acceptance, so only mechanisms and the
    segment size are searched."""
    dep = base.deployment
    out: list[Direction] = []
    simulated = dep.simulate_acceptance is not None
    if dep.drafter != "none" and not simulated:
        high = 16
        if dep.drafter in ("dflash", "dflash2") and dep.draft_model:  # a DFlash block's length
            from specpilot.loading.dflash import block_size_of

            high = min(high, block_size_of(Path(dep.draft_model)) - 1)
        out.append(
            Direction(
                "draft-length",
                ("draft", "verify"),
                (Knob("k", min(base.k or 4, high), low=1, high=high),),
                _with_k,
            )
        )
    early = dep.drafter == "ngram" and dep.draft_model is None and not simulated
    if early:  # before the n-gram sizes and the early-exit draft model: a learned drafter
        # drafts far better where it can pay (a GPU), so the first round measures it
        from specpilot.drafters.shipped import shipped_kind

        kind = shipped_kind(dep.target)
        if kind is not None:  # the learned drafter that ships for this target
            out.append(
                Direction(
                    "learned-drafter",
                    ("draft",),
                    (Knob("k", 3, low=1, high=15),),
                    _with_learned,
                    probe=True,
                )
            )
    if dep.drafter == "ngram" and not simulated:
        kn = base.drafter_knobs
        out.append(
            Direction(
                "ngram-sizes",
                ("draft",),
                (
                    Knob("max_n", int(kn.get("max_n", 3)), low=1, high=6),
                    Knob("min_n", int(kn.get("min_n", 1)), low=1, high=3),
                ),
                _with_ngram,
            )
        )
    if early and num_layers and num_layers >= 2:
        layers = early_exit_layers(num_layers)
        out.append(
            Direction(
                "early-exit-drafter",
                ("draft",),
                (
                    Knob("exit_layers", layers[len(layers) // 2], choices=layers),
                    Knob("k", 4, low=1, high=8),
                ),
                _with_early_exit,
                probe=True,
            )
        )
    if dep.drafter in GATED_DRAFTERS and not simulated:
        g = base.gate_settings()
        out.append(
            Direction(
                "spec-gate",
                ("draft", "verify"),
                (
                    Knob("enabled", g.enabled, choices=(True, False)),
                    Knob("margin", g.margin, low=0.0, high=0.3),
                    Knob("off_tokens", g.off_tokens, choices=tuple(sorted({8, 16, 32, 64}))),
                ),
                _with_gate,
            )
        )
    if dep.mode == "batched" and dep.drafter != "none":
        seg = base.segment_tokens or DEFAULT_SEGMENT_TOKENS
        out.append(
            Direction(
                "segment-tokens",
                ("verify", "overhead"),
                (Knob("segment_tokens", seg, choices=tuple(sorted({*SEGMENT_CHOICES, seg}))),),
                _with_segment,
            )
        )
    for name, mech in sorted(MECHANISMS.items()):
        allowed = mech.applies.allows(device, dep.dtype, dep.drafter, dep.mode, arch)
        if allowed and mech.screened_out(base) is None:
            out.append(_mechanism_direction(name, device, base))
    return out


def describe(cfg: EngineConfig) -> str:
    """A short label for reports: k, drafter knobs, mechanisms."""
    parts = [f"k={cfg.k}"]
    parts += [f"{k}={v}" for k, v in sorted(cfg.drafter_knobs.items())]
    if cfg.segment_tokens is not None:
        parts.append(f"segment_tokens={cfg.segment_tokens}")
    if cfg.gate is not None:
        g = cfg.gate_settings()
        parts.append(
            "gate=off" if not g.enabled else f"gate(margin={g.margin:g},off={g.off_tokens})"
        )
    parts += [
        f"+{n}" + (json.dumps(v, separators=(",", ":")) if v else "")
        for n, v in sorted(cfg.mechanisms.items())
    ]
    return " ".join(parts)


def with_deployment(cfg: EngineConfig, base: EngineConfig) -> EngineConfig:
    """A config validated elsewhere, moved onto this deployment (knobs and mechanisms kept; an
    early-exit draft model, which needs no separate model, is kept too)."""
    dep = base.deployment
    if cfg.deployment.drafter == "draft-model" and "exit_layers" in cfg.drafter_knobs:
        dep = dataclasses.replace(dep, drafter="draft-model", draft_model=None)
    elif cfg.deployment.drafter != dep.drafter:
        raise ValueError("the remembered config uses another drafter")
    return dataclasses.replace(cfg, deployment=dep)


STATIC_GAP_ORDER = (
    "draft",
    "verify",
    "lm_head",
    "mlp",
    "attn_proj",
    "attn_kv",
    "overhead",
    "accept_commit",
)
"""Component order used when no measured profile ranks the gaps."""


def rank_directions(directions: Sequence[Direction], gap_order: Sequence[str]) -> list[Direction]:
    """Directions sorted by the rank of the best-ranked component they attack."""
    rank = {c: i for i, c in enumerate(gap_order)}
    return sorted(
        directions,
        key=lambda d: min((rank.get(c, len(rank)) for c in d.attacks), default=len(rank)),
    )
