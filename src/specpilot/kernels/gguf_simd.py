"""The inner loop of ``kernels/gguf_gemm.py`` written as LLVM vector IR (numba intrinsics).

Left to LLVM's loop vectorizer, a 16-code group decodes into scalar converts or int64 lanes
(seen in ``inspect_asm``), and its dot products pay run-time trip-count and aliasing checks on
every group. Written as ``<16 x float>`` operations instead, one step of 32 weights is: one or
two 16-byte loads, a zero/sign extension, int-to-float conversions, the decode, and two FMAs per
row of ``x`` (``rows8``, ``pair4`` ..: the weights decoded once for up to 8 rows).

Exactness: each weight is ``llvm.fma(d, q, m)`` (or ``d * q`` without a min), one rounding of
an exact product, so it is gguf's dequantized fp32 weight bit for bit (see ``gguf_gemm``); f16
scales (uint16 bits) widen to fp32 exactly. Summation order, the same for every row of ``x``
whatever the width: lane ``j`` of chain A sums ``w[32g + j] * x[32g + j]`` over the steps
``g``, chain B the same at ``+16`` (one FMA each), then ``A + B`` is reduced by halving (8, 4,
2, 1 lanes).

Two things keep the loop fed (SmolLM2's 121 matrices of a token, 2 cores: 9.2 -> 5.9 ms streamed
from L3/DRAM, bit for bit the same sums): a software prefetch ``PREFETCH`` bytes ahead in every
weight row's codes (and its scales), since the hardware prefetcher does not run ahead of short
rows of a few hundred bytes; and on AVX-512 a ``q4`` group decodes by table: the 16 possible
weights ``fma(d, j, m)``, ``j = 0..15``, in one register, looked up by ``vpermps`` (which reads
the low 4 bits of each lane, so the low nibble needs no mask): the very values the conversion
path computes, one FMA per group instead of two conversions and two FMAs.

Arguments are C-contiguous arrays with flat element offsets (the typer refuses other layouts).
A change here must touch ``gguf_gemm.py`` too: numba's cache of ``gemm`` is keyed on that file.
"""

from __future__ import annotations

from typing import Any

import numba
from llvmlite import binding, ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_F = ir.FloatType()
_I32 = ir.IntType(32)
_VF = ir.VectorType(_F, 16)
_VB = ir.VectorType(ir.IntType(8), 16)
_VI = ir.VectorType(_I32, 16)


PREFETCH = 4096
"""Bytes ahead in a weight row's codes (about 14 rows of 288 bytes at K = 576) that each step
prefetches; its scales the same number of steps ahead."""


def _avx512() -> bool:
    """Whether numba compiles for a CPU with AVX-512F (``vpermps`` on 16 lanes)."""
    cfg: Any = numba.config
    if cfg.CPU_NAME:  # an explicit target (e.g. a portable cache): its features only
        return "+avx512f" in (cfg.CPU_FEATURES or "")
    return "+avx512f" in binding.get_host_cpu_features().flatten()


_TABLE = _avx512()


def _c(*tys: Any) -> bool:
    return all(isinstance(t, types.Array) and t.layout == "C" for t in tys)


def _at(context: Any, builder: Any, aty: Any, aval: Any, off: Any, vty: Any = None) -> Any:
    """Pointer to element ``off`` of a C array (cast to ``vty*`` when given)."""
    data = context.make_array(aty)(context, builder, aval).data
    p = builder.gep(data, [off])
    return p if vty is None else builder.bitcast(p, vty.as_pointer())


def _fma(builder: Any, a: Any, b: Any, c: Any) -> Any:
    fnty = ir.FunctionType(_VF, [_VF, _VF, _VF])
    fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.fma.v16f32")
    return builder.call(fn, [a, b, c])


def _permute(builder: Any, table: Any, idx: Any) -> Any:
    """``table[idx & 15]`` lane by lane (``vpermps``: the low 4 bits of each index)."""
    fnty = ir.FunctionType(_VF, [_VF, _VI])
    fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.avx512.permvar.sf.512")
    return builder.call(fn, [table, idx])


def _prefetch(context: Any, builder: Any, aty: Any, aval: Any, off: Any) -> None:
    """A read prefetch of element ``off`` of a C array into every cache level (a hint: an
    address past the array's end is harmless)."""
    i8p = ir.IntType(8).as_pointer()
    fnty = ir.FunctionType(ir.VoidType(), [i8p, _I32, _I32, _I32])
    fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
    ptr = builder.bitcast(_at(context, builder, aty, aval, off), i8p)
    builder.call(fn, [ptr, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])


def _splat(builder: Any, s: Any) -> Any:
    v = builder.insert_element(ir.Constant(_VF, ir.Undefined), s, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(_VF, ir.Undefined), ir.Constant(_VI, [0] * 16))


def _hsum(builder: Any, v: Any) -> Any:
    """Lanes summed by halving: [0:8]+[8:16], then 4, 2, 1 (a fixed order)."""
    width = 16
    while width > 1:
        width //= 2
        lo = builder.shuffle_vector(
            v, v, ir.Constant(ir.VectorType(_I32, width), list(range(width)))
        )
        hi = builder.shuffle_vector(
            v, v, ir.Constant(ir.VectorType(_I32, width), list(range(width, 2 * width)))
        )
        v = builder.fadd(lo, hi)
    return builder.extract_element(v, ir.Constant(_I32, 0))


def _load(builder: Any, ptr: Any, align: int) -> Any:
    return builder.load(ptr, align=align)


def _scalar(context: Any, builder: Any, aty: Any, aval: Any, off: Any) -> Any:
    """Element ``off`` as a float: uint16 arrays hold f16 bits (widened exactly)."""
    v = builder.load(_at(context, builder, aty, aval, off))
    if aty.dtype == types.uint16:
        v = builder.fpext(builder.bitcast(v, ir.HalfType()), _F)
    return v


def _i(builder: Any, v: int) -> Any:
    return ir.Constant(ir.IntType(64), v)


def _group(context: Any, builder: Any, tys: Any, vals: Any, qo: Any, so: Any, g: Any) -> Any:
    """Step ``g`` (32 weights) of a row: (weights 0..15, weights 16..31) as float vectors.
    ``q4`` (uint8 codes): nibbles of 16 bytes, ``fma(d, q, m)``; ``q8`` (int8 codes): two groups
    of 16, ``d * q`` (``fma(d, q, m)`` when a min array is given)."""
    q_t, sc_t, mn_t = tys
    q, sc, mn = vals

    def scale(i: Any) -> tuple[Any, Any]:
        s = builder.add(so, i)
        d = _splat(builder, _scalar(context, builder, sc_t, sc, s))
        m = None if mn_t is None else _splat(builder, _scalar(context, builder, mn_t, mn, s))
        return d, m

    def codes(i: Any) -> Any:
        off = builder.add(qo, builder.mul(i, _i(builder, 16)))
        return _load(builder, _at(context, builder, q_t, q, off, _VB), 1)

    if q_t.dtype == types.uint8 and _TABLE:  # the group's 16 weights, looked up
        c = builder.zext(codes(g), _VI)
        d, m = scale(g)
        iota = ir.Constant(_VF, [float(j) for j in range(16)])
        table = _fma(builder, d, iota, m) if m is not None else builder.fmul(d, iota)
        hi = builder.lshr(c, ir.Constant(_VI, [4] * 16))
        return _permute(builder, table, c), _permute(builder, table, hi)
    if q_t.dtype == types.uint8:
        c = builder.zext(codes(g), _VI)
        lo = builder.uitofp(builder.and_(c, ir.Constant(_VI, [15] * 16)), _VF)
        hi = builder.uitofp(builder.lshr(c, ir.Constant(_VI, [4] * 16)), _VF)
        d, m = scale(g)
        return _fma(builder, d, lo, m), _fma(builder, d, hi, m)
    out = []
    for j in (0, 1):
        i = builder.add(builder.mul(g, _i(builder, 2)), _i(builder, j))
        qf = builder.sitofp(builder.sext(codes(i), _VI), _VF)
        d, m = scale(i)
        out.append(builder.fmul(d, qf) if m is None else _fma(builder, d, qf, m))
    return out[0], out[1]


def _xvec(context: Any, builder: Any, x_t: Any, x: Any, xo: Any, g: Any, half: int) -> Any:
    off = builder.add(xo, builder.add(builder.mul(g, _i(builder, 32)), _i(builder, half)))
    return _load(builder, _at(context, builder, x_t, x, off, _VF), 4)


def _tile(r: int, nw: int) -> Any:
    """An intrinsic for ``r`` rows of ``x`` and ``nw`` weight rows:
    ``tile(x, xo, k, q, qo, qn, sc, mn, so, sn, out, oo, os)`` sets
    ``out[oo + i * os + j] = sum_k' x[xo + i * k + k'] * w_j[k']`` for ``i < r``, ``j < nw``,
    where weight row ``j`` has codes at ``qo + j * qn`` and scales at ``so + j * sn``. Each
    step's weights are decoded once for all ``r`` rows; ``nw`` independent rows keep more FMA
    chains in flight. ``mn`` None: no min (``d * q``)."""

    @intrinsic
    def tile(typingctx, x, xo, k, q, qo, qn, sc, mn, so, sn, out, oo, os):
        no_min = isinstance(mn, types.NoneType)
        if not (_c(x, q, sc, out) and (no_min or _c(mn))):
            return None
        if q.dtype not in (types.uint8, types.int8):
            return None

        def codegen(context, builder, sig, args):
            xv, xo_, k_, qv, qo_, qn_, scv, mnv, so_, sn_, outv, oo_, os_ = args
            tys = (q, sc, None if no_min else mn)
            zero = ir.Constant(_VF, [0.0] * 16)
            accs = [
                [
                    (
                        cgutils.alloca_once_value(builder, zero),
                        cgutils.alloca_once_value(builder, zero),
                    )
                    for _ in range(nw)
                ]
                for _ in range(r)
            ]
            xos = [builder.add(xo_, builder.mul(k_, _i(builder, i))) for i in range(r)]
            qos = [builder.add(qo_, builder.mul(qn_, _i(builder, j))) for j in range(nw)]
            sos = [builder.add(so_, builder.mul(sn_, _i(builder, j))) for j in range(nw)]
            steps = builder.sdiv(k_, _i(builder, 32))
            step = 16 if q.dtype == types.uint8 else 32  # code bytes a step reads per row
            scales_ahead = PREFETCH // step * (1 if q.dtype == types.uint8 else 2)
            with cgutils.for_range(builder, steps) as loop:
                g = loop.index
                for qo, so in zip(qos, sos, strict=True):  # PREFETCH bytes ahead in each row
                    ahead = builder.add(builder.mul(g, _i(builder, step)), _i(builder, PREFETCH))
                    _prefetch(context, builder, q, qv, builder.add(qo, ahead))
                    s_ahead = builder.add(so, builder.add(g, _i(builder, scales_ahead)))
                    _prefetch(context, builder, sc, scv, s_ahead)
                    if not no_min:
                        _prefetch(context, builder, mn, mnv, s_ahead)
                ws = [
                    _group(context, builder, tys, (qv, scv, mnv), qo, so, g)
                    for qo, so in zip(qos, sos, strict=True)
                ]
                for row, xrow in zip(accs, xos, strict=True):
                    xa = _xvec(context, builder, x, xv, xrow, g, 0)
                    xb = _xvec(context, builder, x, xv, xrow, g, 16)
                    for (acc_a, acc_b), (wa, wb) in zip(row, ws, strict=True):
                        builder.store(_fma(builder, wa, xa, builder.load(acc_a)), acc_a)
                        builder.store(_fma(builder, wb, xb, builder.load(acc_b)), acc_b)
            for i, row in enumerate(accs):
                for j, (acc_a, acc_b) in enumerate(row):
                    total = _hsum(builder, builder.fadd(builder.load(acc_a), builder.load(acc_b)))
                    at = builder.add(
                        oo_, builder.add(builder.mul(os_, _i(builder, i)), _i(builder, j))
                    )
                    builder.store(total, _at(context, builder, out, outv, at))
            return context.get_dummy_value()

        i64 = types.int64
        sig = types.none(x, i64, i64, q, i64, i64, sc, mn, i64, i64, out, i64, i64)
        return sig, codegen

    return tile


rows1, rows8 = (_tile(r, 1) for r in (1, 8))
pair1, pair2, pair4 = (_tile(r, 2) for r in (1, 2, 4))

__all__ = ["pair1", "pair2", "pair4", "rows1", "rows8"]
