"""Compose an engine from an :class:`EngineConfig`: load, build the drafter, apply mechanisms.

The core never names a mechanism: each enabled one receives this build and changes it through
the plug points it declared (the target's ``argmax_head``, ``verify_fn``, the drafter, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from specpilot.drafters.base import Drafter
from specpilot.drafters.static_base import StaticDrafter
from specpilot.engine.batching import BatchScheduler, BlockPolicy, DraftPrefilter
from specpilot.engine.config import EngineConfig
from specpilot.engine.loop import SpecEngine, VerifyFn
from specpilot.engine.strategy import VerifyStrategy
from specpilot.engine.tree_policy import TreePolicy
from specpilot.engine.verify import greedy_verify
from specpilot.engine.widths import WidthPolicy
from specpilot.errors import SpecPilotError
from specpilot.runtime import LoadedModel, build_drafter, load_model, parse_device, parse_dtype

if TYPE_CHECKING:
    from specpilot.engine.static_engine import StaticEngine


@dataclass(slots=True)
class EngineBuild:
    """An engine under construction; mechanisms edit it before ``engine()`` is called."""

    config: EngineConfig
    target: LoadedModel
    draft_model: LoadedModel | None
    drafter: Drafter | None
    verify_fn: VerifyFn = greedy_verify
    strategy: VerifyStrategy | None = None
    """Verify strategy (plug point ``verify_strategy``); None = the chain with ``verify_fn``."""
    block_policy: BlockPolicy | None = None
    """Per-request block length in batched mode (plug point ``drafter_schedule``); None = k."""
    prefilter: DraftPrefilter | None = None
    """Cuts each row's drafts before the batched verify (plug point ``drafter_schedule``)."""
    width_policy: WidthPolicy | None = None
    """Per-row verify widths of the static batched engine (plug point ``drafter_schedule``)."""
    packed_bucket: int = 0
    """Packed ragged verify of the static engine: rows rounded up to this (0 = padded verify)."""
    tree_policy: TreePolicy | None = None
    """Static tree verify of the static engine: which tree each row verifies (None = chains)."""
    notes: list[str] = field(default_factory=list)
    """What each mechanism did, for reports."""

    def engine(self) -> SpecEngine:
        return SpecEngine(
            self.target.model, self.drafter, verify_fn=self.verify_fn, strategy=self.strategy
        )

    def scheduler(
        self, slots: int, segment_tokens: int = 256, max_context: int | None = None
    ) -> BatchScheduler:
        """The continuous-batching scheduler over the same target, drafter and mechanisms."""
        self.check_scheduler()
        return BatchScheduler(
            self.target.model,
            self.drafter,
            slots=slots,
            segment_tokens=segment_tokens,
            max_context=max_context,
            block_policy=self.block_policy,
            verify_fn=self.verify_fn,
            prefilter=self.prefilter,
        )

    def check_scheduler(self) -> None:
        """Refuse a build the continuous-batching scheduler would run only in part: it verifies
        chains and does not carry out the static engine's plug points, and ignoring an enabled
        mechanism silently would misreport what was measured or served."""
        if self.strategy is not None:
            raise SpecPilotError(
                f"Batched mode verifies chains; the '{self.strategy.name}' verify strategy is "
                "not supported there yet."
            )
        if self.width_policy is not None or self.packed_bucket or self.tree_policy is not None:
            from specpilot.mechanisms import MECHANISMS

            static = [n for n in self.config.mechanisms if not MECHANISMS[n].runs_on("scheduler")]
            names = ", ".join(static) or "a static-engine mechanism"
            raise SpecPilotError(
                f"The continuous-batching scheduler cannot run static-engine mechanisms ({names}); "
                "remove them from the engine config or use the static engine's benches."
            )

    def stock_scheduler(
        self, slots: int, segment_tokens: int = 256, max_context: int | None = None
    ) -> BatchScheduler:
        """Batched plain AR over the same weights: the baseline for batched speedups."""
        return BatchScheduler(
            self.target.model, slots=slots, segment_tokens=segment_tokens, max_context=max_context
        )

    def static_engine(self, drafter: StaticDrafter | None, **options: Any) -> StaticEngine:
        """The static (CUDA-graph) engine over the target with this build's batched mechanisms."""
        from specpilot.engine.static_engine import StaticEngine

        return StaticEngine(
            self.target.model,
            drafter,
            width_policy=self.width_policy,
            packed_bucket=self.packed_bucket,
            tree_policy=self.tree_policy,
            **options,
        )

    def stock_engine(self) -> SpecEngine:
        """Plain AR over the same weights: the baseline for speedups."""
        return SpecEngine(self.target.model)


def build_engine(
    config: EngineConfig, max_context: int = 8192, target: LoadedModel | None = None
) -> EngineBuild:
    """Load (or reuse ``target``), build the drafter, and apply every enabled mechanism in order."""
    from specpilot.mechanisms import MECHANISMS

    dep = config.deployment
    dtype, device = parse_dtype(dep.dtype), parse_device(dep.device)
    if target is None:
        target = load_model(dep.target, dtype, device, max_context)
    draft = load_model(dep.draft_model, dtype, device, max_context) if dep.draft_model else None
    drafter = build_drafter(dep.drafter, target, config.k, draft, config.drafter_knobs)
    build = EngineBuild(config=config, target=target, draft_model=draft, drafter=drafter)
    cfg = target.model.cfg
    drafter_name = dep.drafter if drafter is not None else "none"
    for name, given in config.mechanisms.items():
        mech = MECHANISMS[name]
        if not mech.applies.allows(device.type, dep.dtype, drafter_name, dep.mode, cfg.arch):
            raise SpecPilotError(
                f"Mechanism '{name}' does not apply to this deployment "
                f"({device.type}, {dep.dtype}, drafter {drafter_name}, {dep.mode}, {cfg.arch})."
            )
        knobs: dict[str, Any] = mech.resolve_knobs(given)
        mech.apply(build, knobs)
        build.notes.append(f"{name} {knobs}")
    return build
