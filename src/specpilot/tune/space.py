"""Search directions: a knob group or a mechanism family that attacks a cost-model component.

A direction turns a dict of parameter values into a new :class:`EngineConfig` derived from a base
config. Directions are built from the config's own knobs (draft length, n-gram sizes) and from
every registered mechanism that applies to the deployment.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from specpilot.engine.config import DEFAULT_SEGMENT_TOKENS, EngineConfig
from specpilot.mechanisms import MECHANISMS, Knob, Mechanism

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


def _with_segment(base: EngineConfig, p: dict[str, Any]) -> EngineConfig:
    seg = int(p["segment_tokens"])
    return dataclasses.replace(base, segment_tokens=None if seg == DEFAULT_SEGMENT_TOKENS else seg)


def measured_engine(mode: str) -> str:
    """The engine (``mechanisms.ENGINES``) a tune of this mode measures candidates on."""
    return "scheduler" if mode == "batched" else "eager"


def skipped_mechanisms(base: EngineConfig, device: str, arch: str) -> list[str]:
    """Registered mechanisms meant for this deployment's mode, device, dtype and model that the
    engine this tune measures does not carry out (so a trial could not measure them), each with
    the reason; the tune skips them and the report lists them."""
    dep, engine = base.deployment, measured_engine(base.deployment.mode)
    out = []
    for name, mech in sorted(MECHANISMS.items()):
        any_drafter = dataclasses.replace(mech.applies, drafters=())
        if not any_drafter.allows(device, dep.dtype, dep.drafter, dep.mode, arch):
            continue
        if not mech.runs_on(engine):
            out.append(f"{name}: {_skip_reason(mech, engine)}")
    return out


def _skip_reason(mech: Mechanism, engine: str) -> str:
    where = " or ".join(mech.engines)
    needs = f", with the {'/'.join(mech.applies.drafters)} drafter" if mech.applies.drafters else ""
    return (
        f"carried out only by the {where} engine{needs}; the {engine} engine this tune measures "
        "would ignore or refuse it, so it is not searched here"
    )


def early_exit_layers(num_layers: int) -> tuple[int, ...]:
    """Candidate exit depths: about 1/4, 2/5, 8/15 and 2/3 of the target's layers."""
    fracs = (1 / 4, 2 / 5, 8 / 15, 2 / 3)
    return tuple(sorted({min(max(1, round(num_layers * f)), num_layers - 1) for f in fracs}))


def _mechanism_direction(name: str) -> Direction:
    mech = MECHANISMS[name]

    def derive(base: EngineConfig, p: dict[str, Any]) -> EngineConfig:
        return dataclasses.replace(base, mechanisms={**base.mechanisms, name: dict(p)})

    return Direction(
        name=f"mechanism:{name}", attacks=(mech.component,), params=mech.knobs, derive=derive
    )


def directions_for(
    base: EngineConfig, device: str, arch: str, num_layers: int | None = None
) -> list[Direction]:
    """Every direction that applies to the deployment of ``base``. Given the target's
    ``num_layers``, an n-gram deployment without a draft model also gets the early-exit draft
    model (the same-tokenizer drafter that is always on hand) as a direction. In batched mode the
    scheduler's segment size is a direction too, and only mechanisms the scheduler carries out
    are searched (``skipped_mechanisms`` lists the others)."""
    dep = base.deployment
    out: list[Direction] = []
    if dep.drafter != "none":
        out.append(
            Direction(
                "draft-length",
                ("draft", "verify"),
                (Knob("k", base.k or 4, low=1, high=16),),
                _with_k,
            )
        )
    if dep.drafter == "ngram":
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
    if dep.drafter == "ngram" and dep.draft_model is None and num_layers and num_layers >= 2:
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
    drafter, engine = dep.drafter, measured_engine(dep.mode)
    for name, mech in sorted(MECHANISMS.items()):
        if mech.applies.allows(device, dep.dtype, drafter, dep.mode, arch) and mech.runs_on(engine):
            out.append(_mechanism_direction(name))
    return out


def describe(cfg: EngineConfig) -> str:
    """A short label for reports: k, drafter knobs, mechanisms."""
    parts = [f"k={cfg.k}"]
    parts += [f"{k}={v}" for k, v in sorted(cfg.drafter_knobs.items())]
    if cfg.segment_tokens is not None:
        parts.append(f"segment_tokens={cfg.segment_tokens}")
    parts += [
        f"+{n}" + (json.dumps(v, separators=(",", ":")) if v else "")
        for n, v in sorted(cfg.mechanisms.items())
    ]
    return " ".join(parts)
