"""The engine config: a deployment plus the mechanisms enabled on it, as JSON.

``tune`` writes it; ``generate``, ``bench``, ``profile``, ``compare`` and ``serve`` read it with
``--engine tuned.json``. Mechanism names and knobs are validated against the registry on load,
so a config that names an unknown mechanism or an out-of-range knob fails with one sentence.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specpilot.engine.deployment import DeploymentSpec
from specpilot.errors import SpecPilotError

if TYPE_CHECKING:
    from specpilot.engine.gate import GateSettings
    from specpilot.kernels.offers import KernelOffers
    from specpilot.kernels.w12_tilings import MmaTilings

DEFAULT_SEGMENT_TOKENS = 256
"""Prompt tokens a newly admitted request feeds per scheduler step when nothing says otherwise."""


@dataclass(frozen=True, slots=True)
class EngineConfig:
    deployment: DeploymentSpec
    k: int = 8
    """Tokens drafted per cycle (0 = plain AR)."""
    drafter_knobs: dict[str, Any] = field(default_factory=dict)
    """Drafter-specific knobs, e.g. ``{"max_n": 3, "min_n": 1}`` for ngram."""
    mechanisms: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Enabled mechanisms by registry name, each with its knob values (defaults filled in)."""
    segment_tokens: int | None = None
    """Batched mode (continuous-batching scheduler): prompt tokens a newly admitted request feeds
    per step (segment admission). None = the command's default (256); a ``--segment-tokens`` flag
    given on the command line wins over it."""
    gate: dict[str, Any] | None = None
    """The speculation gate's knobs (``engine/gate.GateSettings``): a request stops drafting while
    its drafts do not pay and probes again later. None = the defaults (on); ``{"enabled":
    false}`` drafts on every cycle."""

    kernels: dict[str, Any] | None = None
    """Kernel tilings the tune's kernel search measured on this GPU, by kernel:
    ``{"w12_mma": MmaTilings.to_json()}`` (``tune/kernel_search.py``), and ``"w12_offers"``:
    the cells where an accepted agent kernel won (``kernels/offers.KernelOffers``). None = the
    kernels' cold-start tables."""

    def __post_init__(self) -> None:
        if self.k < 0:
            raise SpecPilotError(f"k must be at least 0, got {self.k}.")
        if self.segment_tokens is not None and self.segment_tokens < 1:
            raise SpecPilotError(f"segment_tokens must be at least 1, got {self.segment_tokens}.")
        try:
            self.gate_settings()
        except (TypeError, ValueError) as e:
            raise SpecPilotError(f"Engine config: {e}.") from None
        from specpilot.mechanisms import MECHANISMS

        for name, knobs in self.mechanisms.items():
            if name not in MECHANISMS:
                raise SpecPilotError(
                    f"Engine config names mechanism '{name}', which is not registered "
                    f"(registered: {', '.join(sorted(MECHANISMS)) or 'none'})."
                )
            try:
                MECHANISMS[name].resolve_knobs(knobs)
            except ValueError as e:
                raise SpecPilotError(f"Engine config: {e}.") from None

    def mma_tilings(self) -> MmaTilings | None:
        """The W12 tensor-core kernel's searched tilings, if the config carries them."""
        from specpilot.kernels.w12_tilings import MmaTilings

        data = (self.kernels or {}).get("w12_mma")
        if data is None:
            return None
        try:
            return MmaTilings.from_json(data)
        except (KeyError, TypeError, ValueError) as e:
            raise SpecPilotError(f"Engine config: bad kernels.w12_mma tilings ({e}).") from None

    def kernel_offers(self) -> KernelOffers | None:
        """The agent kernels the kernel search chose for some W12 cells, if any."""
        from specpilot.kernels.offers import KernelOffers

        data = (self.kernels or {}).get("w12_offers")
        if data is None:
            return None
        try:
            return KernelOffers.from_json(data)
        except (KeyError, TypeError, ValueError) as e:
            raise SpecPilotError(f"Engine config: bad kernels.w12_offers ({e}).") from None

    def gate_settings(self) -> GateSettings:
        from specpilot.engine.gate import GateSettings

        return GateSettings.from_dict(self.gate)

    def to_json(self) -> str:
        d = asdict(self)
        for unset in ("segment_tokens", "gate", "kernels"):  # the JSON (and hash) stay as before
            if d[unset] is None:
                del d[unset]
        if d["deployment"]["simulate_acceptance"] is None:
            del d["deployment"]["simulate_acceptance"]
        return json.dumps(d, indent=2)

    def save(self, path: Path) -> None:
        path.write_text(self.to_json() + "\n")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EngineConfig:
        try:
            dep = DeploymentSpec(**d["deployment"])
            return cls(
                deployment=dep,
                k=int(d.get("k", 8)),
                drafter_knobs=dict(d.get("drafter_knobs", {})),
                mechanisms={str(n): dict(v) for n, v in d.get("mechanisms", {}).items()},
                segment_tokens=(
                    None if d.get("segment_tokens") is None else int(d["segment_tokens"])
                ),
                gate=None if d.get("gate") is None else dict(d["gate"]),
                kernels=None if d.get("kernels") is None else dict(d["kernels"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise SpecPilotError(f"Engine config is malformed ({e}).") from None

    @classmethod
    def load(cls, path: Path) -> EngineConfig:
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise SpecPilotError(f"Cannot read engine config {path} ({e}).") from None
        return cls.from_dict(data)


def resolve_segment_tokens(config: EngineConfig, flag: int | None) -> int:
    """The scheduler's segment size: the command-line flag if given, else the engine config's,
    else ``DEFAULT_SEGMENT_TOKENS``."""
    value = flag if flag is not None else config.segment_tokens
    value = DEFAULT_SEGMENT_TOKENS if value is None else value
    if value < 1:
        raise SpecPilotError(f"--segment-tokens must be at least 1, got {value}.")
    return value
