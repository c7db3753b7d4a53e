"""The near-tie tolerance, derived from the dtype and the logit magnitude.

Two correct forwards of the same network that reduce in a different order (a GEMV for one token
against a GEMM for a block, another kernel, another batch size) produce logits that differ by
rounding error. For a logit of magnitude |l| computed in a format with unit roundoff u, the last
roundings alone move it by about u·|l|, and the differences accumulated through the layers are a
small multiple of that on well-conditioned networks. We allow

    tol = NEAR_TIE_ULPS · u(dtype) · max(1, |l_max|),       NEAR_TIE_ULPS = 16,

where l_max is the target's top logit at that position. So a committed token t that is not the
argmax a is a **near-tie** when l_a − l_t ≤ tol, and a **mismatch** otherwise. For scale, at
|l_max| = 20: fp32 (u = 2⁻²⁴) tol ≈ 1.9e-5; bf16 (u = 2⁻⁹) tol ≈ 0.63; fp16 (u = 2⁻¹¹) tol ≈ 0.16.
In fp32 on our test models this admits nothing in practice: every token matches exactly, and
tests assert zero near-ties there.
"""

from __future__ import annotations

import torch

NEAR_TIE_ULPS = 16

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


def near_tie_tolerance(dtype: torch.dtype, top_logit: float) -> float:
    """Largest logit gap (argmax − committed) still classed as a near-tie."""
    return NEAR_TIE_ULPS * unit_roundoff(dtype) * max(1.0, abs(top_logit))
