"""L2 prefetch of a byte range of a tensor: a Triton kernel that issues prefetch hints and moves
nothing into registers or memory.

Two PTX instructions (``instruction``):

* ``line`` — ``prefetch.global.L2 [addr]`` once per ``chunk``-byte step (128: one L2 line);
* ``bulk`` — ``cp.async.bulk.prefetch.L2.global [addr], size`` once per ``chunk`` bytes (sm_90+:
  the bulk copy engine splits it into lines; 16-byte aligned address and size).

Neither waits for the data, returns a value or writes memory, so a prefetch cannot change any
value a later kernel reads. A few programs (``programs``) loop over the range in strides of
``programs × BLOCK`` chunks, front first (the GEMV that follows reads its matrix from the front),
so the launch occupies few SMs while the other kernels run.

Where the PTX cannot run, :func:`launch_mode` — the one switch — says what happens instead:
``asm`` on CUDA; ``interpret`` under ``TRITON_INTERPRET=1`` (the interpreter runs no inline PTX):
the same kernel with the asm compiled out, its range arithmetic still run and, given a trace
buffer, every chunk it would prefetch recorded (the tests check that); ``none`` elsewhere (the
CPU): nothing is launched. Triton is imported only when a kernel is launched.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
from torch import Tensor

from specpilot.errors import SpecPilotError
from specpilot.kernels import triton_usable

LINE_BYTES = 128
"""One L2 line: the step of the ``line`` instruction."""
BULK_ALIGN = 16
"""``cp.async.bulk`` addresses and sizes are multiples of 16 bytes."""
INSTRUCTIONS = ("bulk", "line")
BLOCK = 128
"""Chunks per program per loop step (one per thread at 4 warps)."""


@dataclass(frozen=True, slots=True)
class PrefetchSpec:
    """How one range is prefetched."""

    instruction: str = "bulk"
    """``bulk`` (``cp.async.bulk.prefetch.L2``, sm_90+) or ``line`` (``prefetch.global.L2``)."""
    programs: int = 8
    """Programs (CTAs) of the launch: few, so that it takes few SMs from concurrent kernels."""
    chunk: int = 0
    """Bytes per instruction (0: 128 for ``line``, 16 KiB for ``bulk``)."""

    def __post_init__(self) -> None:
        if self.instruction not in INSTRUCTIONS:
            raise SpecPilotError(
                f"L2 prefetch instruction must be one of {', '.join(INSTRUCTIONS)}, "
                f"got '{self.instruction}'."
            )
        if self.programs < 1:
            raise SpecPilotError("L2 prefetch needs at least one program.")
        c = self.chunk_bytes
        if c < BULK_ALIGN or c % BULK_ALIGN or c & (c - 1):
            raise SpecPilotError(f"L2 prefetch chunk must be a power of two >= 16 bytes, got {c}.")

    @property
    def chunk_bytes(self) -> int:
        if self.chunk:
            return self.chunk
        return LINE_BYTES if self.instruction == "line" else 16 << 10


def launch_mode(device: torch.device) -> str:
    """``asm`` (CUDA: the PTX runs), ``interpret`` (``TRITON_INTERPRET=1``: the kernel runs with
    the asm compiled out) or ``none`` (no Triton, or the CPU: nothing is launched)."""
    if not triton_usable(device):
        return "none"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "interpret"
    return "asm" if device.type == "cuda" else "none"


def bulk_supported(device: torch.device) -> bool:
    """Whether ``device`` has ``cp.async.bulk`` (compute capability 9.0 or newer)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def byte_range(t: Tensor, nbytes: int, offset: int = 0) -> tuple[int, int]:
    """``[lo, hi)`` in bytes of ``t``'s storage from ``offset``, at most ``nbytes`` long, clipped
    to the tensor and rounded to 16 bytes (a bulk prefetch's alignment)."""
    if not t.is_contiguous():
        raise SpecPilotError("L2 prefetch takes a contiguous tensor (a weight matrix).")
    total = t.numel() * t.element_size()
    lo = min(max(offset, 0), total) // BULK_ALIGN * BULK_ALIGN
    hi = min(lo + max(nbytes, 0), total) // BULK_ALIGN * BULK_ALIGN
    return lo, max(lo, hi)


def num_chunks(lo: int, hi: int, spec: PrefetchSpec) -> int:
    c = spec.chunk_bytes
    return -(-(hi - lo) // c)


@cache
def _kernel() -> Any:
    """The Triton kernel, built on first use (so that importing this module needs no Triton)."""
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["lo", "hi", "n_trace"])
    def l2_prefetch_kernel(
        base_ptr,  # uint8 view of the tensor
        lo,  # first byte (a multiple of 16)
        hi,  # one past the last byte (a multiple of 16)
        trace_ptr,  # [3, n_chunks] int64: byte offset, size, visits of each chunk (TRACE only)
        n_trace,
        CHUNK: tl.constexpr,
        BLOCK: tl.constexpr,
        BULK: tl.constexpr,
        ASM: tl.constexpr,
        TRACE: tl.constexpr,
    ):
        pid = tl.program_id(0)
        step = tl.num_programs(0) * BLOCK
        n = (hi - lo + CHUNK - 1) // CHUNK
        c0 = pid * BLOCK
        while c0 < n:  # a while loop: the interpreter takes no runtime range() bound
            idx = c0 + tl.arange(0, BLOCK)  # [BLOCK] chunk numbers
            ok = idx < n
            off = lo + idx.to(tl.int64) * CHUNK  # [BLOCK] byte offsets
            size = tl.minimum(hi - off, CHUNK).to(tl.int32)  # [BLOCK] bytes, 16-aligned
            if ASM:
                addr = (base_ptr + off).to(tl.int64)
                if BULK:
                    tl.inline_asm_elementwise(
                        "{ .reg .pred p; setp.ne.s32 p, $3, 0; "
                        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
                        "=r,l,r,r",
                        [addr, size, ok.to(tl.int32)],
                        dtype=tl.int32,
                        is_pure=False,
                        pack=1,
                    )
                else:
                    tl.inline_asm_elementwise(
                        "{ .reg .pred p; setp.ne.s32 p, $2, 0; "
                        "@p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                        "=r,l,r",
                        [addr, ok.to(tl.int32)],
                        dtype=tl.int32,
                        is_pure=False,
                        pack=1,
                    )
            if TRACE:
                keep = ok & (idx < n_trace)
                tl.store(trace_ptr + idx, off, mask=keep)
                tl.store(trace_ptr + n_trace + idx, size.to(tl.int64), mask=keep)
                tl.atomic_add(trace_ptr + 2 * n_trace + idx, keep.to(tl.int64), mask=keep)
            c0 += step

    return l2_prefetch_kernel


def prefetch_l2(
    t: Tensor,
    nbytes: int,
    spec: PrefetchSpec,
    offset: int = 0,
    trace: Tensor | None = None,  # [3, num_chunks] int64, zeroed (interpret mode only)
) -> Any:
    """Issue L2 prefetches for ``nbytes`` of ``t`` from byte ``offset`` on the current stream.

    Returns what the launch returns: on CUDA the compiled kernel (its ``asm["ptx"]`` holds the
    instructions); None when interpreted or when nothing was launched (``launch_mode`` ``none``,
    or an empty range)."""
    mode = launch_mode(t.device)
    lo, hi = byte_range(t, nbytes, offset)
    if mode == "none" or hi <= lo:
        return None
    if trace is not None and mode != "interpret":
        raise SpecPilotError("A prefetch trace is recorded in interpret mode only.")
    bulk = spec.instruction == "bulk"
    if bulk and mode == "asm" and not bulk_supported(t.device):
        raise SpecPilotError(
            "cp.async.bulk.prefetch needs compute capability 9.0 (Hopper) or newer; use the "
            "'line' instruction on this GPU."
        )
    n = num_chunks(lo, hi, spec)
    programs = max(1, min(spec.programs, -(-n // BLOCK)))
    base = t.detach().reshape(-1).view(torch.uint8)
    trace_buf = trace if trace is not None else base  # never written unless TRACE
    n_trace = trace.shape[1] if trace is not None else 0
    return _kernel()[(programs,)](
        base, lo, hi, trace_buf, n_trace,
        CHUNK=spec.chunk_bytes, BLOCK=BLOCK, BULK=bulk, ASM=mode == "asm",
        TRACE=trace is not None, num_warps=4,
    )  # fmt: skip


__all__ = [
    "BLOCK",
    "INSTRUCTIONS",
    "LINE_BYTES",
    "PrefetchSpec",
    "bulk_supported",
    "byte_range",
    "launch_mode",
    "num_chunks",
    "prefetch_l2",
]
