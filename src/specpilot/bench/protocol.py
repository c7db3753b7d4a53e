"""How every speedup is measured: arms interleaved in repeated rounds, in one process, after a
warm-up round, reported as a median ratio with its spread.

An **arm** is one engine on one workload (a prompt set, or a request stream): a callable that
runs the whole workload once and returns what it produced and how long it took (device
synchronised before both clock reads). A round runs every arm once, in an order that rotates
from round to round, so that a machine whose load drifts shifts every arm alike. Round 0 is a
warm-up (graph capture, Triton autotune, allocator growth, caches), never counted.

A ratio (arm over baseline) is computed **per round** and summarised by its median and its
spread (lowest and highest round). A verdict says *faster* or *slower* only when the whole
spread lies on one side of 1 (more than the noise); otherwise *within noise*. With fewer than
three counted rounds no verdict is given at all.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

MIN_ROUNDS_FOR_VERDICT = 3
NOISY_DRIFT = 1.25
"""A baseline whose fastest round beats its slowest by more than this ran on a busy machine."""


@dataclass(slots=True)
class Sample:
    """One arm's run of its whole workload in one round."""

    tokens: int
    seconds: float
    payload: Any = None
    """What the run produced (results for token forcing, stats), kept from the last round."""

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


Arm = Callable[[], Sample]


@dataclass(slots=True)
class Ratio:
    """A per-round ratio (arm over baseline): median and spread (min, max) over rounds."""

    values: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.values) if self.values else 0.0

    @property
    def lo(self) -> float:
        return min(self.values) if self.values else 0.0

    @property
    def hi(self) -> float:
        return max(self.values) if self.values else 0.0

    @property
    def noise(self) -> float:
        """Half the spread, relative to the median (0 when there is one round)."""
        m = self.median
        return (self.hi - self.lo) / (2 * m) if m > 0 else 0.0

    def verdict(self) -> str:
        """``faster`` / ``slower`` when the whole spread is beyond 1, else ``within noise``
        (``undecided`` with fewer than three counted rounds)."""
        if len(self.values) < MIN_ROUNDS_FOR_VERDICT:
            return "undecided"
        if self.lo > 1.0:
            return "faster"
        if self.hi < 1.0:
            return "slower"
        return "within noise"

    def beats(self, other: Ratio, min_gain: float = 0.0) -> bool:
        """Better than ``other`` by more than both spreads (and by ``min_gain`` of its median)."""
        if len(self.values) < MIN_ROUNDS_FOR_VERDICT:
            return False
        return self.lo > other.hi and self.median >= other.median * (1.0 + min_gain)

    def text(self) -> str:
        """``1.42x (1.38-1.47)``."""
        if len(self.values) <= 1:
            return f"{self.median:.2f}x"
        return f"{self.median:.2f}x ({self.lo:.2f}-{self.hi:.2f})"

    def to_dict(self) -> dict[str, Any]:
        return {
            "median": self.median,
            "lo": self.lo,
            "hi": self.hi,
            "rounds": list(self.values),
            "verdict": self.verdict(),
        }


@dataclass(slots=True)
class Measurement:
    """Every arm's samples over the counted rounds (the warm-up round dropped)."""

    samples: dict[str, list[Sample]] = field(default_factory=dict)

    def tok_s(self, arm: str) -> float:
        """Median tok/s of an arm over the counted rounds."""
        return statistics.median(s.tok_s for s in self.samples[arm])

    def ratio(self, arm: str, baseline: str) -> Ratio:
        pairs = zip(self.samples[arm], self.samples[baseline], strict=True)
        return Ratio([a.tok_s / b.tok_s for a, b in pairs if b.tok_s > 0])

    def last(self, arm: str) -> Sample:
        return self.samples[arm][-1]

    def drift(self, arm: str) -> float:
        """Fastest over slowest round of one arm (1.0: the machine was steady)."""
        rates = [s.tok_s for s in self.samples.get(arm, []) if s.tok_s > 0]
        return max(rates) / min(rates) if len(rates) > 1 else 1.0

    def noise_note(self, baseline: str = "ar") -> str | None:
        """A plain sentence when the baseline's own speed moved by more than ``NOISY_DRIFT``
        across rounds (a busy machine), else None."""
        d = self.drift(baseline)
        if d <= NOISY_DRIFT:
            return None
        rates = [s.tok_s for s in self.samples[baseline]]
        return (
            f"the machine was busy: {baseline} alone ran at {min(rates):.1f}-{max(rates):.1f} "
            f"tok/s across rounds ({d:.2f}x apart); the ratios are taken per round, but a "
            "difference inside their spread is noise, and the absolute tok/s are not this "
            "machine's speed"
        )


def timed(
    device: torch.device,
    fn: Callable[[], tuple[int, Any]],
    excluded: Callable[[], float] | None = None,
) -> Sample:
    """Run ``fn`` (returns tokens produced and a payload) between synchronised clock reads.
    ``excluded``: a running total of seconds the run spent on work that is not the engine's
    (the reference runs of simulated acceptance, ``CycleTimes.excluded``); what it grows by
    during the run is taken out of the sample's time."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)
    sync(device)
    skip0 = excluded() if excluded is not None else 0.0
    t0 = time.perf_counter()
    tokens, payload = fn()
    sync(device)
    wall = time.perf_counter() - t0
    skipped = (excluded() - skip0) if excluded is not None else 0.0
    return Sample(tokens, wall - skipped, payload)


def interleave(
    arms: Mapping[str, Arm],
    rounds: int = 3,
    warmup: int = 1,
    deadline: float | None = None,
    on_round: Callable[[int, dict[str, Sample]], None] | None = None,
) -> Measurement:
    """``warmup`` uncounted rounds, then up to ``rounds`` counted ones; in each, every arm once,
    in an order rotated by one from round to round. ``deadline`` (a ``time.perf_counter``
    value): a counted round starts only if it would end by then, judged by the last round's
    length; at least one is always run."""
    names = list(arms)
    out = Measurement({n: [] for n in names})
    last = 0.0
    for r in range(warmup + rounds):
        counted = r >= warmup
        late = deadline is not None and time.perf_counter() + last > deadline
        if counted and r > warmup and late:
            break
        t0 = time.perf_counter()
        shift = r % len(names)
        order = names[shift:] + names[:shift]
        got = {n: arms[n]() for n in order}
        last = time.perf_counter() - t0
        if counted:
            for n in names:
                out.samples[n].append(got[n])
            if on_round is not None:
                on_round(r - warmup, got)
    return out


def speedup_bound(tau: float, t_baseline_step: float, t_cycle_floor: float) -> float:
    """The most a speculative engine can gain over a baseline that commits one token per
    ``t_baseline_step``: ``tau`` tokens per cycle, no cycle shorter than ``t_cycle_floor``
    (e.g. one target forward of the candidate's verify width plus its draft): the cost
    model's ``tau * t_AR / (t_draft + t_verify + t_other)`` with ``t_other >= 0``."""
    return tau * t_baseline_step / t_cycle_floor if t_cycle_floor > 0 else float("inf")


def per_round(values: Sequence[float]) -> Ratio:
    return Ratio(list(values))
