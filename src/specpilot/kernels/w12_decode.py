"""W12 v3 decode in registers: sign/mantissa bytes + exponent codes -> bf16 (or fp32) weights.

Layout (``mechanisms/w12_format.py``, ``layout="v3"``): a ``sm`` byte is ``mantissa << 1 | sign
of its partner column`` (columns pair as ``(2i, 2i + 1)``), a code nibble names the exponent
``base + code``. For one 32-bit ``sm`` word ``A`` (bytes ``a0..a3``, four consecutive columns) and
the matching exponent bytes ``E = (codes & 0x0F0F0F0F) + base * 0x01010101`` (or the high nibbles,
``codes >> 4``, for the word of the group's second half):

    t  = prmt(A, E, 0x5140)          # [a0, E0, a1, E1]
    w01 = rotate_right(t, 1)         # = bf16(col 0) | bf16(col 1) << 16

because the rotate moves each mantissa down one bit, each exponent byte into the exponent field,
and bit 0 of ``a1`` (column 0's sign) to bit 15, bit 0 of ``a0`` (column 1's sign) to bit 31.
Columns 2 and 3 use selector ``0x7362``. Two instructions per pair of weights, plus 2.5 per
eight for the exponent bytes: ~1.6 integer instructions per weight. An fp32 copy of a bf16 in
the low / high half is one more shift / mask.

Each decoder has a PTX version (``tl.inline_asm_elementwise``; GPU only) and a plain Triton one
(interpreter, and the reference for the PTX one): the same bits.
"""

from __future__ import annotations

import triton
import triton.language as tl

_EXP = """
    and.b32 el, {c}, 0x0F0F0F0F;
    add.u32 el, el, {b};
    shr.u32 eh, {c}, 4;
    and.b32 eh, eh, 0x0F0F0F0F;
    add.u32 eh, eh, {b};"""

_PAIRS_F32 = tl.constexpr(
    "{\n    .reg .b32 el, eh, t;"
    + _EXP.format(c="$10", b="$11")
    + "".join(
        f"""
    prmt.b32 t, {src}, {e}, {sel};
    shf.r.wrap.b32 t, t, t, 1;
    shl.b32 ${out}, t, 16;
    and.b32 ${out + 1}, t, 0xFFFF0000;"""
        for src, e, base_out in (("$8", "el", 0), ("$9", "eh", 4))
        for sel, out in (("0x5140", base_out), ("0x7362", base_out + 2))
    )
    + "\n    }"
)
"""8 fp32 weights from one word of each half (``$8``, ``$9``), one code word (``$10``), base4."""


@triton.jit
def decode_words_f32_ptx(a, b, c, base4):
    """``a``, ``b`` int32 ``sm`` words of the first / second half of a group, ``c`` the int32 code
    word of both, ``base4 = base * 0x01010101`` -> the 8 weights as fp32, in column order
    ``a`` bytes 0..3, then ``b`` bytes 0..3 (GPU only)."""
    return tl.inline_asm_elementwise(
        _PAIRS_F32,
        "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r",
        [a, b, c, base4],
        dtype=(tl.float32,) * 8,
        is_pure=True,
        pack=1,
    )


@triton.jit
def _byte(w, i: tl.constexpr):
    return (w >> (8 * i)) & 0xFF


@triton.jit
def _weight_f32(a, e, i: tl.constexpr):
    """Column ``i`` of word ``a`` with exponent bytes ``e``, as fp32 (plain ops)."""
    bits = ((_byte(a, i ^ 1) & 1) << 15) | (_byte(e, i) << 7) | (_byte(a, i) >> 1)
    return (bits << 16).to(tl.float32, bitcast=True)


@triton.jit
def decode_words_f32_ops(a, b, c, base4):
    """The same as ``decode_words_f32_ptx`` with plain Triton integer ops."""
    el = (c & 0x0F0F0F0F) + base4
    eh = ((c >> 4) & 0x0F0F0F0F) + base4
    return (
        _weight_f32(a, el, 0),
        _weight_f32(a, el, 1),
        _weight_f32(a, el, 2),
        _weight_f32(a, el, 3),
        _weight_f32(b, eh, 0),
        _weight_f32(b, eh, 1),
        _weight_f32(b, eh, 2),
        _weight_f32(b, eh, 3),
    )


_PAIRS_BF16 = tl.constexpr(
    "{\n    .reg .b32 el, eh, t;"
    + _EXP.format(c="$6", b="$7")
    + """
    prmt.b32 t, $4, el, 0x5140;
    shf.r.wrap.b32 $0, t, t, 1;
    prmt.b32 t, $4, el, 0x7362;
    shf.r.wrap.b32 $1, t, t, 1;
    prmt.b32 t, $5, eh, 0x5140;
    shf.r.wrap.b32 $2, t, t, 1;
    prmt.b32 t, $5, eh, 0x7362;
    shf.r.wrap.b32 $3, t, t, 1;
    }"""
)
"""Four consecutive bytes of each half (``$4``, ``$5``) and their code bytes (``$6``) -> 2 + 2
bf16 pairs; ``$7`` (first of 4 packed int32) is base4."""


@triton.jit
def decode_tiles_bf16_ptx(lo, hi, cb, base4):
    """``lo``, ``hi`` uint8 ``sm`` tiles of a group's two halves and ``cb`` their code bytes (all
    the same shape, contiguous along the last axis in multiples of 4), ``base4`` int32 of that
    shape -> the two bf16 tiles (GPU only; four columns per instance)."""
    return tl.inline_asm_elementwise(
        _PAIRS_BF16,
        "=r,=r,=r,=r,r,r,r,r,r,r,r",
        [lo, hi, cb, base4],
        dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=4,
    )


@triton.jit
def decode_tile_bits_ops(sm, partner, cb, base, HIGH: tl.constexpr):
    """Plain-op decode of a uint8 ``sm`` tile given the bytes of the partner columns (``k ^ 1``)
    and the code bytes (this half's nibble: the low one, or the ``HIGH`` one) -> bf16 bit
    patterns in int32."""
    code = (cb.to(tl.int32) >> 4) if HIGH else (cb.to(tl.int32) & 0xF)
    s = partner.to(tl.int32) & 1
    return (s << 15) | ((code + base) << 7) | (sm.to(tl.int32) >> 1)


__all__ = [
    "decode_tile_bits_ops",
    "decode_tiles_bf16_ptx",
    "decode_words_f32_ops",
    "decode_words_f32_ptx",
]
