"""The near-tie tolerance: how far two *correct* evaluations of the target can disagree.

Two correct forwards of the same network that reduce in another order (a GEMV for one token
against a GEMM for a block, a fused kernel, CUDA graphs, another batch size) give logits that
differ by rounding error. A committed token t that is not the stock argmax a is a **near-tie**
when the gap ``l_a − l_t`` is within what rounding alone can explain, and a **mismatch**
otherwise. The bound, to first order in the unit roundoff u of the dtype:

* The final hidden state h (the LM head's input, after the final norm) is the end of a residual
  stream that is rounded once per layer; two evaluation orders differ there by about
  ``u · sqrt(L + 1) · ‖h‖`` (independent roundings add as a random walk over L layers + the
  embedding).
* A change δh moves the gap ``l_a − l_t = h · (w_a − w_t)`` by at most ``‖δh‖ · ‖w_a − w_t‖``
  (Cauchy–Schwarz), w the LM-head rows.
* Rounding the two logits themselves adds ``u · (|l_a| + |l_t|)``.

So ``tol = SAFETY · u · (sqrt(L + 1) · ‖h‖ · ‖w_a − w_t‖ + |l_a| + |l_t|)`` with SAFETY = 2.

Why this scale and not ``|l_max|`` alone: a logit is a sum of terms much larger than itself
whenever h and w are far from aligned (random weights: nearly orthogonal), and the rounding
error follows the terms, not the sum. An earlier tolerance of 16 ulps of |l_max| flagged
genuine bf16 near-ties on random-weight 8B shapes (gaps 0.19–0.31, docs/GPU_PATH.md).

Scale: SmolLM2 in fp32 (u = 2⁻²⁴) gives tolerances around 1e-5 to 1e-4, and the fp32 tests see
zero near-ties; bf16 (u = 2⁻⁹) on a 32-layer random-weight 8B shape gives about 1.
"""

from __future__ import annotations

import math

import torch

SAFETY = 2.0

_UNIT_ROUNDOFF = {
    torch.float32: 2.0**-24,
    torch.bfloat16: 2.0**-9,
    torch.float16: 2.0**-11,
    torch.float64: 2.0**-53,
}


def unit_roundoff(dtype: torch.dtype) -> float:
    try:
        return _UNIT_ROUNDOFF[dtype]
    except KeyError:
        raise ValueError(f"no near-tie tolerance defined for dtype {dtype}") from None


def near_tie_tolerance(
    dtype: torch.dtype,
    num_layers: int,
    hidden_norm: float,
    row_gap_norm: float,
    logit_a: float,
    logit_t: float,
) -> float:
    """Largest gap ``l_a − l_t`` that rounding can explain (see the module docstring)."""
    u = unit_roundoff(dtype)
    return (
        SAFETY
        * u
        * (math.sqrt(num_layers + 1) * hidden_norm * row_gap_norm + abs(logit_a) + abs(logit_t))
    )
