"""What passes between the engine, the scheduler and their callers."""

from __future__ import annotations

from dataclasses import dataclass, field

from specpilot.engine.stats import AcceptanceStats


@dataclass(slots=True)
class GenerationResult:
    prompt_ids: list[int]
    tokens: list[int]  # committed tokens after the prompt, stop token included
    stop_reason: str  # "eos" | "length" | "cancelled"
    stats: AcceptanceStats = field(default_factory=AcceptanceStats)


@dataclass(slots=True)
class RowCommit:
    """What one engine step committed in one decoding row."""

    row: int
    tokens: list[int]  # committed tokens, in order (AR window: one per step)
    drafted: int  # draft positions verified (chain: drafts; tree: depth); 0 for AR
    accepted: int  # accepted drafted tokens (committed = accepted + 1 per cycle)
    cycles: int = 1  # verify forwards that committed them (AR window: len(tokens))


@dataclass(slots=True)
class CycleTimes:
    """Decode-loop time split. Phases come from CUDA events (or host clocks on the CPU) when the
    engine profiles, else 0.

    ``wall`` is host time of the decode steps (prefill and oracle reference runs excluded);
    ``other = wall - draft - verify - accept``: host bookkeeping, the per-cycle device→host copy
    and any idle time between launches.
    """

    draft: float = 0.0
    verify: float = 0.0
    accept: float = 0.0
    wall: float = 0.0
    prefill: float = 0.0
    excluded: float = 0.0
    cycles: int = 0

    @property
    def other(self) -> float:
        return self.wall - self.draft - self.verify - self.accept

    def to_dict(self) -> dict[str, float]:
        return {
            "draft_s": self.draft,
            "verify_s": self.verify,
            "accept_s": self.accept,
            "other_s": self.other,
            "wall_s": self.wall,
            "prefill_s": self.prefill,
            "excluded_reference_s": self.excluded,
            "cycles": float(self.cycles),
        }
