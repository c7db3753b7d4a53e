"""Fused decode GEMVs: the layer's small kernels folded into its matrices' GEMVs for few rows.

A decode or verify step at M <= 4 rows runs per decoder layer four GEMVs and, between them, two
RMSNorm kernels and one SiLU·mul kernel; cuBLAS adds split-K reduce kernels for the narrow ``o``
and ``down`` products; every kernel costs its own time plus a launch gap inside the CUDA graph
(docs/GPU_PATH.md: 65 RMSNorm 0.114 ms, 32 SiLU·mul 0.047 ms, 64 reduce kernels 0.120 ms and
0.27 ms of gaps between 464 kernels per 8B AR step). ``install`` gives every decoder layer a
:class:`FusedLinears` (plug point ``kernel_choice``, ``DecoderLayer.fused_steps``), which
``models/forward.py`` asks for rows ``M <= max_m`` on its Triton path:

* ``w_qkv`` and ``w_gate_up``: RMSNorm in the GEMV's prologue (``kernels/fused_gemv.norm_gemv``),
  removing both norm kernels;
* ``w_down``: SiLU·mul in the prologue and the residual add in the epilogue (``silu_gemv``);
* ``w_o``: the residual add in the epilogue (``residual_gemv``): no kernel of ours goes, but the
  cuBLAS split-K reduce does (the GEMV reduces its splits in the kernel).

Knob ``matrices`` picks which of these run fused; ``max_m`` the rows up to which they do (prefill
and wider verifies keep cuBLAS and the separate kernels); ``block_n``, ``block_k``,
``num_warps`` the GEMV's tiling. The cost prediction is ``fused_gemv_cost.py``.

With W12: a matrix that W12 serves (its ``linear_fns`` entry) keeps its W12 weights and is fused
in the W12 GEMV (the same kernel, decoding in registers; the escape gathers go through the same
prologue) where W12's table picks the GEMV (M <= 2 on the H200) and W12's ``max_m`` allows;
elsewhere (W12's tl.dot kernel at larger M) the matrix stays W12's, unfused. So
``w12 layers=gate_up_qkv`` with this mechanism at ``matrices=all`` removes all five kernels at
M = 1 and keeps W12's bytes. Any other ``linear_fns`` kernel keeps its matrix unfused.

Why it is lossless (the near-tie contract, ``forcing/tolerance.py``): the fused kernels perform the
unfused kernels' rounding steps in the same order — RMSNorm: fp32 statistics, ``bf16(x · r)``,
times the weight, ``bf16``; SiLU·mul: ``bf16(silu(g))`` times ``u``, ``bf16``; the residual added
in fp32 before the one rounding of the product, as ``torch.addmm`` does — on the same bf16
weights. What differs is fp32 summation order (the sum of squares of the norm and the product's
K sum), which any two GEMM or reduction kernels already differ by and the tolerance covers; the
token-forcing gate counts every near-tie and fails on a mismatch. The stock forward
(``Transformer.forward``) never uses these kernels.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from specpilot.errors import SpecPilotError
from specpilot.kernels import triton_usable
from specpilot.mechanisms.registry import Applicability, Knob, Mechanism

if TYPE_CHECKING:
    from specpilot.kernels.fused_gemv import Weight
    from specpilot.kernels.w12_gemv import GemvConfig
    from specpilot.mechanisms.parts import EngineParts
    from specpilot.models.layer import DecoderLayer
    from specpilot.models.transformer import Transformer

MATRIX_SETS = {
    "all": ("w_qkv", "w_o", "w_gate_up", "w_down"),
    "norms": ("w_qkv", "w_gate_up"),
    "mlp": ("w_gate_up", "w_down"),
    "down": ("w_down",),
    "o_down": ("w_o", "w_down"),
    "qkv_o": ("w_qkv", "w_o"),
}
"""Knob ``matrices``: which GEMVs run fused (qkv, gate_up: the norm before them; down: SiLU·mul
and the residual; o: the residual). ``o_down``: the residual epilogues and SiLU·mul only, the
norms stay separate kernels. ``qkv_o`` (the default): the two GEMVs that clearly beat cuBLAS plus
their separate kernels at M = 1 on the H200 with the 16 x 1024 tiling (x1.14 and x1.17;
bench/gemv_sweep_gpu.py, 2026-12-02); fused gate_up (x1.01, inside the spread) and down (x0.99) were
even, and every fused GEMV lost at M = 2 and 4."""


def _rows(x: Tensor) -> Tensor:  # [M, N]: unit column stride, as the epilogue reads it
    return x if x.stride(1) == 1 else x.contiguous()


class FusedLinears:
    """One decoder layer's fused GEMVs (``DecoderLayer.fused_steps``, ``models/forward.FusedSteps``).

    A matrix whose ``linear_fns`` entry is a W12 kernel (looked up at each call, so the install
    order does not matter) is fused in the W12 GEMV, for the rows where W12's kernel table
    (``kernels/w12_linear.CHOSEN``) picks the GEMV and within W12's ``max_m``; any other
    ``linear_fns`` entry keeps its matrix unfused."""

    def __init__(
        self, layer: DecoderLayer, names: tuple[str, ...], max_m: int, gemv: GemvConfig, eps: float
    ) -> None:
        from specpilot.kernels.gemm_common import counter_buffer

        self.weights: dict[str, Tensor] = {}  # name -> [N, K] bf16, the layer's own parameter
        self.counters: dict[str, Tensor] = {}  # name -> [tiles] int32 split-K arrival counters
        for name in names:
            w = getattr(layer, name)
            if w.dtype != torch.bfloat16 or not w.is_contiguous() or w.shape[1] % 4:
                raise SpecPilotError(
                    f"fused_gemv needs contiguous bf16 weights with K % 4 == 0 ({name} is "
                    f"{tuple(w.shape)} {w.dtype}); load the target with --dtype bf16."
                )
            self.weights[name] = w
            self.counters[name] = counter_buffer(w.shape[0], w.device)
        self.linear_fns = layer.linear_fns  # the layer's own dict: W12 may be installed later
        self.max_m = max_m
        self.gemv = gemv
        self.eps = eps
        self.calls = 0
        """Fused launches so far (tests check that the forward reached them)."""
        self.w12_calls = 0
        """Of those, launches of the W12 GEMV."""

    def _kernel(self, name: str, rows: int) -> tuple[Weight, Tensor, GemvConfig, bool] | None:
        """(weights, counters, tiling, W12's PTX decoder?) for ``rows`` rows of ``name``, or
        None: unfused."""
        fn = self.linear_fns.get(name)
        if fn is None:
            return self.weights[name], self.counters[name], self.gemv, False
        from specpilot.kernels.w12_linear import choice_for
        from specpilot.mechanisms.w12 import W12Linear

        if not isinstance(fn, W12Linear) or rows > fn.max_m:
            return None
        # PDL by W12's own knob: its GEMV lost with it on the H200 (docs/BENCHMARKS.md)
        gemv = choice_for(rows).gemv_for(*fn.w12.shape, pdl=fn.pdl)
        if gemv is None:
            return None
        return fn.w12, fn.counters, gemv, fn.prmt

    def takes(self, name: str, rows: int) -> bool:
        if name not in self.weights or not 1 <= rows <= self.max_m:
            return False
        return self._kernel(name, rows) is not None

    def _take(self, name: str, rows: int) -> tuple[Weight, Tensor, GemvConfig, bool]:
        k = self._kernel(name, rows)
        assert k is not None, "Forward asks takes() first"
        self.calls += 1
        self.w12_calls += not isinstance(k[0], Tensor)
        return k

    def norm_linear(self, name: str, x: Tensor, norm_weight: Tensor, bias: Tensor | None) -> Tensor:
        from specpilot.kernels.fused_gemv import norm_gemv

        w, c, cfg, ptx = self._take(name, x.shape[0])
        return norm_gemv(x, norm_weight, self.eps, w, c, bias, cfg=cfg, ptx=ptx)

    def linear_residual(self, name: str, x: Tensor, a: Tensor) -> Tensor:
        from specpilot.kernels.fused_gemv import residual_gemv

        w, c, cfg, ptx = self._take(name, a.shape[0])
        return residual_gemv(a, w, c, _rows(x), cfg=cfg, ptx=ptx)

    def silu_linear_residual(self, name: str, x: Tensor, gate_up: Tensor) -> Tensor:
        from specpilot.kernels.fused_gemv import silu_gemv

        w, c, cfg, ptx = self._take(name, x.shape[0])
        return silu_gemv(gate_up, w, c, residual=_rows(x), cfg=cfg, ptx=ptx)


def install(
    model: Transformer,
    matrices: str = "all",
    max_m: int = 1,
    block_n: int = 16,
    block_k: int = 1024,
    num_warps: int = 4,
    pdl: bool = True,
) -> list[FusedLinears]:
    """Give every decoder layer of ``model`` its fused GEMVs; returns them, one per layer."""
    from specpilot.kernels.w12_gemv import MAX_ROWS, GemvConfig
    from specpilot.models.layer import DecoderLayer

    if model.dtype != torch.bfloat16:
        raise SpecPilotError("fused_gemv runs bf16 GEMVs; load the target with --dtype bf16.")
    if not triton_usable(model.device):
        raise SpecPilotError("fused_gemv needs Triton on a CUDA GPU (or TRITON_INTERPRET=1).")
    if matrices not in MATRIX_SETS:
        raise SpecPilotError(f"matrices must be one of {sorted(MATRIX_SETS)}, got {matrices!r}.")
    if not 1 <= max_m <= MAX_ROWS:
        raise SpecPilotError(f"max_m must be 1..{MAX_ROWS} (the GEMV's rows), got {max_m}.")
    try:
        gemv = GemvConfig(block_n=block_n, block_k=block_k, num_warps=num_warps, pdl=pdl)
    except ValueError as e:
        raise SpecPilotError(f"fused_gemv tiling: {e}.") from e
    out = []
    for layer in model.layers:
        assert isinstance(layer, DecoderLayer)
        fused = FusedLinears(layer, MATRIX_SETS[matrices], max_m, gemv, model.cfg.rms_norm_eps)
        layer.fused_steps = fused
        out.append(fused)
    return out


def _apply(build: EngineParts, knobs: Mapping[str, Any]) -> None:
    install(
        build.target.model,
        matrices=knobs["matrices"],
        max_m=knobs["max_m"],
        block_n=knobs["block_n"],
        block_k=knobs["block_k"],
        num_warps=knobs["num_warps"],
        pdl=knobs["pdl"],
    )
    build.notes.append(
        f"fused_gemv: {knobs['matrices']} for M <= {knobs['max_m']} "
        f"(block {knobs['block_n']}x{knobs['block_k']}, {knobs['num_warps']} warps)"
    )


MECHANISM = Mechanism(
    name="fused-gemv",
    component="overhead",
    plug_point="kernel_choice",
    lossless=(
        "The fused GEMVs perform the unfused kernels' rounding steps in the same order (RMSNorm: "
        "fp32 statistics, bf16(x*r), times the weight, bf16; SiLU·mul: bf16(silu(g))*u, bf16; the "
        "residual added before the product's one rounding, as addmm) on the same bf16 weights; "
        "only fp32 summation order differs, which the near-tie tolerance covers. Argument in "
        "mechanisms/fused_gemv.py."
    ),
    apply=_apply,
    knobs=(
        Knob(
            "matrices",
            "qkv_o",  # the two that won at M = 1 on the H200 (docs/BENCHMARKS.md, 2026-12-01)
            choices=tuple(MATRIX_SETS),
            doc="which GEMVs run fused: qkv and gate_up take the norm before them, down the "
            "SiLU·mul and the residual, o the residual",
        ),
        Knob("max_m", 1, choices=(1, 2, 4), doc="rows up to which the fused GEMVs run"),
        # 16 x 1024 with 4 warps: the best tiling over the 8B matrices in bench/gemv_sweep_gpu.py
        Knob("block_n", 16, choices=(16, 32, 64), doc="weight rows per program"),
        Knob("block_k", 1024, choices=(256, 512, 1024), doc="columns per K step"),
        Knob("num_warps", 4, choices=(2, 4, 8), doc="warps per program"),
        Knob(
            "pdl",
            True,  # x1.025 on the 8B AR step with split-kv on the H200 (docs/BENCHMARKS.md)
            choices=(False, True),
            doc="launch the bf16 fused GEMVs with programmatic dependent launch (sm_90+; ignored "
            "elsewhere): the first weights stream while the kernel before them drains "
            "(kernels/pdl.py); W12's matrices follow W12's own pdl knob",
        ),
    ),
    applies=Applicability(devices=("cuda",), dtypes=("bf16", "bfloat16")),
    summary="RMSNorm / SiLU·mul / residual fused into the decode GEMVs (fewer kernels per layer)",
)

__all__ = ["MATRIX_SETS", "MECHANISM", "FusedLinears", "install"]
