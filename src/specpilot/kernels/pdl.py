"""Programmatic dependent launch (PDL, sm_90 and later) for the decode kernels.

Inside a CUDA graph every kernel of a decode step starts only once the one before it has ended,
so each small GEMV pays its ramp-up (the first weight bytes in flight) after the previous
kernel's tail. With PDL a kernel launched with ``launch_pdl`` may start as soon as every program
of the kernel before it has signalled ``gdc_launch_dependents``; it must not read what that kernel
writes, nor write anything, before ``gdc_wait`` (which returns once the previous grid has
completed and its writes are visible). Our use:

* every decode kernel of ours signals at its start (:func:`trigger`): alone this changes nothing,
  since only a dependent launched with ``launch_pdl`` reacts to it;
* the decode GEMV (``kernels/w12_gemv.py``), when its tiling asks for it (``GemvConfig.pdl``), is
  launched with ``launch_pdl`` and loads only its first K step of *weights* (immutable) before
  ``gdc_wait``; activations, escapes, the norm statistics, partials, counters and the output all
  come after it. Since every such kernel waits before it ends, a kernel two launches back has
  completed too when the wait returns.

Off the GPU (the interpreter) and before sm_90 the flags are off and the kernels are unchanged.
"""

from __future__ import annotations

import os
from functools import cache

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without grid dependency control: supported() says False
    gdc_launch_dependents = gdc_wait = None


@cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def supported(device: torch.device) -> bool:
    """Whether kernels on ``device`` can use PDL (CUDA, sm_90+, not interpreted, Triton has it)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1" or gdc_wait is None:
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


@triton.jit
def trigger(ON: tl.constexpr):
    """Let a dependent kernel launched with ``launch_pdl`` start (once every program got here)."""
    if ON:
        gdc_launch_dependents()


@triton.jit
def wait(ON: tl.constexpr):
    """Block until the previous kernel has completed and its writes are visible."""
    if ON:
        gdc_wait()


__all__ = ["supported", "trigger", "wait"]
