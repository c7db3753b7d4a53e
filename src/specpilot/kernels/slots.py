"""Kernel slots: a place in the engine where a kernel with a reference may be swapped for another.

A slot is what the kernel sub-agent (``tune/kernel_agent.py``) may write a Triton kernel for and
what a kernel search may choose among: it names the entry signature every candidate must have,
the shapes the engine runs it at, the engine's current kernel (the one a candidate is timed
against), and a deterministic set of check cases per shape. A case holds the inputs (built on
the CPU from a seed, or from real weights) and a check of an output against the reference,
computed by the checker itself: never by code the candidate could have touched
(``tune/kernel_sandbox.py`` runs the candidate in a separate process and checks its saved
outputs in the parent). The interface is deliberately narrow: one entry function, positional
tensor arguments, one output tensor.

Registered slots:

* ``w12-gemm``: ``y = x @ decode(w)^T`` for a W12 weight in layout v4 at a verify width ``M``:
  the product the engine's W12 linear runs at the verify widths (``mechanisms/w12.py`` with
  ``kernel="mma"``), whose current kernel is ``kernels/w12_mma.w12_mma`` at its cold-start
  tiling; same entry signature, so an accepted kernel is a drop-in replacement for a cell of the
  kernel search's table (``tune/kernel_search.py``). Checks: (a) the decode, bit for bit: one-hot rows of
  ``x`` read weight columns back exactly (one exact product per output, zeros elsewhere), over
  every column on small shapes and a seeded sample covering every escape's column on large ones;
  (b) the product on random ``x`` within the documented fp32 reduction bound (``w12_gemm``: half
  a bf16 ulp + ``K·2^-23·Σ|x||w|``), since a kernel with another tiling sums in another order.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

Shape = Mapping[str, int]
"""A slot's shape by dimension name, e.g. ``{"m": 16, "n": 4096, "k": 4096}``."""


@dataclass(frozen=True, slots=True)
class Case:
    label: str
    args: tuple[Any, ...]
    """The entry's positional arguments, on the CPU (the sandbox moves them to the device)."""
    check: Callable[[Tensor], str | None]
    """An output (on the CPU) against the reference: None if it passes, else why not."""


@dataclass(frozen=True, slots=True)
class KernelSlot:
    name: str
    summary: str
    """What the kernel computes and what exactness it promises (the agent's brief says it)."""
    signature: str
    """The entry's signature with shapes and dtypes."""
    shapes: tuple[Shape, ...]
    """Shapes the engine runs it at by default (a kernel search passes the deployment's)."""
    cases: Callable[[Shape, int, Tensor | None], list[Case]]
    """(shape, seed, real weight or None) -> check cases; deterministic in the seed."""
    current: str
    """``module:function`` of the engine's kernel now, with the entry's signature."""
    needs_cuda: bool
    mechanism: str
    """The mechanism whose kernel choice a winner would join (the kernel search's key)."""


def load(path: str) -> Any:
    """``module:attribute``, imported."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def to_device(arg: Any, device: torch.device) -> Any:
    return arg.to(device) if hasattr(arg, "to") else arg


# --------------------------------------------------------------------------------- w12-gemm
ULP_BF16 = 2.0**-8
EPS_FP32 = 2.0**-23
PROBES_MAX = 64
"""One-hot probes per shape on large shapes (every column on shapes with fewer)."""


def _weight_like(n: int, k: int, g: torch.Generator) -> Tensor:  # [N, K] bf16
    """Weight-like values with escapes of every kind (zero, denormal, tiny, large)."""
    w = 0.02 * torch.randn(n, k, generator=g)
    idx = torch.randperm(n * k, generator=g)[: max(3, n * k // 50)]
    vals = torch.tensor([1e-30, 0.0, 3.0, -1e-41, 2e-8, -250.0])
    w.view(-1)[idx] = vals[torch.arange(len(idx)) % len(vals)]
    return w.to(torch.bfloat16)


def _fit(real: Tensor, n: int, k: int) -> Tensor:  # any [R, C] -> [N, K] bf16 (tiled, cropped)
    r = real.detach().to(torch.float32).reshape(real.shape[0], -1)
    r = r.repeat(-(-n // r.shape[0]), -(-k // r.shape[1]))
    return r[:n, :k].contiguous().to(torch.bfloat16)


def _bits(t: Tensor) -> Tensor:
    return t.contiguous().view(torch.int16)


def w12_gemm_cases(shape: Shape, seed: int, real: Tensor | None) -> list[Case]:
    """Seeded weight-like weights with every kind of escape, and ``real`` (tiled or cropped to
    the shape) when given: for each, the decode probes and the product."""
    m, n, k = int(shape["m"]), int(shape["n"]), int(shape["k"])
    g = torch.Generator().manual_seed(seed)
    out = _w12_cases(_weight_like(n, k, g), m, g, "random weights")
    if real is not None:
        out += _w12_cases(_fit(real, n, k), m, g, "real weights")
    return out


def _w12_cases(w: Tensor, m: int, g: torch.Generator, tag: str) -> list[Case]:
    from specpilot.mechanisms.w12_format import ESC_ROWS, decode, encode

    n, k = w.shape
    t = encode(w, "v4")
    dec = decode(t)  # [N, K] bf16: the reference dequantisation (equals w, bit for bit)
    # at least gemm_common.counter_buffer(N) (whose import needs triton, which the checker may lack)
    counters = torch.zeros(-(-n // ESC_ROWS) * 8, dtype=torch.int32)
    if k <= PROBES_MAX * m:
        cols = list(range(k))
    else:  # every escape's column first (up to half the probes), then a seeded sample
        esc = sorted({int(r) % k for r in (t.esc_records >> 8).tolist()})
        extra = torch.randperm(k, generator=g)[: PROBES_MAX * m].tolist()
        cols = list(dict.fromkeys([*esc[: PROBES_MAX * m // 2], *extra]))[: PROBES_MAX * m]
    cases = []
    for i in range(0, len(cols), m):
        chunk = cols[i : i + m]
        x = torch.zeros(m, k, dtype=torch.bfloat16)
        x[torch.arange(len(chunk)), torch.tensor(chunk)] = 1.0
        want = dec[:, chunk].t()  # [len(chunk), N]

        def probe(y: Tensor, want: Tensor = want, chunk: list[int] = chunk) -> str | None:
            if tuple(y.shape) != (m, n) or y.dtype != torch.bfloat16:
                return f"output {tuple(y.shape)} {y.dtype}, want [{m}, {n}] bf16"
            got = y[: len(chunk)]
            bad = (_bits(got) != _bits(want)) & ~((got == 0) & (want == 0))  # ±0 alike
            if bool(bad.any()):
                r, c = (int(v) for v in bad.nonzero()[0])
                return (
                    f"decode not bit-exact: weight [{c}, {chunk[r]}] read back as "
                    f"{float(got[r, c])!r}, the reference dequantisation is {float(want[r, c])!r}"
                )
            return None

        cases.append(Case(f"{tag}, decode probe {i // m}", (x, t, counters), probe))
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    xd, wd = x.double(), dec.double()

    def product(y: Tensor) -> str | None:
        if tuple(y.shape) != (m, n) or y.dtype != torch.bfloat16:
            return f"output {tuple(y.shape)} {y.dtype}, want [{m}, {n}] bf16"
        z = xd @ wd.T
        bound = ULP_BF16 * z.abs() + k * EPS_FP32 * (xd.abs() @ wd.abs().T) + 2.0**-133
        ratio = ((y.double() - z).abs() / bound).nan_to_num(nan=float("inf"))
        worst = float(ratio.max())
        if worst > 1.0:
            r, c = (int(v) for v in (ratio == ratio.max()).nonzero()[0])
            return (
                f"product off by {worst:.1f}x the fp32 reduction bound at [{r}, {c}] "
                f"({float(y[r, c])!r} vs exact {float(z[r, c])!r})"
            )
        return None

    cases.append(Case(f"{tag}, product on random x", (x, t, counters), product))
    return cases


def w12_gemm_current(x: Tensor, w: Any, counters: Tensor) -> Tensor:  # [M, K] -> [M, N] bf16
    """What the engine runs at this width before any search: the tensor-core kernel at its
    cold-start tiling (``kernels/w12_tilings.DEFAULT``)."""
    from specpilot.kernels.w12_mma import w12_mma
    from specpilot.kernels.w12_tilings import DEFAULT_TILINGS

    cfg = DEFAULT_TILINGS.config(x.shape[0], *w.shape)
    return w12_mma(x, w, counters, cfg=cfg, ptx=x.is_cuda)


LLAMA3_8B_SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))
"""(N, K) of the 8B's linear layers: qkv, o, gate_up, down."""

W12_GEMM = KernelSlot(
    name="w12-gemm",
    summary=(
        "y = x @ decode(w)^T for a W12 weight in layout v4 (mechanisms/w12_format.py: per "
        "64-column group, 32-bit sign+mantissa words in w.sm and 16-bit exponent-code words in "
        "w.codes, each word holding weights (c, c+16, c+32, c+48); exponent = code + w.base; "
        "escapes (code 0) as CSR records per 16-row block in w.esc_offsets / esc_records / "
        "esc_values) at a verify width M <= 64; bf16 in, fp32 accumulate, bf16 out (the engine's "
        "kernel: specpilot.kernels.w12_mma.w12_mma). The "
        "decode must be bit-exact; the product may differ from an exact one only by the fp32 "
        "reduction bound. counters is a zeroed int32 split-K buffer the kernel leaves zeroed."
    ),
    signature="kernel(x: Tensor[M, K] bf16, w: W12Tensor[N, K] layout v4, counters: Tensor int32) -> Tensor[M, N] bf16",
    shapes=tuple({"m": m, "n": n, "k": k} for m in (2, 4, 8, 16) for n, k in LLAMA3_8B_SHAPES),
    cases=w12_gemm_cases,
    current="specpilot.kernels.slots:w12_gemm_current",
    needs_cuda=True,
    mechanism="w12",
)

SLOTS: dict[str, KernelSlot] = {s.name: s for s in (W12_GEMM,)}
"""Name -> slot; built once at import, never mutated."""


def resolve_slot(name: str) -> KernelSlot:
    """A registered slot by name, or any ``module:ATTRIBUTE`` holding one (tests, plug-ins)."""
    if name in SLOTS:
        return SLOTS[name]
    if ":" in name:
        slot = load(name)
        if isinstance(slot, KernelSlot):
            return slot
    raise ValueError(f"unknown kernel slot {name!r}; registered: {', '.join(SLOTS)}")


__all__ = ["SLOTS", "W12_GEMM", "Case", "KernelSlot", "Shape", "resolve_slot", "to_device"]
