"""W12: a lossless ~12-bit storage format for bf16 weight matrices, laid out for a GEMM kernel.

A bf16 is ``sign(1) | exponent(8) | mantissa(7)``. Trained weights use few exponents (all-MiniLM-L6-v2
cast to bf16: ≈2.66 bits of exponent entropy), so W12 keeps sign and mantissa verbatim and replaces
the exponent by a 4-bit code:

``sm``       ``[N, K]`` uint8 — ``sign << 7 | mantissa``, for every weight (escapes included).
``codes``    ``[N, G * 32]`` uint8 for ``G = ceil(K / 64)`` column groups of 64 — in group ``g``,
             byte ``j`` holds the exponent code of column ``64g + j`` in its low nibble and of column
             ``64g + 32 + j`` in its high nibble (columns past K, in the last group, get code 0).
             Code ``c >= 1`` means exponent ``base + c``; code 0 is the **escape**.
``base``     one int per tensor: codes 1..15 cover the window ``[base + 1, base + 15]``
             (``0 <= base <= 240``) that holds the most weights; the encoder picks it from the
             tensor's exponent histogram. An escape decodes to the placeholder exponent ``base``.
``esc_offsets`` ``[ceil(N/16) + 1]`` int32 — CSR offsets of the escapes of each block of 16 rows.
``esc_records`` ``[n_esc]`` int32 — one per escaped weight, ``((n % 16) * K + k) << 8 | exponent``,
             in row-major order (so each 16-row block's records are contiguous and sorted by k).

Why this layout (GPU first):
* **Fixed-size fields, no entropy coding in the hot path.** Every weight's byte and nibble sit at
  an address computed from (n, k) alone, so a kernel tile loads with coalesced vector loads and
  decodes in registers, with no dependence on any other tile. 8 + 4 = 12 bits per weight.
* **Nibbles paired across half-groups, not neighbours.** A byte holds the codes of columns ``j``
  and ``j + 32`` of its 64-column group, so a ``[BLOCK_N, 32]`` tile of code bytes lines up
  element for element with the two ``[BLOCK_N, 32]`` tiles of ``sm`` it decodes (low nibbles with
  the first half, high nibbles with the second): the kernel needs no interleave or shuffle, and
  four weights decode from one 32-bit word of ``sm`` and one of codes with byte permutes
  (``prmt``), ~2.5 integer instructions per weight (``kernels/w12_gemm.py``).
* **A window of consecutive exponents instead of a 16-entry codebook.** ``exponent = base + code``
  is one add (two weights per 32-bit add), where a free codebook needs a table lookup per weight. Weight exponent
  histograms are unimodal (a geometric tail below the largest magnitudes), so the best window of
  15 covers as much as the 15 most frequent exponents: on all-MiniLM-L6-v2 (bf16) the escapes are
  0.0245% of weights with the window against 0.0228% with a free top-15 set.
* **Escapes out of line, per 16-row block, never serializing the kernel.** The kernel decodes an
  escape as the placeholder (its own sign and mantissa, exponent ``base``: below every window
  exponent) inside the dense tile, subtracts the placeholder's product and adds the escaped weights back
  once per program, after its K loop, as one more small ``tl.dot`` of gathered activation columns
  with a ``[32, BLOCK_N]`` tile that holds the escaped values (see ``kernels/w12_gemm.py``). A
  program reads only its own row blocks' records (one contiguous CSR range per 16 rows); nothing is
  prefix-summed or searched at run time. Records hold only the position and the exponent (sign and
  mantissa are already in ``sm``); 28 bits are used (K < 2**19).
* **Metadata is tiny**: 32 bits per escape plus 32 bits per 16 rows, plus ``base``. At 0.025%
  escapes that is ≈ 0.008 + 32 / (16·K) bits per weight: ≈ 12.01 bits/weight at K = 4096.

``decode`` reverses ``encode`` bit for bit for *any* bf16 input (NaN payloads, ±Inf, denormals,
-0.0): the sign and mantissa bits are stored verbatim, and every exponent is either the window
value named by its code or, for an escape, stored verbatim in its record.
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


@dataclass(frozen=True, slots=True)
class W12Tensor:
    """One ``[N, K]`` bf16 matrix in W12 (see the module docstring for the layout)."""

    sm: Tensor  # [N, K] uint8: sign << 7 | mantissa
    codes: Tensor  # [N, ceil(K/64) * 32] uint8: codes of columns j, j + 32 of each 64-group
    base: int  # placeholder exponent; code c >= 1 names exponent base + c
    esc_offsets: Tensor  # [ceil(N/16) + 1] int32: CSR offsets per 16-row block
    esc_records: Tensor  # [n_esc] int32: ((n % 16) * K + k) << 8 | exponent
    base_t: Tensor  # [1] int32: ``base`` on the device, for kernels that must load it

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.sm.shape[0]), int(self.sm.shape[1])

    @property
    def device(self) -> torch.device:
        return self.sm.device

    @property
    def num_escapes(self) -> int:
        return int(self.esc_records.numel())

    def nbytes(self) -> int:
        """Bytes stored, all metadata included."""
        parts = (self.sm, self.codes, self.esc_offsets, self.esc_records, self.base_t)
        return sum(t.numel() * t.element_size() for t in parts)

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
            base_t=self.base_t.to(device),
        )


def _bits(w: Tensor) -> Tensor:  # [N, K] bf16 -> [N, K] int32 in [0, 65535]
    return w.view(torch.int16).to(torch.int32) & 0xFFFF


def choose_top(exponents: Tensor) -> int:
    """The top of the window ``[top - 14, top]`` that holds the most of ``exponents`` (lowest on
    ties); the format's ``base`` is ``top - 15``."""
    hist = torch.bincount(exponents.reshape(-1), minlength=256).to(torch.int64).cpu()  # [256]
    csum = torch.cat([torch.zeros(1, dtype=torch.int64), hist.cumsum(0)])  # [257]
    tops = torch.arange(MIN_TOP, 256)
    covered = csum[tops + 1] - csum[tops + 1 - WINDOW]  # [241]
    return int(tops[int(torch.argmax(covered))])


def encode(w: Tensor) -> W12Tensor:
    """``w [N, K]`` bf16 (any values) -> W12, on ``w``'s device."""
    if w.dtype != torch.bfloat16 or w.dim() != 2:
        raise ValueError(f"W12 encodes 2-D bf16 tensors, got {w.dtype} with shape {tuple(w.shape)}")
    n, k = w.shape
    if k >= MAX_K:
        raise ValueError(f"W12 supports K < {MAX_K}, got K = {k}")
    bits = _bits(w.contiguous())  # [N, K]
    exp = (bits >> 7) & 0xFF  # [N, K]
    sm = (((bits >> 8) & 0x80) | (bits & 0x7F)).to(torch.uint8)  # [N, K]
    base = choose_top(exp) - WINDOW
    code = exp - base  # [N, K]
    esc = (code < 1) | (code > WINDOW)
    code = torch.where(esc, torch.full_like(code, ESCAPE), code)
    groups = (k + GROUP - 1) // GROUP
    code = F.pad(code, (0, groups * GROUP - k), value=ESCAPE).view(n, groups, 2, HALF)
    codes = (code[:, :, 0] | (code[:, :, 1] << 4)).to(torch.uint8).reshape(n, groups * HALF)

    rows, cols = esc.nonzero(as_tuple=True)  # row-major: sorted by (n, k)
    records = ((((rows % ESC_ROWS) * k + cols) << 8) | exp[rows, cols]).to(torch.int32)
    blocks = (n + ESC_ROWS - 1) // ESC_ROWS
    per_block = torch.bincount(rows // ESC_ROWS, minlength=blocks)  # [blocks]
    offsets = torch.zeros(blocks + 1, dtype=torch.int64, device=w.device)
    offsets[1:] = per_block.cumsum(0)
    return W12Tensor(
        sm=sm,
        codes=codes,
        base=base,
        esc_offsets=offsets.to(torch.int32),
        esc_records=records,
        base_t=torch.tensor([base], dtype=torch.int32, device=w.device),
    )


def decode(t: W12Tensor) -> Tensor:
    """W12 -> ``[N, K]`` bf16, bit-identical to what was encoded."""
    n, k = t.shape
    sm = t.sm.to(torch.int32)  # [N, K]
    c = t.codes.to(torch.int32).view(n, -1, HALF)  # [N, groups, 32]
    code = torch.stack([c & 0xF, c >> 4], dim=2).reshape(n, -1)[:, :k]  # [N, K]
    exp = t.base + code
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
    bits = ((sm & 0x80) << 8) | (exp << 7) | (sm & 0x7F)  # [N, K] in [0, 65535]
    return bits.to(torch.int16).view(torch.bfloat16)  # int32 -> int16 wraps bit 15 in


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
