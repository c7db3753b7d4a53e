"""The decode layer's four GEMVs as the kernel scripts under ``bench/`` run them
(``fused_gemv_gpu.py``, ``gemv_sweep_gpu.py``): the Llama-3-8B matrices, seeded inputs, one call
of a variant (the engine's cuBLAS path, the Triton GEMV between the same separate kernels, the
fused launch), and the torch reference of the fused prologue."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from specpilot.bench.kernel_bench import LLAMA3_8B
from specpilot.kernels import decode_triton, reference
from specpilot.kernels.fused_gemv import norm_gemv, residual_gemv, silu_gemv
from specpilot.kernels.w12_gemv import GemvConfig, bf16_gemv

MATRICES = {f"w_{name}": shape for name, shape in LLAMA3_8B.items()}
"""Matrix -> (N, K)."""
TINY_MATRICES = {"w_qkv": (128, 64), "w_o": (64, 64), "w_gate_up": (192, 64), "w_down": (64, 96)}
EPS = 1e-5
NORMED = ("w_qkv", "w_gate_up")
"""The matrices after an RMSNorm (the fused launch's norm prologue); ``w_down`` reads SiLU·mul
of a ``[M, 2K]`` input, and both it and ``w_o`` add the residual."""


def make_inputs(name: str, n: int, k: int, m: int, dev: torch.device) -> dict[str, torch.Tensor]:
    """Seeded bf16 inputs of matrix ``name`` at ``m`` rows: ``x`` (``[M, 2K]`` for down), the
    RMSNorm weight ``nw`` (qkv, gate_up) and the residual ``res`` ``[M, N]``."""
    g = torch.Generator(device=dev).manual_seed(11 + m + n)
    out = {"res": torch.randn(m, n, generator=g, device=dev).to(torch.bfloat16)}
    if name in NORMED:
        out["x"] = (3 * torch.randn(m, k, generator=g, device=dev)).to(torch.bfloat16)
        out["nw"] = (1 + 0.2 * torch.randn(k, generator=g, device=dev)).to(torch.bfloat16)
    elif name == "w_down":
        out["x"] = (2 * torch.randn(m, 2 * k, generator=g, device=dev)).to(torch.bfloat16)
    else:
        out["x"] = torch.randn(m, k, generator=g, device=dev).to(torch.bfloat16)
    return out


def call(
    variant: str,
    name: str,
    w: torch.Tensor,
    c: torch.Tensor,
    inp: dict[str, torch.Tensor],
    cfg: GemvConfig | None,
) -> Any:
    """One zero-argument call of ``variant`` (``cublas``, ``gemv`` or ``fused``) on matrix
    ``name`` (what the layer body runs); ``w``: the weight (bf16, or W12 for ``fused``), ``c``:
    its kernel's counter buffer."""
    x, res = inp["x"], inp["res"]
    if variant == "fused":
        assert cfg is not None
        if name in NORMED:
            return lambda: norm_gemv(x, inp["nw"], EPS, w, c, cfg=cfg)
        if name == "w_down":
            return lambda: silu_gemv(x, w, c, residual=res, cfg=cfg)
        return lambda: residual_gemv(x, w, c, res, cfg=cfg)

    def mm(a: torch.Tensor, add: bool) -> torch.Tensor:
        if variant == "cublas":
            return torch.addmm(res, a, w.t()) if add else F.linear(a, w)
        y = bf16_gemv(a, w, c, cfg=cfg)
        return res + y if add else y

    if name in NORMED:
        return lambda: mm(decode_triton.rms_norm(x, inp["nw"], EPS), False)
    if name == "w_down":
        return lambda: mm(decode_triton.silu_mul(x), True)
    return lambda: mm(x, True)


def prologue_ref(name: str, inp: dict[str, torch.Tensor]) -> torch.Tensor:
    """What matrix ``name`` multiplies, by the torch reference: RMSNorm of ``x`` (qkv, gate_up),
    SiLU·mul (down) or ``x`` itself (o)."""
    if name in NORMED:
        return reference.rms_norm_ref(inp["x"], inp["nw"], EPS)
    if name == "w_down":
        return reference.silu_mul_ref(inp["x"])
    return inp["x"]
