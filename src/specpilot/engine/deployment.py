"""What a deployment is: the target, the drafter, dtype, device and serving mode.

The lowest layer of the engine config (``engine/config.py``): mechanisms' cost-model screens read
it (``mechanisms/registry.py``), so it imports neither the config nor the registry.
"""

from __future__ import annotations

from dataclasses import dataclass

from specpilot.errors import SpecPilotError

MODES = ("single", "batched")


@dataclass(frozen=True, slots=True)
class DeploymentSpec:
    target: str
    """Known model name, HF directory or .gguf file."""
    drafter: str = "ngram"
    """``none``, ``ngram``, ``draft-model`` or ``block``."""
    draft_model: str | None = None
    dtype: str = "fp32"
    device: str = "auto"
    mode: str = "single"
    """``single`` (one request at a time) or ``batched``."""
    simulate_acceptance: str | None = None
    """An acceptance profile (``tau=6.5,block=16`` or ``rates=0.9,0.8``): the drafter runs for
    real but its proposals follow the profile (``drafters/simulated.py``); every figure says
    "simulated acceptance". None: real acceptance."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise SpecPilotError(
                f"Deployment mode must be one of {', '.join(MODES)}, got '{self.mode}'."
            )
        if self.simulate_acceptance is not None:
            from specpilot.drafters.simulated import AcceptanceProfile

            try:
                AcceptanceProfile.parse(self.simulate_acceptance)
            except ValueError as e:
                raise SpecPilotError(f"--simulate-acceptance: {e}") from None
