"""Predictions on paper: a GPU from the datasheet table, a shape, a drafter, an assumed τ.

Nothing runs. Two sets of ceilings:

* **ceiling** — datasheet peaks (bandwidth, dense matmul rate in the dtype);
* **predicted** — the same peaks scaled by what we measured on our H200 (copy 4.25 of 4.8 TB/s,
  bf16 matmul ≈790 of 989 TFLOP/s), assuming another GPU reaches the same fractions of its
  datasheet, plus an assumed per-cycle host overhead of a static-shape engine.

Every output says "prediction (on paper)"; acceptance is "assumed" (a constant conditional rate
per position that gives the stated τ, bonus included).
"""

from __future__ import annotations

from dataclasses import dataclass

from specpilot.costmodel.acceptance import AcceptanceCurve
from specpilot.costmodel.accounting import (
    Breakdown,
    accept_work,
    block_drafter_work,
    chain_verify,
    draft_model_work,
    forward_work,
    roofline,
    total,
)
from specpilot.costmodel.hardware import (
    H200_MEASURED_BANDWIDTH_FRACTION,
    H200_MEASURED_MATMUL_FRACTION,
    gpu_spec,
)
from specpilot.costmodel.model import Cycle, Prediction, build_cycle
from specpilot.costmodel.shapes import BLOCK_DRAFTERS, DRAFT_MODELS, target_shape

PAPER_LABEL = "prediction (on paper)"


@dataclass(frozen=True, slots=True)
class PaperAssumptions:
    """What an on-paper prediction assumes beyond the datasheet (all printed with it)."""

    context: int = 1024
    """Committed tokens at a typical decode step."""
    dtype: str = "bf16"
    launch_s: float = 1.5e-6
    """Per kernel inside a CUDA graph."""
    cycle_overhead_s: float = 15e-6
    """Host work and the one device→host copy per speculative cycle (the engine on CUDA graphs)."""
    ar_overhead_s: float = 1e-6
    """Per AR step (the engine on CUDA reads tokens back once per 16 steps)."""
    bandwidth_fraction: float = H200_MEASURED_BANDWIDTH_FRACTION
    matmul_fraction: float = H200_MEASURED_MATMUL_FRACTION


def _draft(
    drafter: str, target: str, k: int | None, context: int, e: float
) -> tuple[Breakdown, int]:
    cfg = target_shape(target)
    if drafter in BLOCK_DRAFTERS:
        spec = BLOCK_DRAFTERS[drafter]
        return block_drafter_work(cfg, spec, context, e), spec.k
    if drafter in DRAFT_MODELS:
        kk = k or 4
        return draft_model_work(DRAFT_MODELS[drafter], kk, context, e), kk
    if drafter == "ngram":
        return {}, k or 8
    raise ValueError(
        f"Unknown drafter '{drafter}'; choose ngram, {', '.join([*BLOCK_DRAFTERS, *DRAFT_MODELS])}."
    )


def predict_on_paper(
    gpu: str,
    shape: str,
    drafter: str = "dflash-b16",
    tau: float = 6.2,
    k: int | None = None,
    assume: PaperAssumptions | None = None,
) -> Prediction:
    """Predicted and ceiling speedup of ``drafter`` at τ on ``shape`` on ``gpu`` (batch 1)."""
    a = assume or PaperAssumptions()
    g = gpu_spec(gpu)
    cfg = target_shape(shape)
    e = 1.0 if a.dtype == "fp8" else 2.0
    peak = g.ceilings(a.dtype, launch_s=a.launch_s)
    est = g.ceilings(a.dtype, a.bandwidth_fraction, a.matmul_fraction, a.launch_s)
    draft, kk = _draft(drafter, shape, k, a.context, e)
    curve = AcceptanceCurve.constant(tau, kk, source="assumed")
    verify = chain_verify(cfg, kk, a.context, e)
    ar_step = forward_work(cfg, 1, a.context, e)
    acc_ar, acc_spec = accept_work(0), accept_work(kk)
    draft_total = total(draft)

    def cyc(fwd: Breakdown, width: int, drafted: bool) -> Cycle:
        acc = acc_spec if drafted else acc_ar
        over = a.cycle_overhead_s if drafted else a.ar_overhead_s
        return build_cycle(
            {width: 1.0},
            {width: roofline(fwd, peak)},
            {width: roofline(fwd, est)},
            draft=(draft_total.roofline_s(peak), draft_total.roofline_s(est))
            if drafted
            else (0.0, 0.0),
            accept_commit=(acc.roofline_s(peak), acc.roofline_s(est)),
            overhead=(0.0, over),
        )

    notes = (
        f"{PAPER_LABEL}: {g.name} datasheet ({g.source}); nothing was run",
        f"ceiling = datasheet peaks; predicted = peaks x {a.bandwidth_fraction:.3f} bandwidth, "
        f"x {a.matmul_fraction:.3f} matmul (fractions measured on our H200)",
        f"assumed: {a.dtype}, context {a.context}, launch {a.launch_s * 1e6:.1f} us/kernel, "
        f"{a.cycle_overhead_s * 1e6:.0f} us host overhead per cycle, batch 1",
        f"acceptance assumed: tau {tau} (bonus included) over {kk} draft positions",
        f"shape {shape}: {cfg.num_params() / 1e9:.2f}B params; drafter {drafter}: "
        f"{draft_total.weight_bytes / e / 1e9:.2f}B weights read per cycle (LM head included)",
    )
    return Prediction(
        label=f"{PAPER_LABEL} · {g.name} · {shape} + {drafter}",
        acceptance=curve,
        ar=cyc(ar_step, 1, False),
        spec=cyc(verify, kk + 1, True),
        notes=notes,
    )
