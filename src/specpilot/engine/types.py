"""What passes between the engine, the scheduler and their callers."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

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


class PhaseClock:
    """Phase boundaries of one cycle: CUDA events on CUDA (read after the cycle's read-back has
    synchronised), host clocks elsewhere. Four marks: start, drafted, verified, accepted."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._marks: list[object] = []

    def start(self, on: bool) -> None:
        self._marks = []
        if on:
            self.mark()

    def mark(self) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._marks.append(ev)
        else:
            self._marks.append(time.perf_counter())

    def add_to(self, times: CycleTimes) -> None:
        """Add the cycle's draft, verify and accept times (nothing unless all four marks are in)."""
        m = self._marks
        if len(m) != 4:
            return
        if self.cuda:
            d = [m[i].elapsed_time(m[i + 1]) / 1e3 for i in range(3)]  # type: ignore[attr-defined]
        else:
            d = [float(m[i + 1]) - float(m[i]) for i in range(3)]  # type: ignore[arg-type]
        times.draft += d[0]
        times.verify += d[1]
        times.accept += d[2]
