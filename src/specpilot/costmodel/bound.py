"""The most speedup the cost model allows a trial, from its measured τ and its timed forward.

A speculative cycle commits τ tokens on average (bonus included) and costs
``t_draft + t_verify + t_other`` with every term non-negative; the baseline commits one token
per ``t_AR``. So

    speedup ≤ τ · t_AR / (t_draft + t_verify + t_other) ≤ τ · t_AR / (t_draft + t_verify)

with ``t_other ≥ 0`` dropped (host bookkeeping, read-back, idle time). ``t_verify`` is the
engine's own target forward (``Engine.time_forward(width)``: the verify step replayed as a cycle
replays it, CUDA graph included), ``t_draft`` what the caller knows of the draft (0 when
unknown, which only loosens the bound). The arithmetic is
:func:`specpilot.bench.protocol.speedup_bound`, the one every speed comparison uses.

Which width: a cycle verifies at least one token, so ``t_verify ≥ min_w t(w)``. The time need not
grow with the width: a mechanism that picks kernels by row count can make the one-token forward
the slow one (issue 26: a fused-GEMV tiling that spilled ran width 1 twelve times slower than
cuBLAS runs width 16, so a width-1 "floor" put the bound at 0.52x under a measured 4.43x). The
default therefore times the two widths an engine runs most, 1 (AR steps, gate windows) and its
widest verify ``k + 1``, and takes the faster.
A tighter choice such as ``t(⌊τ⌋)`` (a cycle that commits c tokens verifies at least c) needs the
time to be non-decreasing and convex in the width, and it is not everywhere: SmolLM2-135M on the
2-core CPU measured t(1) 26 ms (the ``[in, out]`` one-row product), t(2) 53.5, t(3) 66.1, t(5)
51.0, t(9) 60.9 ms (MKL's small-M GEMMs), so an n-gram engine that verifies 1 or 9 tokens beat the
``⌊τ⌋`` "bound" by 20% in every trial of the main job. A drafter that always drafts k tokens
verifies ``k + 1`` every cycle: pass that width for a tighter bound.

The forward is timed at the engine's committed state: mid-run it sees the run's context; on
idle rows (after ``generate``) a context of a few tokens, a cheaper forward and so a looser
bound, never a wrong one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from specpilot.bench.protocol import speedup_bound
from specpilot.engine import Engine

FORMULA = "tau * t_AR / (t_draft + t_verify + t_other), t_other >= 0"


@dataclass(frozen=True, slots=True)
class SpeedupBound:
    """A trial's speedup ceiling and what it was computed from (seconds)."""

    tau: float
    """Mean committed tokens per cycle, bonus included."""
    ar_step_s: float
    """The baseline's seconds per token."""
    verify_s: float
    """One target forward of ``width`` tokens per row, as the engine runs it."""
    draft_s: float
    width: int
    bound: float

    def to_dict(self) -> dict[str, float | int | str]:
        return {**asdict(self), "formula": FORMULA}

    def text(self) -> str:
        return (
            f"bound {self.bound:.2f}x = tau {self.tau:.2f} x AR {self.ar_step_s * 1e3:.3f} ms / "
            f"(draft {self.draft_s * 1e3:.3f} + verify[{self.width}] {self.verify_s * 1e3:.3f} ms)"
        )


def cycle_bound(tau: float, ar_step_s: float, verify_s: float, draft_s: float = 0.0) -> float:
    """``tau · t_AR / (t_draft + t_verify)``: the bound with ``t_other`` at its floor, 0."""
    if tau < 1.0:
        raise ValueError(f"tau counts the bonus token, so it is at least 1; got {tau}")
    if ar_step_s <= 0 or verify_s < 0 or draft_s < 0:
        raise ValueError("times must be positive (t_AR) or non-negative (t_verify, t_draft)")
    return speedup_bound(tau, ar_step_s, draft_s + verify_s)


def engine_speedup_bound(
    engine: Engine,
    tau: float,
    ar_step_s: float,
    width: int | None = None,
    draft_s: float = 0.0,
    iters: int = 20,
) -> SpeedupBound:
    """The cost model's ceiling on ``engine``'s speedup over a baseline of ``ar_step_s`` per
    token, at the measured ``tau`` (module docstring). ``width``: the verify width to time
    (default: the faster of 1 and the widest, module docstring); the engine's rows must be
    open."""
    if engine.cache is None:
        raise ValueError("the engine has no rows open; run it (or call open/prefill) first")
    widest = engine.k_max + 1
    if width is not None and not 1 <= width <= widest:
        raise ValueError(f"width must lie in 1..{widest}, got {width}")
    widths = (width,) if width is not None else tuple(sorted({1, widest}))
    verify_s, w = min((engine.time_forward(x, iters), x) for x in widths)
    return SpeedupBound(
        tau=tau,
        ar_step_s=ar_step_s,
        verify_s=verify_s,
        draft_s=draft_s,
        width=w,
        bound=cycle_bound(tau, ar_step_s, verify_s, draft_s),
    )
