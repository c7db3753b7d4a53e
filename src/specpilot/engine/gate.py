"""The speculation gate: a request stops drafting when its drafts stop paying, and probes again.

Speculation is a bet that a cycle (draft + verify of ``k + 1`` tokens) commits enough tokens to
beat that many AR steps. On prompts the drafter cannot predict it loses: an n-gram drafter on
chat prompts commits about 1.1 tokens per cycle, and a cycle costs more than an AR step. The gate
watches each row's own acceptance and the engine's own step times, and turns drafting off for a
row while

    tau_b * t_AR  <  (1 + margin) * t_cycle

(``tau_b``: the row's committed tokens per speculative cycle, a moving average; ``t_cycle`` and
``t_AR``: the engine's measured seconds per speculative cycle and per AR step, moving averages of
the same clock the engine reports, so the rule is the cost model's break-even
``tau* = t_cycle / t_AR`` evaluated on this deployment as it runs). An off row commits
``off_tokens`` tokens by AR, then probes: it drafts for ``probe_cycles`` cycles with a fresh
average; a probe that still loses doubles the next off period (up to ``max_off_tokens``), one
that pays resets it. When every decoding row is off, the engine runs plain AR steps, which skip
the drafter; in a batch with some rows on, every row still drafts (cutting single rows is the
width policies' job).

Lossless by construction: the gate only chooses between two ways of committing the target's
argmax (an AR step, or a verified cycle), both exact. A drafter whose state follows every
committed position (a draft model's KV cache) is told which rows skipped drafting and catches
up (``resync``); a drafter that cannot (it needs target features of every position, as a block
drafter does) keeps the gate off.

Before the engine has timed an AR step, the first row due for a verdict makes it run two real
AR steps (they commit like any other), so ``t_AR`` is always the engine's own measured step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specpilot.engine.types import RowCommit
    from specpilot.engine.view import EngineView


@dataclass(frozen=True, slots=True)
class GateSettings:
    """The gate's knobs (``EngineConfig.gate``); ``enabled=False`` drafts on every cycle."""

    enabled: bool = True
    margin: float = 0.05
    """Drafting must beat AR by this fraction to stay on (keeps noise from flipping rows on)."""
    warmup_cycles: int = 4
    """Speculative cycles a row runs before its first verdict."""
    probe_cycles: int = 2
    """Cycles a probe drafts before it is judged."""
    off_tokens: int = 16
    """Tokens committed by AR after the first losing verdict."""
    max_off_tokens: int = 512
    """Longest off period (each failed probe doubles it up to this)."""
    alpha: float = 0.3
    """Weight of the latest observation in the moving averages."""

    def __post_init__(self) -> None:
        if self.margin < 0 or not 0 < self.alpha <= 1:
            raise ValueError("gate: margin must be >= 0 and alpha in (0, 1]")
        if min(self.warmup_cycles, self.probe_cycles, self.off_tokens) < 1:
            raise ValueError("gate: warmup_cycles, probe_cycles and off_tokens must be >= 1")
        if self.max_off_tokens < self.off_tokens:
            raise ValueError("gate: max_off_tokens must be at least off_tokens")

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> GateSettings:
        if d is None:
            return cls()
        known = set(cls.__dataclass_fields__)
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"gate: unknown knob(s) {', '.join(sorted(unknown))}")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


@dataclass(slots=True)
class _Row:
    on: bool = True
    cycles: int = 0
    """Speculative cycles since the row (re)started drafting."""
    tau: float = 0.0
    """Moving average of committed tokens per speculative cycle."""
    off_left: int = 0
    """Tokens still to commit by AR before the next probe."""
    next_off: int = 0


@dataclass(slots=True)
class SpecGate:
    """Per-row on/off state and the engine's step-time averages (host only, no device sync)."""

    settings: GateSettings = field(default_factory=GateSettings)
    rows: list[_Row] = field(default_factory=list)
    t_cycle: float = 0.0
    """Seconds per speculative cycle (moving average; 0 = not measured yet)."""
    t_ar: float = 0.0
    """Seconds per AR step (moving average; 0 = not measured yet)."""
    turned_off: int = 0
    """Times a row stopped drafting (for reports)."""
    ar_steps: int = 0
    """AR steps the gate ran instead of speculative cycles."""
    recent_off: int = 0
    """The off period the latest losing verdict chose (new requests that start off take it)."""
    tau_prior: float = 0.0
    """Committed tokens per drafted cycle over every row so far (moving average): what a new
    request is expected to reach, so it need not pay for warm-up cycles to find out."""

    def reset(self, batch: int) -> None:
        self.rows = [self._fresh() for _ in range(batch)]

    def _fresh(self) -> _Row:
        """A new request: it drafts, unless the deployment's recent rows say drafting loses
        (``tau_prior``); then it starts with an off period and probes at its end."""
        s = self.settings
        if self._loses(self.tau_prior):
            return _Row(
                on=False, off_left=s.off_tokens, next_off=min(2 * s.off_tokens, s.max_off_tokens)
            )
        return _Row(next_off=s.off_tokens)

    def _loses(self, tau: float) -> bool:
        """Drafting at ``tau`` tokens per cycle is slower than AR by the margin (both timed)."""
        if tau <= 0.0 or self.t_ar <= 0.0 or self.t_cycle <= 0.0:
            return False
        return tau * self.t_ar < (1.0 + self.settings.margin) * self.t_cycle

    def reset_row(self, row: int) -> None:
        """Row ``row`` takes a new request: no history of its own (``_fresh``)."""
        if row < len(self.rows):
            self.rows[row] = self._fresh()

    def all_off(self, active: Sequence[bool]) -> bool:
        rows = [r for r, a in zip(self.rows, active, strict=True) if a]
        return bool(rows) and not any(r.on for r in rows)

    def _limit(self, r: _Row) -> int:
        s = self.settings
        return s.warmup_cycles if r.next_off == s.off_tokens else s.probe_cycles

    def wants_ar_time(self) -> bool:
        """No AR step timed yet, and a drafting row is due for its verdict."""
        return self.t_ar <= 0.0 and any(r.on and r.cycles >= self._limit(r) for r in self.rows)

    def _avg(self, old: float, new: float) -> float:
        return new if old <= 0.0 else old + self.settings.alpha * (new - old)

    def observe_cycle(self, seconds: float, commits: Sequence[tuple[int, int]]) -> None:
        """A speculative cycle took ``seconds``; ``commits``: (row, tokens committed)."""
        s = self.settings
        self.t_cycle = self._avg(self.t_cycle, seconds)
        for row, n in commits:
            r = self.rows[row]
            if not r.on:
                r.off_left -= n  # an off row in a batch whose others draft: its time counts
                if r.off_left <= 0:
                    self._probe(r)
                continue
            r.tau = n if r.cycles == 0 else r.tau + s.alpha * (n - r.tau)
            r.cycles += 1
            self.tau_prior = self._avg(self.tau_prior, n)
            limit = self._limit(r)
            if r.cycles < limit or self.t_ar <= 0.0:
                continue
            if self._loses(r.tau):
                r.on, r.off_left = False, r.next_off
                self.recent_off = r.next_off
                r.next_off = min(2 * r.next_off, s.max_off_tokens)
                self.turned_off += 1
            elif r.cycles == limit:
                r.next_off = s.off_tokens  # the probe paid: the next loss starts short again
                self.recent_off = s.off_tokens

    def observe_ar(self, seconds_per_step: float, steps: int, rows: Sequence[int]) -> list[int]:
        """AR steps ran; returns the rows that probe again now (their drafter must catch up)."""
        self.t_ar = self._avg(self.t_ar, seconds_per_step)
        self.ar_steps += steps
        back = []
        for row in rows:
            r = self.rows[row]
            if r.on:
                continue
            r.off_left -= steps
            if r.off_left <= 0:
                self._probe(r)
                back.append(row)
        return back

    def _probe(self, r: _Row) -> None:
        r.on, r.cycles, r.tau, r.off_left = True, 0, 0.0, 0

    def off_window(self, active: Sequence[bool]) -> int:
        """AR steps until the first off row probes again."""
        left = [r.off_left for r, a in zip(self.rows, active, strict=True) if a and not r.on]
        return max(1, min(left, default=1))

    def summary(self) -> dict[str, float]:
        return {
            "gate_turned_off": float(self.turned_off),
            "gate_ar_steps": float(self.ar_steps),
            "gate_t_cycle_s": self.t_cycle,
            "gate_t_ar_s": self.t_ar,
        }


def gated_ar_window(
    engine: EngineView,
    gate: SpecGate,
    limit: int | None = None,
    interrupt: Callable[[], bool] | None = None,
) -> list[RowCommit]:
    """AR steps instead of a cycle: every decoding row is off, or the gate has not timed an AR
    step yet (then two real ones, which commit like any other); ``limit`` and ``interrupt``
    bound the window as :func:`~specpilot.engine.cycles.ar_window` says."""
    h = engine.host
    rows = [b for b, a in enumerate(h.active) if a]
    for b in rows:
        engine.unsynced.setdefault(b, h.lens[b])
    want = 2 if gate.wants_ar_time() else gate.off_window(h.active)
    t0 = time.perf_counter()
    out = engine.ar_window(want if limit is None else min(want, limit), interrupt)
    gate.observe_ar((time.perf_counter() - t0) / max(out[0].cycles, 1), out[0].cycles, rows)
    return out


def resync_drafter(engine: EngineView) -> None:
    """Drafting resumes: the drafter catches up on what rows committed by AR meanwhile."""
    if not engine.unsynced or engine.drafter is None:
        return
    which = [b for b in engine.unsynced if engine.host.active[b]]
    since = [engine.unsynced[b] for b in which]
    engine.unsynced = {}
    if which:
        engine.drafter.resync(engine, which, since)  # type: ignore[attr-defined]
