"""gguf-blocks: on the CPU, a GGUF target's linear layers and LM head compute from the file's own
quantized blocks (Q4_1, Q8_0, Q4_K, Q5_K, Q6_K), dequantized inside a numba GEMM.

Plug point ``linear_weights``: ``apply`` reads the blocks (``loading/gguf_blocks.py``), fuses
q/k/v and gate/up by rows as the network does, and installs :class:`BlockLinear` in every
``DecoderLayer.linear_fns`` and in ``Transformer.lm_head_fn``. The fp32 parameters stay (the
stock reference); the kernels read ~4.5-9 bits per weight instead of 32. It also sets
``Transformer.small_ops`` (:class:`NumbaSmallOps`): RMSNorm and RoPE in one numba call each,
and RoPE + K/V write + causal attention of a batch-1 eager block in one (knob ``attention``).

Lossless: every block type's ``d·q`` is an exact fp32 product, so the fused multiply-add rounds
once to exactly the weight gguf's dequantization gives (the stock path's fp32 weights, proven per
block type and on every tensor of the real file by tests/test_gguf_blocks.py); only the fp32
summation order differs (and RMSNorm's sum of squares, fp64 there; the attention's order and
``exp``, libm's there; RoPE and the K/V writes are bit for bit the torch path's), which the
near-tie tolerance covers and token forcing checks. Every row of an engine takes the same
kernels whatever the block's width (up to ``max_m``), so fp32 speculative output equals AR.
A machine without numba gets one line and keeps the fp32 path.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from specpilot.mechanisms.registry import Applicability, ConfigView, Knob, Mechanism

if TYPE_CHECKING:
    from specpilot.loading.gguf_blocks import Packed
    from specpilot.mechanisms.parts import EngineParts
    from specpilot.models.transformer import Transformer


def _f16_bits(a: np.ndarray) -> np.ndarray:
    """``a`` as f16 bits (uint16) where every value round-trips bit for bit (Q4_1 / Q8_0 scales
    are f16 in the file): half the bytes, widened exactly in the kernel; else ``a`` (fp32)."""
    h = a.astype(np.float16)
    return (
        h.view(np.uint16)
        if np.array_equal(h.astype(np.float32).view(np.uint32), a.view(np.uint32))
        else a
    )


MAX_M = 32
"""Rows above which a product runs on the fp32 weights (``F.linear``, the stock path's) instead:
the block kernels win up to a verify's widths (0.3-0.6x the fp32 path's time at M 4-32 on the
2-core CPU) and lose a prefill's (1.4-2.9x at M 64-256: the fp32 GEMM is compute-bound there
and the blocks' decode is not free)."""


class BlockLinear:
    """``fn(x [.., K], bias [N] | None) -> [.., N]`` over row segments of packed blocks; more
    than ``max_m`` rows go to ``weight`` (the layer's fp32 matrix, the same values) if given."""

    def __init__(
        self, parts: list[Packed], k: int, weight: Tensor | None = None, max_m: int = MAX_M
    ) -> None:
        from specpilot.kernels import gguf_gemm

        self.parts = parts
        self.k = k
        self.n = sum(p.rows for p in parts)
        self.weight, self.max_m = weight, max_m
        """Prefill-wide products on the fp32 weights (``[N, K]``), exactly the stock path's."""
        self._g = gguf_gemm
        self._args = [
            (p.codes, _f16_bits(p.sc), _f16_bits(p.mn) if p.has_min else None) for p in parts
        ]

    def nbytes(self) -> int:
        return sum(sum(a.nbytes for a in arrs if a is not None) for arrs in self._args)

    def __call__(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        # ~1 us a step on the host matters here: 121 calls a token, ~100 us of kernel each
        if self.weight is not None and x.numel() > self.max_m * self.k:
            return torch.nn.functional.linear(x, self.weight, bias)
        flat = x.dim() == 2 and x.is_contiguous()
        xa = (x if flat else x.reshape(-1, self.k).contiguous()).numpy()  # [M, K] fp32
        oa = np.empty((xa.shape[0], self.n), dtype=np.float32)  # [M, N]
        col = 0
        for codes, sc, mn in self._args:
            self._g.gemm(xa, codes, sc, mn, oa, col)
            col += codes.shape[0]
        out = torch.from_numpy(oa)
        if bias is not None:
            out += bias
        return out if flat else out.view(*x.shape[:-1], self.n)


def _plain(x: Tensor) -> bool:
    """A CPU tensor numba may read (``Tensor.numpy`` refuses one that records autograd)."""
    return not x.is_cuda and not x.requires_grad


class NumbaSmallOps:
    """The forward's RMSNorm, RoPE, and RoPE with the K/V write of a one-row eager step, on fp32
    CPU tensors in one numba call each (``kernels/gguf_small.py``; ``Transformer.small_ops``);
    None for anything else (the torch path then runs)."""

    def __init__(self, attend_rows: int = MAX_M) -> None:
        """``attend_rows``: blocks of up to this many rows take their attention here
        (``rope_write`` with ``attn_len``); wider ones, and all with 0, SDPA's."""
        from specpilot.kernels import gguf_small

        self._k = gguf_small
        self.attend_rows = attend_rows
        self._views: dict[int, tuple[Tensor, np.ndarray]] = {}
        """id of a norm weight -> (the weight, its numpy view): made once (~2 us each call)."""

    def _weight(self, w: Tensor) -> np.ndarray | None:
        hit = self._views.get(id(w))
        if hit is not None and hit[0] is w:
            return hit[1]
        if w.dtype != torch.float32 or not _plain(w):
            return None
        view = w.detach().numpy()
        if w.is_leaf and not w.is_inference():  # a parameter: it outlives this engine's calls
            self._views[id(w)] = (w, view)
        return view

    def rms_norm(self, x: Tensor, w: Tensor, eps: float) -> Tensor | None:  # [M, N]
        if x.dim() != 2 or x.dtype != torch.float32 or not _plain(x):
            return None
        wa = self._weight(w)
        if wa is None:
            return None
        out = np.empty(x.shape, dtype=np.float32)
        self._k.rms_norm(x.numpy(), wa, eps, out)
        return torch.from_numpy(out)

    def rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor | None:  # [M, H, D]
        if x.dtype != torch.float32 or cos.dtype != torch.float32 or not _plain(x):
            return None
        out = np.empty(x.shape, dtype=np.float32)
        self._k.rope(x.numpy(), cos.numpy(), sin.numpy(), out)
        return torch.from_numpy(out)

    def rope_write(
        self,
        qkv: Tensor,  # [M, (Hq + 2 Hkv) D]
        q_heads: int,
        cos: Tensor,  # [M, 1, D]
        sin: Tensor,
        k_cache: Tensor,  # [1, Hkv, S, D]
        v_cache: Tensor,
        start: int,
        attn_len: int = 0,
    ) -> Tensor | None:  # q [M, Hq, D] (attn_len 0), else the causal attention [M, Hq D]
        tensors = (qkv, cos, sin, k_cache, v_cache)
        if any(t.dtype != torch.float32 or not _plain(t) for t in tensors) or qkv.dim() != 2:
            return None
        m, hkv, d = qkv.shape[0], k_cache.shape[1], k_cache.shape[3]
        if k_cache.shape[0] != 1 or start + m > k_cache.shape[2] or attn_len > k_cache.shape[2]:
            return None
        if attn_len > 0 and m > self.attend_rows:  # SDPA's attention for the whole block
            return None
        args = (
            qkv.numpy(),
            q_heads,
            hkv,
            cos.numpy(),
            sin.numpy(),
            k_cache.numpy(),
            v_cache.numpy(),
            start,
        )
        if attn_len <= 0:
            q = np.empty((m, q_heads, d), dtype=np.float32)
            self._k.rope_qkv_write(*args, q)
            return torch.from_numpy(q)
        out = np.empty((m, q_heads * d), dtype=np.float32)
        self._k.rope_write_attend(*args, attn_len, out)
        return torch.from_numpy(out)


_FUSED = {
    "w_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "w_o": ("self_attn.o_proj",),
    "w_gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "w_down": ("mlp.down_proj",),
}


def _merge(parts: list[Packed]) -> list[Packed]:
    """Adjacent row segments of one layout joined into one (one kernel call for q/k/v)."""
    from specpilot.loading.gguf_blocks import Packed

    out: list[Packed] = []
    for p in parts:
        last = out[-1] if out else None
        if last is not None and last.kind == p.kind and last.has_min == p.has_min:
            out[-1] = Packed(
                p.kind,
                np.concatenate([last.codes, p.codes]),
                np.concatenate([last.sc, p.sc]),
                np.concatenate([last.mn, p.mn]),
                p.has_min,
            )
        else:
            out.append(p)
    return out


ATTEND_ROWS = 3
"""Widest verify block whose attention the numba kernel wins (2 cores, SmolLM2, 300 keys, us a
layer with RoPE and the K/V write, numba vs torch's SDPA: 1 row 25 vs 38, 2: 38 vs 45, 4: 65
vs 58, 9: 132 vs 88): every row of an engine must take one kernel (spec == AR bit for bit),
so ``attention`` "auto" picks by the engine's widest block."""


def attend_rows(choice: str, widest: int, max_m: int) -> int:
    """Rows up to which the numba attention runs: ``max_m`` ("numba", or "auto" when the
    engine's widest verify block ``widest`` is at most ``ATTEND_ROWS``), else 0 (SDPA)."""
    if choice == "numba" or (choice == "auto" and widest <= ATTEND_ROWS):
        return max_m
    return 0


def install(
    model: Transformer, path: str, threads: int = 0, max_m: int = MAX_M, attend: int = MAX_M
) -> dict[str, float]:
    """Install the block kernels on ``model`` (loaded from the GGUF at ``path``); products of
    more than ``max_m`` rows keep the fp32 path, blocks of more than ``attend`` rows SDPA."""
    import numba

    from specpilot.loading.gguf_blocks import read_blocks
    from specpilot.models.layer import DecoderLayer

    cfg = model.cfg
    blocks = read_blocks(Path(path), cfg.arch, cfg.num_heads, cfg.num_kv_heads)
    # once, at install; more than numba's pool (this machine's cores) runs as many as there are
    numba.set_num_threads(min(threads or torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))  # type: ignore[attr-defined]
    stored = weights = 0.0
    for i, layer in enumerate(model.layers):
        assert isinstance(layer, DecoderLayer)
        for name, hf in _FUSED.items():
            names = [f"model.layers.{i}.{h}.weight" for h in hf]
            if not all(n in blocks for n in names):
                continue
            w = getattr(layer, name)
            lin = BlockLinear(_merge([blocks[n] for n in names]), w.shape[1], w, max_m)
            layer.linear_fns[name] = lin
            stored += 8.0 * lin.nbytes()
            weights += float(getattr(layer, name).numel())
    head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    if head in blocks:
        lin = BlockLinear([blocks[head]], cfg.hidden_size, model.lm_head, max_m)
        model.lm_head_fn = lin
        stored += 8.0 * lin.nbytes()
        weights += float(model.lm_head.numel())
    model.small_ops = NumbaSmallOps(attend)
    return {"bits_per_weight": stored / max(weights, 1.0), "weights": weights}


def _apply(build: EngineParts, knobs: Mapping[str, Any]) -> None:
    from specpilot.loading.fetch import resolve_model

    if importlib.util.find_spec("numba") is None:
        build.notes.append(
            "gguf-blocks: numba is not installed; the fp32 path runs (pip install numba)."
        )
        print("gguf-blocks: numba is not installed; keeping the float32 path.")
        return
    path = resolve_model(build.target.spec)
    if not (path.is_file() and path.suffix.lower() == ".gguf"):
        build.notes.append("gguf-blocks: the target is no GGUF file; nothing installed.")
        return
    max_m = int(knobs["max_m"])
    widest = 1 if build.drafter is None else build.drafter.k + 1
    attend = attend_rows(str(knobs["attention"]), widest, max_m)
    stats = install(build.target.model, str(path), int(knobs["threads"]), max_m, attend)
    build.notes.append(f"gguf-blocks: {stats['bits_per_weight']:.2f} bits/weight")


NO_BLOCKS = "the target is no GGUF file: there are no blocks to compute from"
NO_NUMBA = "numba is not installed (pip install numba)"


def _screen(config: ConfigView) -> str | None:
    """Searched wherever it can install: a GGUF target and numba (it measured 1.33x plain fp32
    AR on the 2-core CPU, 1.27x at 06e9d10: docs/figures/issue-27.md); a trial elsewhere would install nothing."""
    from specpilot.errors import SpecPilotError
    from specpilot.loading.fetch import check_model_spec

    try:
        path = check_model_spec(config.deployment.target)
    except SpecPilotError:
        return NO_BLOCKS
    if path.suffix.lower() != ".gguf":
        return NO_BLOCKS
    return NO_NUMBA if importlib.util.find_spec("numba") is None else None


MECHANISM = Mechanism(
    name="gguf-blocks",
    component="mlp",
    plug_point="linear_weights",
    lossless=(
        "The kernels multiply the GGUF's blocks dequantized in registers with one fused "
        "multiply-add over an exact product, bit-identical to gguf's dequantization (the stock "
        "fp32 weights; tested per block type and on every tensor of the real file); only fp32 "
        "summation order differs (and the numba attention's exp: ulps, token-forced); every row "
        "takes the same kernels at every width. Argument in mechanisms/gguf_blocks.py."
    ),
    apply=_apply,
    knobs=(
        Knob(
            "threads",
            0,
            low=0,
            high=256,
            doc="numba threads (0: torch's count; capped at the cores)",
        ),
        Knob(
            "max_m",
            MAX_M,
            choices=(16, 32, 64),
            doc="widest product on the blocks; wider (a prefill) runs on the fp32 weights",
        ),
        Knob(
            "attention",
            "auto",
            choices=("auto", "numba", "sdpa"),
            doc="attention of eager batch-1 blocks: numba (with RoPE and the K/V write, one "
            "call) or SDPA; auto: numba when the widest verify block is at most 3 rows",
        ),
    ),
    applies=Applicability(devices=("cpu",), dtypes=("fp32", "float32")),
    joint_k=True,
    summary="compute linear layers and the LM head from the GGUF's own Q4/Q8/K blocks (numba)",
    screen=_screen,
)

__all__ = ["MECHANISM", "BlockLinear", "NumbaSmallOps", "install"]
