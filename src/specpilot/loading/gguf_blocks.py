"""A GGUF's quantized matrices as loaded, unpacked into the two layouts of
``kernels/gguf_gemm.py`` (``q4``, ``q8``): codes and fp32 scales/mins, no weight rounded.

Q4_1 and Q4_K become ``q4``; Q8_0, Q5_K and Q6_K become ``q8`` (Q5_K/Q6_K codes take a byte
each). Scales are the fp32 values gguf's dequantization forms (``d·sc``, ``dmin·m`` negated),
which are exact products; Q/K rows of a llama GGUF are unpermuted as ``gguf_file`` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specpilot.loading.gguf_file import _open_reader, gguf_to_hf_name


@dataclass(frozen=True, slots=True)
class Packed:
    """One matrix ``[N, K]``: ``kind`` "q4" (codes [N, K/2] u8, sc/mn [N, K/32]) or "q8"
    (codes [N, K] i8, sc/mn [N, K/16], ``has_min``)."""

    kind: str
    codes: np.ndarray
    sc: np.ndarray
    mn: np.ndarray
    has_min: bool

    @property
    def rows(self) -> int:
        return int(self.codes.shape[0])

    def nbytes(self) -> int:
        return int(self.codes.nbytes + self.sc.nbytes + (self.mn.nbytes if self.has_min else 0))

    def take_rows(self, order: np.ndarray) -> Packed:
        return Packed(self.kind, self.codes[order], self.sc[order], self.mn[order], self.has_min)


def _f16(b: np.ndarray) -> np.ndarray:  # [..., 2] u8 -> [...] f32
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _pack4(codes: np.ndarray) -> np.ndarray:  # [N, K] codes 0..15 -> [N, K/2] u8
    c = codes.reshape(codes.shape[0], -1, 2, 16).astype(np.uint8)
    return (c[:, :, 0] | (c[:, :, 1] << np.uint8(4))).reshape(codes.shape[0], -1)


def _kscales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # [B, 12] -> sc, m [B, 8]
    s = s.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mi = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mi


def unpack(raw: np.ndarray, type_name: str, n: int, k: int) -> Packed:
    """``raw``: the tensor's bytes ``[N, bytes per row]`` u8 as the GGUF stores them."""
    if type_name == "Q4_1":
        blk = raw.reshape(n * k // 32, 20)
        sc, mn = _f16(blk[:, 0:2]).reshape(n, -1), _f16(blk[:, 2:4]).reshape(n, -1)
        return Packed("q4", np.ascontiguousarray(blk[:, 4:]).reshape(n, k // 2), sc, mn, True)
    if type_name == "Q8_0":
        blk = raw.reshape(n * k // 32, 34)
        sc = np.repeat(_f16(blk[:, 0:2]).reshape(n, -1), 2, axis=1)
        q = np.ascontiguousarray(blk[:, 2:]).view(np.int8).reshape(n, k)
        return Packed("q8", q, sc, np.zeros_like(sc), False)
    if type_name in ("Q4_K", "Q5_K"):
        size = 144 if type_name == "Q4_K" else 176
        blk = raw.reshape(n * k // 256, size)
        d, dmin = _f16(blk[:, 0:2])[:, None], _f16(blk[:, 2:4])[:, None]
        sci, mi = _kscales(blk[:, 4:16])
        sc = (d * sci.astype(np.float32)).reshape(n, -1)
        mn = -(dmin * mi.astype(np.float32)).reshape(n, -1)
        qs = blk[:, -128:].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        codes = (qs & np.uint8(0x0F)).reshape(-1, 8, 32)
        if type_name == "Q4_K":
            return Packed("q4", _pack4(codes.reshape(n, k)), sc, mn, True)
        qh = blk[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
        codes = codes | ((qh & np.uint8(1)) << np.uint8(4))
        q = codes.reshape(n, k).astype(np.int8)
        return Packed("q8", q, np.repeat(sc, 2, axis=1), np.repeat(mn, 2, axis=1), True)
    if type_name == "Q6_K":
        blk = raw.reshape(n * k // 256, 210)
        ql, qh = blk[:, :128], blk[:, 128:192]
        scales = np.ascontiguousarray(blk[:, 192:208]).view(np.int8).astype(np.float32)
        d = _f16(blk[:, 208:210])[:, None]
        sc = (d * scales).reshape(n, -1)
        ql = ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        ql = (ql & np.uint8(0x0F)).reshape(-1, 8, 32)
        qh = qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
        qh = (qh & np.uint8(0x03)).reshape(-1, 8, 32)
        q = ((ql | (qh << np.uint8(4))).astype(np.int8) - np.int8(32)).reshape(n, k)
        return Packed("q8", q, sc, np.zeros_like(sc), False)
    raise ValueError(f"block type {type_name} is not supported")


SUPPORTED = ("Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


def read_blocks(path: Path, arch: str, heads: int, kv_heads: int) -> dict[str, Packed]:
    """HF name -> :class:`Packed` for every quantized matrix of a supported block type."""
    reader = _open_reader(Path(path))
    out: dict[str, Packed] = {}
    for t in reader.tensors:
        name = t.tensor_type.name
        hf = gguf_to_hf_name(t.name)
        if name not in SUPPORTED or hf is None or len(t.shape) != 2:
            continue
        k, n = (int(v) for v in t.shape.tolist())
        p = unpack(np.asarray(t.data).reshape(n, -1), name, n, k)
        if arch == "llama" and (".attn_q." in t.name or ".attn_k." in t.name):
            h = heads if ".attn_q." in t.name else kv_heads
            d = n // h  # inverse of permute_for_gguf: interleaved pairs back to halves
            order = np.arange(n).reshape(h, d // 2, 2).transpose(0, 2, 1).reshape(-1)
            p = p.take_rows(order)
        out[hf] = p
    return out


__all__ = ["SUPPORTED", "Packed", "read_blocks", "unpack"]
