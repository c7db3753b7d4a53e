"""Loaded at start-up by the test suite's interpreter subprocesses (``conftest.run_interpreted``
puts this folder on ``PYTHONPATH``): makes Triton's interpreter skip a redundant step.

Under ``TRITON_INTERPRET=1`` every call of a ``@triton.jit`` helper from inside a kernel
re-runs ``_patch_lang`` over the helper's ``triton.language`` modules (``inspect.getmembers``
of each and a few hundred ``setattr``), although the running kernel already patched those same
modules and restores them when it ends; in the W12 and fused-GEMV kernels that is about a third
of the interpreter's time. Here a helper call skips it when every language module it sees is one
the running kernel patched, and patches as before otherwise. The kernels' semantics do not
change: the skipped patch would set the attributes to equivalent interpreter functions.
"""

from __future__ import annotations

import functools
import inspect
import os


def _install() -> None:
    try:
        import triton.language as tl
        from triton.runtime import interpreter as interp
    except ImportError:
        return
    executor, patch_lang = (
        getattr(interp, "GridExecutor", None),
        getattr(interp, "_patch_lang", None),
    )
    if executor is None or patch_lang is None or not hasattr(interp, "InterpretedFunction"):
        return  # another Triton: leave it as it is
    grid_call = executor.__call__
    running: list[frozenset[int]] = []  # the language modules each running kernel patched
    launching = [False]  # between a kernel's launch and its own (needed) patch

    def langs(fn: object) -> frozenset[int]:
        g = getattr(fn, "__globals__", {})
        return frozenset(id(v) for v in g.values() if inspect.ismodule(v) and v in (tl, tl.core))

    @functools.wraps(grid_call)
    def kernel_call(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        running.append(langs(self.fn))
        launching[0] = True
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            launching[0] = False
            running.pop()

    @functools.wraps(patch_lang)
    def patch_once(fn):  # type: ignore[no-untyped-def]
        if launching[0]:  # the kernel's own patch, restored when it ends
            launching[0] = False
            return patch_lang(fn)
        if running and langs(fn) <= running[-1]:  # a helper inside it: already patched
            return interp._LangPatchScope()
        return patch_lang(fn)

    interp.GridExecutor.__call__ = kernel_call
    interp._patch_lang = patch_once


if os.environ.get("TRITON_INTERPRET") == "1":
    _install()
