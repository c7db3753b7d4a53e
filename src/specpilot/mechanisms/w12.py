"""W12: the target's linear layers read ~12-bit lossless weights, decoded inside the GEMM.

In a memory-bound decode or verify step (M = 1..64 rows) a linear layer's time is the time to
stream its weights; W12 (``w12_format.py``) stores each bf16 weight in 8 + 4 bits plus ≈0.01 bits
of escape metadata, and the Triton kernel (``kernels/w12_gemm.py``) rebuilds the bf16 values in
registers, so ~25% fewer bytes cross HBM (cap 16/12 = 1.33×). Which kernel runs for M rows (the
CUDA-core GEMV or the ``tl.dot`` tiles) and with which tiling is the table in
``kernels/w12_linear.py``.

Plug point ``linear_weights``: ``apply`` encodes each selected matrix of every decoder layer
(``w_qkv``, ``w_o``, ``w_gate_up``, ``w_down``), checks ``decode(encode(w))`` against ``w`` bit for
bit, and installs a callable in ``DecoderLayer.linear_fns`` that ``Forward.linear`` uses in
place of ``F.linear``. Component ``mlp``: the MLP holds ~2/3 of a Llama layer's weight bytes; the
``layers`` knob extends it to the attention projections (``attn_proj``) too. The LM head and the
embeddings are untouched (the LM head has its own plug point). The one forward
(``models/forward.py``) routes these matrices through ``linear_fns``, eagerly and in CUDA graphs. The bf16 parameters stay in place: rows beyond ``max_m`` (prefill) use
``F.linear`` on them.

Why it is lossless (the project's near-tie contract, ``forcing/tolerance.py``):
1. *Bit-identical weights.* W12 stores sign and mantissa verbatim and every exponent either as a
   window code or, for an escape, verbatim; ``apply`` verifies the round trip on the device before
   installing anything, so the values the kernel multiplies are exactly the checkpoint's bf16
   weights (any bit pattern: NaN, ±Inf, denormals, -0.0).
2. *Exact products, fp32 sums.* A bf16×bf16 product is exact in fp32, and each product
   ``x[m,k]·w[n,k]`` enters one fp32 accumulator exactly once (escapes through a separate small
   ``tl.dot`` into the same accumulator, plus an exactly cancelling pair of terms ``±x·p`` for the
   placeholder the dense tile used, |p| ≤ 2^-14·max|w|), rounded to bf16 once at the end, bias added in
   fp32 before that rounding, as cuBLAS does.
3. So the output differs from the stock ``F.linear`` only by the order of fp32 additions, which
   cuBLAS itself changes with the shape and the GPU (bound γ_K·Σ|x·w|, γ_K ≈ K·2^-24, before the
   final bf16 rounding). That is exactly the reduction-order freedom the near-tie tolerance covers
   (bf16 outputs are never forced to be bitwise equal to another kernel's), and the token-forcing
   gate still counts every near-tie and fails on any mismatch.
4. *Agent kernels* (``kernels/offers.py``): a cell of the kernel table where the kernel search
   chose an accepted agent kernel runs it instead of ``w12_mma``. It passed the same contract
   (one-hot decode probes bit for bit, escapes included; random x within the fp32 reduction
   bound) in the sandbox at the slot's shapes, again at this weight's shape and widths on its
   own weights, and once more in the search: checks on cases, not a proof of the source, so
   token forcing gating every trial that runs it is the last word, as for every mechanism.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor

from specpilot.errors import SpecPilotError
from specpilot.kernels import triton_usable
from specpilot.kernels.w12_tilings import DEFAULT_TILINGS, MmaTilings, bucket
from specpilot.mechanisms.registry import Applicability, Knob, Mechanism
from specpilot.mechanisms.w12_format import W12Tensor, decode, encode

if TYPE_CHECKING:
    from specpilot.mechanisms.parts import EngineParts
    from specpilot.models.transformer import Transformer

LAYER_SETS = {
    "all": ("w_qkv", "w_o", "w_gate_up", "w_down"),
    "mlp": ("w_gate_up", "w_down"),
    "attn": ("w_qkv", "w_o"),
    "gate_up_qkv": ("w_qkv", "w_gate_up"),
}
"""``gate_up_qkv``: the two matrices where W12 v3 beat bf16 at M = 1 on the H200 (1.13x, 1.05x;
``o`` 0.98x, ``down`` 0.95x; docs/BENCHMARKS.md, W12 v3)."""


class W12Linear:
    """``fn(x [.., K], bias [N] | None) -> [.., N]``: F.linear over a W12 copy of ``weight``."""

    def __init__(
        self,
        weight: Tensor,
        max_m: int,
        prmt: bool,
        pdl: bool = False,
        kernel: str = "table",
        tilings: MmaTilings | None = None,
        offers: Mapping[int, Callable[..., Tensor]] | None = None,
    ) -> None:
        from specpilot.kernels.gemm_common import counter_buffer

        if weight.dtype != torch.bfloat16 or weight.dim() != 2:
            raise SpecPilotError("W12 applies to 2-D bf16 weights only; load the model in bf16.")
        self.weight = weight  # [N, K] bf16: the stock parameter (kept for M > max_m)
        self.kernel = (
            kernel  # "table": v3 GEMV / tl.dot (kernels/w12_linear); "mma": v4 tensor cores
        )
        self.tilings = tilings
        self.offers = dict(offers or {})
        """M bucket -> an accepted agent kernel the kernel search chose for this weight's shape
        (``kernels/offers.py``; the slot's signature, ``kernels/slots.py``), calls without a bias"""
        layout = "v4" if kernel == "mma" else "v3"
        self.w12: W12Tensor = encode(weight.detach(), layout)
        if not torch.equal(decode(self.w12).view(torch.int16), weight.detach().view(torch.int16)):
            raise SpecPilotError("W12 round trip changed a weight; refusing to install it.")
        self.max_m = max_m
        self.prmt = prmt
        self.pdl = pdl  # the GEMV launched with programmatic dependent launch (kernels/pdl.py)
        self.counters = counter_buffer(weight.shape[0], weight.device)  # [tiles] int32
        # an agent kernel gets its own (one that left them dirty would break w12_mma's split-K)
        self.offer_counters = counter_buffer(weight.shape[0], weight.device) if offers else None

    def __call__(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        from specpilot.kernels.w12_linear import w12_linear

        n, k = self.w12.shape
        x2 = x.reshape(-1, k)  # [M, K]
        if x2.shape[0] == 0 or x2.shape[0] > self.max_m or x.dtype != torch.bfloat16:
            return F.linear(x, self.weight, bias)
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        offer = self.offers.get(bucket(x2.shape[0])) if self.offers and bias is None else None
        if offer is not None and self.kernel == "mma":
            y = offer(x2.contiguous(), self.w12, self.offer_counters)  # [M, N] bf16: as checked
        elif self.kernel == "mma":
            from specpilot.kernels.w12_mma import w12_mma

            cfg = (self.tilings or DEFAULT_TILINGS).config(x2.shape[0], n, k)
            y = w12_mma(x2, self.w12, self.counters, bias, cfg=cfg, ptx=self.prmt)
        else:
            y = w12_linear(x2, self.w12, self.counters, bias, ptx=self.prmt, pdl=self.pdl)
        return y.view(*x.shape[:-1], n)  # [.., N]


def install(
    model: Transformer,
    layers: str = "all",
    max_m: int = 64,
    decoder: str = "prmt",
    pdl: bool = False,
    kernel: str = "table",
    tilings: MmaTilings | None = None,
    offers: Mapping[tuple[int, int, int], Callable[..., Tensor]] | None = None,
) -> dict[str, float]:
    """Install W12 on ``model``'s decoder layers; returns bits/weight and escape counts
    (``kernel="mma"``: layout v4 and the tensor-core kernel, tiled by ``tilings``; ``offers``,
    per ``(N, K, M bucket)``, the agent kernels the kernel search chose instead)."""
    from specpilot.models.layer import DecoderLayer

    if model.dtype != torch.bfloat16:
        raise SpecPilotError("W12 is a bf16 weight format; load the target with --dtype bf16.")
    if not triton_usable(model.device):
        raise SpecPilotError("W12 needs Triton on a CUDA GPU (or TRITON_INTERPRET=1 for tests).")
    names = LAYER_SETS[layers]
    stored_bits = weights = escapes = 0.0
    for layer in model.layers:
        assert isinstance(layer, DecoderLayer)
        for name in names:
            w = getattr(layer, name)
            mine = {m: f for (n, k, m), f in (offers or {}).items() if (n, k) == tuple(w.shape)}
            lin = W12Linear(w, max_m, decoder == "prmt", pdl, kernel, tilings, mine)
            layer.linear_fns[name] = lin
            n, k = lin.w12.shape
            stored_bits += 8.0 * lin.w12.nbytes()
            weights += n * k
            escapes += lin.w12.num_escapes
    return {
        "bits_per_weight": stored_bits / max(weights, 1.0),
        "escape_frac": escapes / max(weights, 1.0),
    }


def _apply(build: EngineParts, knobs: Mapping[str, Any]) -> None:
    offers: dict[tuple[int, int, int], Callable[..., Tensor]] = {}
    if build.kernel_offers is not None and knobs.get("kernel", "table") == "mma":
        offers, notes = build.kernel_offers.load()  # only sources the memory holds as accepted
        build.notes.extend(notes)
    stats = install(
        build.target.model,
        layers=knobs["layers"],
        max_m=knobs["max_m"],
        decoder=knobs["decoder"],
        pdl=knobs["pdl"],
        kernel=knobs.get("kernel", "table"),
        tilings=build.kernel_tilings,
        offers=offers,
    )
    if offers:
        build.notes.append(f"w12: agent kernels in {len(offers)} cell(s) of the kernel table")
    build.notes.append(
        f"w12: {stats['bits_per_weight']:.3f} bits/weight, {100 * stats['escape_frac']:.4f}% escapes"
    )


MECHANISM = Mechanism(
    name="w12",
    component="mlp",
    plug_point="linear_weights",
    lossless=(
        "Weights stored losslessly (sign+mantissa verbatim, exponent as a window code or an escaped "
        "verbatim byte; round trip checked bit for bit at install) and decoded in registers; every "
        "exact bf16×bf16 product enters one fp32 sum, so outputs differ from F.linear only in fp32 "
        "addition order, which the near-tie tolerance covers. Argument in mechanisms/w12.py."
    ),
    apply=_apply,
    knobs=(
        Knob(
            "layers",
            "all",
            choices=tuple(LAYER_SETS),
            doc="which decoder matrices read W12: all, the MLP (gate_up, down), attention (qkv, o) or gate_up + qkv",
        ),
        Knob(
            "max_m",
            1,
            low=1,
            high=64,
            doc="rows per call up to which the W12 kernel runs; more rows (verify, prefill) use "
            "F.linear (default 1: on the H200 W12 v3 wins only at M = 1, 1.20x over cuBLAS on the layer)",
        ),
        Knob(
            "decoder",
            "prmt",
            choices=("prmt", "ops"),
            doc="decode with inline PTX (byte permute + rotate), or with plain Triton integer ops",
        ),
        Knob(
            "kernel",
            "table",
            choices=("table", "mma"),
            doc="table: layout v3, the CUDA-core GEMV or the tl.dot kernel per M "
            "(kernels/w12_linear.py); mma: layout v4 decoded into the tensor cores' operand "
            "registers for every M up to max_m (kernels/w12_mma.py), tiled by the kernel search",
        ),
        Knob(
            "pdl",
            False,
            choices=(False, True),
            doc="launch the W12 GEMV with programmatic dependent launch (sm_90+): its first "
            "weights stream while the kernel before it drains (kernels/pdl.py); off by default: "
            "x0.92 on the 8B AR step on the H200 (docs/BENCHMARKS.md)",
        ),
    ),
    applies=Applicability(devices=("cuda",), dtypes=("bf16", "bfloat16")),
    width_seed=lambda width: {"kernel": "mma", "max_m": min(width, 64)},
    summary="lossless ~12-bit weights (sign+mantissa+4-bit exponent code), decoded in the GEMM",
)

__all__ = ["LAYER_SETS", "MECHANISM", "W12Linear", "install"]
