"""The composition root: an :class:`EngineConfig` becomes the one engine every command runs.

``build_engine`` loads the target (or reuses one), builds the drafter, wraps it for simulated
acceptance when the deployment asks for it, and applies every enabled mechanism in order. The
core never names a mechanism: each receives this build and changes it through the plug points
it declared (the target's ``linear_fns``, ``phase_hooks`` and ``argmax_head``, the drafter, the
verify plan's width and tree policies). ``generate``, ``bench``, ``profile``, ``tune``,
``compare``, ``verify`` and ``serve`` all get their engine, their AR baseline and their
scheduler from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specpilot.drafters import CHECKPOINT_DRAFTERS
from specpilot.drafters.base import Drafter
from specpilot.drafters.simulated import SIM_LABEL, AcceptanceProfile, SimulatedAcceptance
from specpilot.engine.config import EngineConfig
from specpilot.engine.engine import Engine
from specpilot.engine.gate import SpecGate
from specpilot.engine.plans import ChainPlan, PackedPlan, TreePlan
from specpilot.engine.scheduler import Scheduler
from specpilot.engine.view import VerifyPlan
from specpilot.errors import SpecPilotError
from specpilot.mechanisms import MECHANISMS
from specpilot.mechanisms.parts import EngineParts
from specpilot.runtime import LoadedModel, build_drafter, load_model, parse_device, parse_dtype


@dataclass(slots=True, kw_only=True)
class EngineBuild(EngineParts):
    """An engine under construction: the parts mechanisms edit (``mechanisms/parts.py``) and the
    config they come from; ``engine()`` is called once every mechanism has been applied."""

    config: EngineConfig

    @property
    def simulated(self) -> bool:
        """Whether the drafter's acceptance is simulated (every figure must say so)."""
        return self.config.deployment.simulate_acceptance is not None

    @property
    def label(self) -> str:
        """The drafter as reports name it (``simulated acceptance`` included when it is)."""
        if self.drafter is None:
            return "none"
        cfg = self.config
        name = f"{cfg.deployment.drafter}(k={cfg.k})"
        return (
            f"{name}, {SIM_LABEL} {cfg.deployment.simulate_acceptance}" if self.simulated else name
        )

    def plan(self) -> VerifyPlan | None:
        if self.drafter is None:
            return None
        if self.tree_policy is not None or self.tree_shape is not None:
            return TreePlan(self.tree_policy, self.tree_shape, self.packed_bucket or 16)
        if self.packed_bucket:
            return PackedPlan(self.width_policy, self.packed_bucket)
        return ChainPlan(self.width_policy)

    def engine(self, **options: Any) -> Engine:
        """The engine with this build's drafter and mechanisms (``options``: Engine keywords)."""
        settings = self.config.gate_settings()
        gate = SpecGate(settings) if settings.enabled and self.drafter is not None else None
        return Engine(
            self.target.model,
            self.drafter,
            plan=self.plan(),
            graphs=self.graphs,
            gate=options.pop("gate", gate),
            **options,
        )

    def stock_engine(self, **options: Any) -> Engine:
        """Plain AR over the same weights, on the same runner: the baseline for speedups."""
        return Engine(self.target.model, graphs=self.graphs, **options)

    def scheduler(
        self,
        slots: int,
        segment_tokens: int | None = 256,
        max_context: int | None = None,
        stock: bool = False,
        window: int | None = None,
        lookahead: bool = False,
    ) -> Scheduler:
        """Continuous batching over this build's engine (``stock``: over batched plain AR;
        ``window``: AR steps per read-back at most; ``lookahead``: the next window's first step
        queued behind the read-back; :class:`Scheduler`)."""
        engine = self.stock_engine() if stock else self.engine()
        return Scheduler(
            engine,
            slots=slots,
            segment_tokens=segment_tokens,
            max_context=max_context,
            window=window,
            lookahead=lookahead,
        )


def simulate(drafter: Drafter | None, profile_text: str, seed: int = 0) -> SimulatedAcceptance:
    """``drafter`` under simulated acceptance (``tau=6.5,block=16`` or ``rates=...``)."""
    if drafter is None:
        raise SpecPilotError("Simulated acceptance needs a drafter; choose one with --drafter.")
    try:
        profile = AcceptanceProfile.parse(profile_text)
        if profile.k != drafter.k:
            raise ValueError(
                f"the profile has {profile.k} draft positions but the drafter drafts {drafter.k} "
                f"tokens; give -k {profile.k} or block={drafter.k + 1}"
            )
        return SimulatedAcceptance(drafter, profile, seed=seed)
    except ValueError as e:
        raise SpecPilotError(f"--simulate-acceptance: {e}.") from None


def build_engine(
    config: EngineConfig,
    max_context: int = 8192,
    target: LoadedModel | None = None,
    graphs: bool | None = None,
) -> EngineBuild:
    """Load (or reuse ``target``), build the drafter, and apply every enabled mechanism in order."""
    dep = config.deployment
    dtype, device = parse_dtype(dep.dtype), parse_device(dep.device)
    if graphs and device.type != "cuda":
        raise SpecPilotError("CUDA graphs need --device cuda; drop --graphs on the CPU.")
    if target is None:
        target = load_model(dep.target, dtype, device, max_context)
    own = dep.drafter in CHECKPOINT_DRAFTERS  # a DFlash directory is no model to load as one
    draft = (
        load_model(dep.draft_model, dtype, device, max_context)
        if dep.draft_model and not own
        else None
    )
    drafter = build_drafter(
        dep.drafter, target, config.k, draft, config.drafter_knobs, draft_path=dep.draft_model
    )
    if dep.simulate_acceptance is not None:
        drafter = simulate(drafter, dep.simulate_acceptance)
    build = EngineBuild(
        config=config, target=target, draft_model=draft, drafter=drafter, graphs=graphs,
        kernel_tilings=config.mma_tilings(), kernel_offers=config.kernel_offers(),
    )  # fmt: skip
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
