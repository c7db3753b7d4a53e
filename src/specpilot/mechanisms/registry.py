"""What a lossless mechanism declares, once, so that the tuner can search it and the engine can
compose it without knowing it by name.

A mechanism plugs into one declared point of the engine (``PLUG_POINTS``), attacks one cost-model
component (``COMPONENTS``), applies only where it is known to be lossless and worthwhile
(``Applicability``; an optional cost-model ``screen`` can rule out deployments it applies to but
cannot win on), exposes knobs with ranges (``Knob``), and states in words why it cannot change
a committed token (``lossless``). ``apply`` receives the engine being built and the knob values.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from specpilot.engine.deployment import DeploymentSpec
    from specpilot.mechanisms.parts import EngineParts

COMPONENTS = (
    "embedding",
    "attn_proj",
    "attn_kv",
    "mlp",
    "lm_head",
    "argmax",
    "draft",
    "verify",
    "accept_commit",
    "overhead",
)
"""Cost-model components (see the costmodel package); a mechanism names the one it attacks."""

PLUG_POINTS = (
    "linear_weights",  # the format and kernels of the target's linear layers
    "lm_head_argmax",  # how the argmax over the vocabulary is obtained
    "verify_strategy",  # chain or tree verification
    "drafter_schedule",  # how many tokens to draft, and when
    "drafter_weights",  # the format and kernels of the drafter's own matrices (drafts only)
    "kernel_choice",  # kernels and layouts with identical results per token
    "runtime",  # launch overhead: CUDA graphs, compilation
    "layer_phases",  # work between the layer body's steps that changes no value (L2 prefetch)
)


@dataclass(frozen=True, slots=True)
class Knob:
    """One searchable parameter of a mechanism."""

    name: str
    default: Any
    low: float | None = None
    """Inclusive lower bound for int/float knobs."""
    high: float | None = None
    """Inclusive upper bound for int/float knobs."""
    choices: tuple[Any, ...] = ()
    """Allowed values for categorical knobs (empty for numeric ones)."""
    doc: str = ""
    when: tuple[tuple[str, tuple[Any, ...]], ...] = ()
    """The knob matters only while every named knob has one of the given values (e.g. a knob of
    one code path: ``(("path", ("graph", "auto")),)``); elsewhere it is held at its default, so a
    search does not spend trials on it (``canonical``)."""

    def __post_init__(self) -> None:
        if self.choices and self.default not in self.choices:
            raise ValueError(f"knob {self.name}: default {self.default!r} not in {self.choices}")
        if not self.choices and (self.low is None or self.high is None):
            raise ValueError(f"knob {self.name}: numeric knobs need low and high")

    def validate(self, value: Any) -> Any:
        if self.choices:
            if value not in self.choices:
                raise ValueError(f"knob {self.name} must be one of {self.choices}, got {value!r}")
            return value
        assert self.low is not None and self.high is not None
        if not self.low <= value <= self.high:
            raise ValueError(
                f"knob {self.name} must be in [{self.low}, {self.high}], got {value!r}"
            )
        return type(self.default)(value)


def canonical(knobs: tuple[Knob, ...], params: Mapping[str, Any]) -> dict[str, Any]:
    """``params`` with every knob that does not matter for them (``Knob.when``) at its default:
    two settings that differ only there are one configuration."""
    out = dict(params)
    for knob in knobs:
        if any(out.get(name) not in values for name, values in knob.when):
            out[knob.name] = knob.default
    return out


class ConfigView(Protocol):
    """What a cost-model screen reads of an engine config (``engine/config.EngineConfig``)."""

    @property
    def deployment(self) -> DeploymentSpec: ...

    @property
    def mechanisms(self) -> Mapping[str, Mapping[str, Any]]: ...


@dataclass(frozen=True, slots=True)
class Applicability:
    """Where a mechanism may be enabled (every field: allowed values; empty tuple = any)."""

    devices: tuple[str, ...] = ()
    dtypes: tuple[str, ...] = ()
    drafters: tuple[str, ...] = ()
    modes: tuple[str, ...] = ()
    archs: tuple[str, ...] = ()

    def allows(self, device: str, dtype: str, drafter: str, mode: str, arch: str) -> bool:
        pairs = (
            (self.devices, device),
            (self.dtypes, dtype),
            (self.drafters, drafter),
            (self.modes, mode),
            (self.archs, arch),
        )
        return all(not allowed or value in allowed for allowed, value in pairs)


@dataclass(frozen=True, slots=True)
class Mechanism:
    name: str
    component: str
    plug_point: str
    lossless: str
    """Why enabling it cannot change a committed token (beyond documented near-ties)."""
    apply: Callable[[EngineParts, Mapping[str, Any]], None]
    knobs: tuple[Knob, ...] = ()
    applies: Applicability = field(default_factory=Applicability)
    summary: str = ""
    seeds: Mapping[str, tuple[Mapping[str, Any], ...]] = field(default_factory=dict)
    """Per device type, knob settings (the rest at their defaults) the tuner tries right after
    the defaults: points a measurement on that device found better than the defaults, so that a
    short search reaches them (e.g. the 48-node tree on the H200)."""
    width_seed: Callable[[int], Mapping[str, Any]] | None = None
    """Knob settings for a deployment that verifies ``width`` rows per cycle (``k + 1``), tried
    right after the defaults and the seeds: a kernel mechanism whose default serves width 1
    only (W12's ``max_m`` 1) is then also measured at the width the engine verifies at."""
    joint_k: bool = False
    """The tuner searches the draft length with its knobs (where the deployment drafts): a
    mechanism that changes what a verify costs moves the best ``k`` (e.g. gguf-blocks on the
    CPU, where cheap weights make the verify compute-bound)."""
    screen: Callable[[ConfigView], str | None] | None = None
    """The cost model's verdict on a deployment it applies to: a reason not to try it there (it
    cannot win), or None (try it). None: always try it."""

    def screened_out(self, config: ConfigView) -> str | None:
        return None if self.screen is None else self.screen(config)

    def __post_init__(self) -> None:
        if self.component not in COMPONENTS:
            raise ValueError(f"mechanism {self.name}: unknown component {self.component!r}")
        if self.plug_point not in PLUG_POINTS:
            raise ValueError(f"mechanism {self.name}: unknown plug point {self.plug_point!r}")
        names = {k.name for k in self.knobs}
        for knob in self.knobs:
            for other, values in knob.when:
                if other not in names or other == knob.name:
                    raise ValueError(
                        f"mechanism {self.name}: knob {knob.name} depends on {other!r}"
                    )
                known = next(k for k in self.knobs if k.name == other)
                if known.choices and set(values) - set(known.choices):
                    raise ValueError(f"mechanism {self.name}: {other} has no values {values}")
        for seeds in self.seeds.values():
            for seed in seeds:
                self.resolve_knobs(seed)  # an unknown knob or a value out of range fails here

    def resolve_knobs(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """Defaults filled in, every value validated; unknown knob names are an error."""
        known = {k.name: k for k in self.knobs}
        extra = set(given) - set(known)
        if extra:
            raise ValueError(
                f"mechanism {self.name} has no knob(s) {sorted(extra)}; it has {sorted(known)}"
            )
        return {name: knob.validate(given.get(name, knob.default)) for name, knob in known.items()}
