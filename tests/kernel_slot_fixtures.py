"""A kernel slot small enough for the sandbox tests on the CPU: ``y = 2 x`` in fp32, bit-exact.

Its current kernel is plain torch, so the sandbox needs no Triton to time a candidate; a
candidate may still be a Triton kernel, run by the interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from specpilot.kernels.slots import Case, KernelSlot, Shape


def double_cases(shape: Shape, seed: int, real: Tensor | None) -> list[Case]:
    g = torch.Generator().manual_seed(seed)
    xs = [("random x", torch.randn(shape["n"], generator=g))]
    if real is not None:
        xs.append(("real x", real.flatten()[: shape["n"]].float().contiguous()))
    cases = []
    for label, x in xs:
        want = 2 * x

        def check(y: Tensor, want: Tensor = want) -> str | None:
            if y.shape != want.shape or y.dtype != want.dtype:
                return f"output {tuple(y.shape)} {y.dtype}, want {tuple(want.shape)} {want.dtype}"
            bad = (y.view(torch.int32) != want.view(torch.int32)).nonzero()
            if len(bad):
                i = int(bad[0])
                return f"not bit-exact at [{i}]: {float(y[i])!r} != {float(want[i])!r}"
            return None

        cases.append(Case(label, (x,), check))
    return cases


def double_current(x: Tensor) -> Tensor:
    return x * 2


DOUBLE = KernelSlot(
    name="test-double",
    summary="y = 2 x, fp32, bit-exact",
    signature="kernel(x: Tensor[N] fp32) -> Tensor[N] fp32",
    shapes=({"n": 1000}, {"n": 64}),
    cases=double_cases,
    current="kernel_slot_fixtures:double_current",
    needs_cuda=False,
    mechanism="test",
)


def slow_double(x: Tensor) -> Tensor:
    """The same result as ``double_current``, a millisecond later: a candidate beats it."""
    import time

    time.sleep(1e-3)
    return x * 2


SLOW_DOUBLE = dataclasses.replace(
    DOUBLE,
    name="test-slow-double",
    summary="y = 2 x, fp32, bit-exact (the current kernel sleeps 1 ms)",
    current="kernel_slot_fixtures:slow_double",
)
