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

from specpilot.kernels.gemm_common import _bits_to_f32

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


# The GEMM's half-group decode (``w12_gemm``): the same bits, one half of a 64-column group.
@triton.jit
def _decode_ops(sm, cb, base, HIGH: tl.constexpr):
    """Plain Triton decode: ``sm`` uint8, ``cb`` uint8 code bytes (the low or the ``HIGH`` nibble
    is this half's code), ``base`` int32 ``[BN, 1]`` -> bf16 bit patterns in int32 (an escape,
    code 0, gives the placeholder exponent ``base``)."""
    smi = sm.to(tl.int8, bitcast=True).to(tl.int32)  # sign-extended
    cbi = cb.to(tl.int32)
    code = (cbi >> 4) if HIGH else (cbi & 0xF)
    return (smi & 0x807F) | ((code + base) << 7)


_PRMT_ASM = """{{
    .reg .b32 c, s01, s23, c01, c23, m;
    {code}
    prmt.b32 s01, $2, 0, 0x9180;
    prmt.b32 s23, $2, 0, 0xB3A2;
    prmt.b32 c01, c, 0, 0x4140;
    prmt.b32 c23, c, 0, 0x4342;
    shl.b32 c01, c01, 3;
    shl.b32 c23, c23, 3;
    mov.b32 m, 0x807F807F;
    lop3.b32 s01, s01, m, c01, 0xE2;
    lop3.b32 s23, s23, m, c23, 0xE2;
    add.u32 $0, s01, $4;
    add.u32 $1, s23, $4;
    }}"""
_PRMT_HIGH = tl.constexpr(_PRMT_ASM.format(code="mov.b32 c, $3;"))
"""High nibbles: already in the high half of their byte."""
_PRMT_LOW = tl.constexpr(_PRMT_ASM.format(code="shl.b32 c, $3, 4;"))
"""Low nibbles: moved to the high half of their byte (what lands below is masked off)."""


@triton.jit
def _decode_prmt(sm, cb, base2, HIGH: tl.constexpr):
    """The same decode as ``_decode_ops``, four weights per instance, as bf16: one 32-bit word of
    ``sm`` and one of code bytes become two words of bf16 pairs with two ``prmt`` byte permutes
    (sign-replicating the sign/mantissa bytes into 16-bit lanes), two more for the code bytes, one
    shift per pair to move the nibble under the exponent field, one ``lop3`` to merge
    ``(s & 0x807F) | (code << 7)`` and one add of ``base`` in both lanes (``base2`` =
    ``base << 7 | base << 23``; no carry crosses a lane since ``base + code <= 255``)."""
    asm: tl.constexpr = _PRMT_HIGH if HIGH else _PRMT_LOW
    return tl.inline_asm_elementwise(
        asm, "=r,=r,r,r,r,r,r,r", [sm, cb, base2], dtype=tl.bfloat16, is_pure=True, pack=4
    )


@triton.jit
def _bits_to_operand(bits, INTERPRET: tl.constexpr):
    """Bit patterns -> a ``tl.dot`` operand: bf16 on the GPU; exact fp32 in the interpreter,
    whose ``dot`` multiplies the raw uint16 storage of bf16."""
    if INTERPRET:
        return _bits_to_f32(bits)
    return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)


__all__ = [
    "decode_tile_bits_ops",
    "decode_tiles_bf16_ptx",
    "decode_words_f32_ops",
    "decode_words_f32_ptx",
]
