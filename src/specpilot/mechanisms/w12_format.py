"""W12: a lossless ~12-bit storage format for bf16 weight matrices, laid out for GEMV/GEMM kernels.

A bf16 is ``sign(1) | exponent(8) | mantissa(7)``. Trained weights use few exponents (all-MiniLM-L6-v2
cast to bf16: ≈2.66 bits of exponent entropy), so W12 keeps sign and mantissa verbatim and replaces
the exponent by a 4-bit code. Three byte layouts exist (``layout``): ``"v3"`` is what the GEMV and
the first ``tl.dot`` kernel read, ``"v4"`` (the same bytes in another order, below) is what the
tensor-core kernel ``kernels/w12_mma.py`` reads, ``"v2"`` is kept so that the GPU script can time
the previous kernel on the same weights.

``sm``       ``[N, Kp]`` uint8 with ``Kp = 64 * ceil(K / 64)`` (columns past K are 0), one byte per
             weight: ``v3``: ``mantissa << 1 | sign of column k ^ 1`` (the sign of the *other*
             column of its aligned pair, see below); ``v2``: ``sign << 7 | mantissa``.
``codes``    ``[N, Kp / 2]`` uint8: ``Kp / 64`` column groups of 64; in group ``g``, byte ``j`` holds
             the exponent code of column ``64g + j`` in its low nibble and of column ``64g + 32 + j``
             in its high nibble (columns past K get code 0). Code ``c >= 1`` means exponent
             ``base + c``; code 0 is the **escape**.
``v4``       per 64-column group, 16 words of 4 bytes, one byte for each of the columns
             ``(w, w + 16, w + 32, w + 48)`` ("quarters" 0..3) of word ``w``: ``sm`` byte ``4w + q``
             is column ``16q + w``'s ``mantissa << 1 | sign of column k ^ 16`` (its partner is the
             other quarter of its pair (0, 1) or (2, 3) in the *same* word), and ``codes``
             half-word ``w`` (little-endian) holds the codes of quarters 0, 2, 1, 3 in bits
             ``0-3, 4-7, 8-11, 12-15``. So every word decodes on its own (``kernels/w12_mma.py``:
             the decode is elementwise whatever layout the compiler gives it) and a tensor-core
             kernel can decode ``[rows, words]`` tiles straight into its operand registers.
``base``     one int per tensor: codes 1..15 cover the window ``[base + 1, base + 15]``
             (``0 <= base <= 240``) that holds the most weights; the encoder picks it from the
             tensor's exponent histogram. An escape decodes to the placeholder exponent ``base``.
``esc_offsets`` ``[ceil(N/16) + 1]`` int32 — CSR offsets of the escapes of each block of 16 rows.
``esc_records`` ``[n_esc]`` int32 — one per escaped weight, ``((n % 16) * K + k) << 8 | exponent``,
             in row-major order (so each 16-row block's records are contiguous and sorted by k).
``esc_values``  ``[n_esc]`` bf16 — the escaped weights themselves (so a kernel can fetch everything
             it needs for its escapes before its main loop, without re-reading ``sm``).

Why this layout (GPU first):
* **Fixed-size fields, no entropy coding in the hot path.** Every weight's byte and nibble sit at
  an address computed from (n, k) alone, so a kernel tile loads with wide coalesced loads and
  decodes in registers, with no dependence on any other tile. 8 + 4 = 12 bits per weight. Rows
  are padded to 64 bytes so that any 16-byte word of a row is aligned and a kernel can load ``sm``
  as int32 words (4 weights) and ``codes`` as int32 words (8 weights) with no K masks.
* **Nibbles paired across half-groups, not neighbours.** Code byte ``j`` holds the codes of
  columns ``j`` and ``j + 32`` of its group, so code word ``w`` (bytes ``4w..4w+3``) lines up with
  ``sm`` word ``w`` of the group's first half (low nibbles) and word ``w`` of its second half
  (high nibbles): a kernel loads three same-shaped int32 tiles and decodes them elementwise, with
  no shuffle between threads.
* **A byte permute and a rotate per pair of weights (v3).** With ``E`` the four exponent bytes
  ``base + code`` of one ``sm`` word (``(codes & 0x0F0F0F0F) + base * 0x01010101``: no carries,
  ``base + 15 <= 255``), one ``prmt`` builds ``[b0, E0, b1, E1]`` for the aligned column pair
  (0, 1) of the word and a 32-bit rotate right by one turns it into the two bf16 values: the
  rotate moves each byte's mantissa down by one bit, each exponent into bits 7..14 / 23..30, and
  bit 0 of each byte (the partner's sign, stored there for exactly this) to bit 15 / 31. About
  1.6 integer instructions per weight (``kernels/w12_decode.py``); ``v2`` needed ~2.6.
* **A window of consecutive exponents instead of a 16-entry codebook.** ``exponent = base + code``
  is one add (four weights per 32-bit add), where a free codebook needs a table lookup per
  weight. Weight exponent histograms are unimodal (a geometric tail below the largest
  magnitudes), so the best window of 15 covers as much as the 15 most frequent exponents: on
  all-MiniLM-L6-v2 (bf16) the escapes are 0.0245% of weights with the window against 0.0228%
  with a free top-15 set.
* **Escapes out of line, per 16-row block, never serializing the kernel.** The kernel decodes an
  escape as the placeholder (its own sign and mantissa, exponent ``base``: below every window
  exponent) inside the dense tile and, once per program, adds ``x·w`` and subtracts ``x·p`` for
  each escaped weight ``w`` with placeholder ``p``. A program reads only its own row blocks'
  records (one contiguous CSR range per 16 rows); nothing is prefix-summed or searched at run
  time. Records hold the position and the exponent; 28 bits are used (K < 2**19).
* **Metadata is tiny**: 48 bits per escape plus 32 bits per 16 rows, plus ``base``. At 0.025%
  escapes that is ≈ 0.012 + 32 / (16·K) bits per weight: ≈ 12.01 bits/weight at K = 4096.

``decode`` reverses ``encode`` bit for bit for *any* bf16 input (NaN payloads, ±Inf, denormals,
-0.0), in either layout: the sign and mantissa bits are stored verbatim, and every exponent is
either the window value named by its code or, for an escape, stored verbatim in its record.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

ESC_ROWS = 16
"""Rows per escape block (one CSR offset each). Kernel tiles use ``BLOCK_N % ESC_ROWS == 0``."""
ESCAPE = 0
"""The escape code; codes 1..15 name exponents ``base + code``."""
WINDOW = 15
MIN_TOP = WINDOW
"""Lowest allowed window top ``base + 15``: keeps the placeholder exponent ``base`` non-negative."""
GROUP = 64
"""Columns per code group: byte ``j`` of a group pairs columns ``j`` and ``j + GROUP // 2``."""
HALF = GROUP // 2
MAX_K = 1 << 19
"""Records pack ``(n % 16) * K + k`` in 20 bits above the 8-bit exponent, so K < 2**19."""


LAYOUTS = ("v3", "v2", "v4")
"""Byte layouts of ``sm``: ``v3`` ``mantissa << 1 | partner's sign`` (the GEMV's), ``v2``
``sign << 7 | mantissa`` (the previous kernel's, kept for comparisons), ``v4`` v3's bytes and codes
reordered per 64-column group for the tensor-core kernel."""
QUARTER = GROUP // 4
"""v4: a group is 4 quarters of 16 columns; word ``w`` of a group holds column ``w`` of each."""


@dataclass(frozen=True, slots=True)
class W12Tensor:
    """One ``[N, K]`` bf16 matrix in W12 (see the module docstring for the layout)."""

    sm: Tensor  # [N, Kp] uint8, Kp = 64 * ceil(K / 64): one sign/mantissa byte per weight
    codes: Tensor  # [N, Kp / 2] uint8: codes of columns j, j + 32 of each 64-group
    base: int  # placeholder exponent; code c >= 1 names exponent base + c
    esc_offsets: Tensor  # [ceil(N/16) + 1] int32: CSR offsets per 16-row block
    esc_records: Tensor  # [n_esc] int32: ((n % 16) * K + k) << 8 | exponent
    esc_values: Tensor  # [n_esc] bf16: the escaped weights
    base_t: Tensor  # [1] int32: ``base`` on the device, for kernels that must load it
    k: int  # columns of the matrix (``sm`` holds Kp >= k)
    layout: str = "v3"
    tile_escapes: tuple[int, ...] = ()
    """Most escapes in any tile of ``64 << i`` rows (i = 0, 1, 2), counted at encode time, so a
    tiled kernel sizes its escape chunk without reading the device (``kernels/w12_mma.py``)."""
    list_records: Tensor | None = None
    """v4: ``[ceil(N/64), CAP]`` int32, the escapes of each 64-row tile at a fixed address (``CAP``
    a power of two >= 16 that holds the fullest tile): ``row % 64 << 19 | k``, ``-1`` past the
    tile's last; the tensor-core kernel loads its tile's list with no dependent load before it."""
    list_values: Tensor | None = None
    """v4: ``[ceil(N/64), CAP]`` bf16, the escaped weights in ``list_records``' order (0 past the
    last)."""

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.sm.shape[0]), self.k

    @property
    def padded_k(self) -> int:
        return int(self.sm.shape[1])

    @property
    def device(self) -> torch.device:
        return self.sm.device

    @property
    def num_escapes(self) -> int:
        return int(self.esc_records.numel())

    def nbytes(self) -> int:
        """Bytes stored, all metadata included."""
        parts = (self.sm, self.codes, self.esc_offsets, self.esc_records, self.esc_values)
        lists = tuple(t for t in (self.list_records, self.list_values) if t is not None)
        return sum(t.numel() * t.element_size() for t in parts + lists) + 4

    def stream_bytes(self) -> int:
        """Bytes a kernel streams for the dense planes (what a roofline divides by bandwidth)."""
        return self.sm.numel() + self.codes.numel()

    def bits_per_weight(self) -> float:
        n, k = self.shape
        return 8.0 * self.nbytes() / max(1, n * k)

    def to(self, device: torch.device | str) -> W12Tensor:
        return W12Tensor(
            sm=self.sm.to(device),
            codes=self.codes.to(device),
            base=self.base,
            esc_offsets=self.esc_offsets.to(device),
            esc_records=self.esc_records.to(device),
            esc_values=self.esc_values.to(device),
            base_t=self.base_t.to(device),
            k=self.k,
            layout=self.layout,
            tile_escapes=self.tile_escapes,
            list_records=None if self.list_records is None else self.list_records.to(device),
            list_values=None if self.list_values is None else self.list_values.to(device),
        )


LIST_ROWS = 64
"""Rows per fixed-address escape list (``W12Tensor.list_records``)."""


def tile_lists(rows: Tensor, cols: Tensor, values: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """Escapes at ``(rows, cols)`` (sorted by row) with weights ``values`` -> per 64-row tile a
    fixed-size list: ``([T, CAP] int32 row % 64 << 19 | col, -1 past the end; [T, CAP] bf16)``."""
    tiles = (n + LIST_ROWS - 1) // LIST_ROWS
    tile = rows // LIST_ROWS  # [E]
    per = torch.bincount(tile, minlength=tiles)  # [T]
    cap = 16
    while cap < (int(per.max()) if rows.numel() else 0):
        cap *= 2
    first = torch.zeros(tiles, dtype=torch.int64, device=rows.device)
    first[1:] = per.cumsum(0)[:-1]
    slot = tile * cap + torch.arange(rows.numel(), device=rows.device) - first[tile]  # [E]
    recs = torch.full((tiles * cap,), -1, dtype=torch.int32, device=rows.device)
    recs[slot] = (((rows % LIST_ROWS) << 19) | cols).to(torch.int32)
    vals = torch.zeros(tiles * cap, dtype=values.dtype, device=rows.device)
    vals[slot] = values
    return recs.view(tiles, cap), vals.view(tiles, cap)


def _bits(w: Tensor) -> Tensor:  # [N, K] bf16 -> [N, K] int32 in [0, 65535]
    return w.view(torch.int16).to(torch.int32) & 0xFFFF


def padded(k: int) -> int:
    """Row length of ``sm`` (and twice that of ``codes``) for K columns."""
    return (k + GROUP - 1) // GROUP * GROUP


def choose_top(exponents: Tensor) -> int:
    """The top of the window ``[top - 14, top]`` that holds the most of ``exponents`` (lowest on
    ties); the format's ``base`` is ``top - 15``."""
    hist = torch.bincount(exponents.reshape(-1), minlength=256).to(torch.int64).cpu()  # [256]
    csum = torch.cat([torch.zeros(1, dtype=torch.int64), hist.cumsum(0)])  # [257]
    tops = torch.arange(MIN_TOP, 256)
    covered = csum[tops + 1] - csum[tops + 1 - WINDOW]  # [241]
    return int(tops[int(torch.argmax(covered))])


def _partner(t: Tensor, layout: str) -> Tensor:  # [N, Kp] -> the value of each column's partner
    if layout == "v4":  # column k ^ 16
        n, kp = t.shape
        return t.view(n, kp // 32, 2, 16).flip(2).reshape(n, kp)
    return t.view(t.shape[0], -1, 2).flip(-1).reshape(t.shape)  # column k ^ 1


def _pack_sm(bits: Tensor, layout: str) -> Tensor:  # [N, Kp] int32 bf16 bits -> [N, Kp] uint8
    sign = (bits >> 15) & 1
    mant = bits & 0x7F
    if layout == "v2":
        return ((sign << 7) | mant).to(torch.uint8)
    sm = ((mant << 1) | _partner(sign, layout)).to(torch.uint8)  # by column
    return _v4_order(sm) if layout == "v4" else sm


def _v4_order(t: Tensor) -> Tensor:  # [N, Kp] by column -> [N, Kp] v4 byte order
    n, kp = t.shape
    return t.view(n, kp // GROUP, 4, QUARTER).transpose(2, 3).reshape(n, kp)


def _v4_columns(t: Tensor) -> Tensor:  # [N, Kp] v4 byte order -> [N, Kp] by column
    n, kp = t.shape
    return t.view(n, kp // GROUP, QUARTER, 4).transpose(2, 3).reshape(n, kp)


def _pack_codes(code: Tensor, layout: str) -> Tensor:  # [N, Kp] int codes -> [N, Kp / 2] uint8
    n, kp = code.shape
    if layout == "v4":  # half-word w of a group: quarters 0, 2 in byte 0, quarters 1, 3 in byte 1
        c = code.view(n, kp // GROUP, 4, QUARTER)
        pair = torch.stack([c[:, :, 0] | (c[:, :, 2] << 4), c[:, :, 1] | (c[:, :, 3] << 4)], -1)
        return pair.to(torch.uint8).reshape(n, kp // 2)  # [N, groups, 16, 2] bytes
    c = code.view(n, kp // GROUP, 2, HALF)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).to(torch.uint8).reshape(n, kp // 2)


def _unpack_codes(codes: Tensor, layout: str) -> Tensor:  # [N, Kp / 2] uint8 -> [N, Kp] int32
    n = codes.shape[0]
    c = codes.to(torch.int32)
    if layout == "v4":
        b = c.view(n, -1, QUARTER, 2)  # [N, groups, 16, 2]
        q = torch.stack([b[..., 0] & 0xF, b[..., 1] & 0xF, b[..., 0] >> 4, b[..., 1] >> 4], 2)
        return q.reshape(n, -1)  # [N, groups, 4, 16] -> by column
    c = c.view(n, -1, HALF)  # [N, groups, 32]
    return torch.stack([c & 0xF, c >> 4], dim=2).reshape(n, -1)


def _unpack_sm(sm: Tensor, layout: str) -> tuple[Tensor, Tensor]:  # -> sign, mantissa [N, Kp]
    if layout == "v4":
        sm = _v4_columns(sm)
    b = sm.to(torch.int32)
    if layout == "v2":
        return b >> 7, b & 0x7F
    return _partner(b & 1, layout), b >> 1


def encode(w: Tensor, layout: str = "v3") -> W12Tensor:
    """``w [N, K]`` bf16 (any values) -> W12, on ``w``'s device."""
    if w.dtype != torch.bfloat16 or w.dim() != 2:
        raise ValueError(f"W12 encodes 2-D bf16 tensors, got {w.dtype} with shape {tuple(w.shape)}")
    if layout not in LAYOUTS:
        raise ValueError(f"W12 layout must be one of {LAYOUTS}, got {layout!r}")
    n, k = w.shape
    if k >= MAX_K:
        raise ValueError(f"W12 supports K < {MAX_K}, got K = {k}")
    kp = padded(k)
    bits = _bits(w.contiguous())  # [N, K]
    exp = (bits >> 7) & 0xFF  # [N, K]
    sm = _pack_sm(F.pad(bits, (0, kp - k)), layout)  # [N, Kp]; padding: +0.0
    base = choose_top(exp) - WINDOW
    code = exp - base  # [N, K]
    esc = (code < 1) | (code > WINDOW)
    code = torch.where(esc, torch.full_like(code, ESCAPE), code)
    codes = _pack_codes(F.pad(code, (0, kp - k), value=ESCAPE), layout)  # [N, Kp / 2]

    rows, cols = esc.nonzero(as_tuple=True)  # row-major: sorted by (n, k)
    records = ((((rows % ESC_ROWS) * k + cols) << 8) | exp[rows, cols]).to(torch.int32)
    blocks = (n + ESC_ROWS - 1) // ESC_ROWS
    per_block = torch.bincount(rows // ESC_ROWS, minlength=blocks)  # [blocks]
    offsets = torch.zeros(blocks + 1, dtype=torch.int64, device=w.device)
    offsets[1:] = per_block.cumsum(0)
    tiles = tuple(
        int(torch.bincount(rows // (64 << i), minlength=1).max()) if rows.numel() else 0
        for i in range(3)
    )
    values = w[rows, cols].contiguous()  # [n_esc] bf16
    lists = tile_lists(rows, cols, values, n) if layout == "v4" else (None, None)
    return W12Tensor(
        sm=sm,
        codes=codes,
        base=base,
        esc_offsets=offsets.to(torch.int32),
        esc_records=records,
        esc_values=values,
        base_t=torch.tensor([base], dtype=torch.int32, device=w.device),
        k=k,
        layout=layout,
        tile_escapes=tiles,
        list_records=lists[0],
        list_values=lists[1],
    )


def decode(t: W12Tensor) -> Tensor:
    """W12 -> ``[N, K]`` bf16, bit-identical to what was encoded."""
    k = t.k
    sign, mant = _unpack_sm(t.sm, t.layout)  # [N, Kp]
    exp = t.base + _unpack_codes(t.codes, t.layout)  # [N, Kp]
    rec = t.esc_records.to(torch.int64)  # [n_esc]
    if rec.numel():
        block_of = torch.repeat_interleave(
            torch.arange(t.esc_offsets.numel() - 1, device=rec.device),
            (t.esc_offsets[1:] - t.esc_offsets[:-1]).to(torch.int64),
        )  # [n_esc]
        pos = rec >> 8
        rows = block_of * ESC_ROWS + pos // k
        cols = pos % k
        exp[rows, cols] = (rec & 0xFF).to(torch.int32)
    bits = (sign << 15) | (exp << 7) | mant  # [N, Kp] in [0, 65535]
    return bits[:, :k].to(torch.int16).view(torch.bfloat16)  # int32 -> int16 wraps bit 15 in


def exponent_stats(w: Tensor) -> dict[str, float]:
    """Exponent entropy (bits) and escape fractions of the best window and of a free top-15 set."""
    exp = (_bits(w.to(torch.bfloat16).contiguous()) >> 7) & 0xFF
    hist = torch.bincount(exp.reshape(-1), minlength=256).to(torch.float64).cpu()
    total = float(hist.sum())
    p = hist[hist > 0] / total
    top = choose_top(exp)
    window = float(hist[top - WINDOW + 1 : top + 1].sum())
    free = float(hist.sort(descending=True).values[:WINDOW].sum())
    return {
        "weights": total,
        "entropy_bits": float(-(p * p.log2()).sum()),
        "escape_frac_window": 1.0 - window / total,
        "escape_frac_top15": 1.0 - free / total,
    }
