"""Split-K flash-decoding attention over each sequence's exact length, for dense query blocks.

An AR step or a chain verify attends ``W`` new query rows per sequence (GQA group folded in:
``q [B, H_kv, G*W, D]``, row ``g*W + j``) to that sequence's cache. SDPA over the attention
bucket reads every key up to the bucket and, at one query block per KV head, runs only
``B * H_kv`` CTAs (8 of 132 SMs on Llama-3-8B at batch 1). Here:

* **Grid** ``(B, H_kv, splits)``; program ``(b, h, s)`` reads keys ``[s*L, (s+1)*L)`` clipped to
  the row's true end ``start[b] + W`` (device lengths, not the bucket); a program whose range
  starts past that end exits at once. Query row ``j`` of the block sees keys ``< start + j + 1``
  (causal) or ``< start + W`` (a non-causal block), never a key ``>= attn_len``.
* **Online softmax in fp32** over ``BLOCK_N`` keys at a time (``exp2`` with ``log2 e`` folded into
  the scale); ``q·k`` on the tensor cores with fp32 accumulation, ``p`` rounded to the value dtype
  for ``p·v`` (as flash attention does). fp32 models (and the CPU interpreter) take the fp32
  ``ieee`` dot throughout: no TF32.
* **Splits combined in one launch**: each split writes its unnormalized fp32 partial ``acc`` and
  its row statistics ``(m, l)``; an arrival counter per ``(b, h)`` (``acq_rel`` atomic, as the
  split-K of ``w12_gemm``) elects the last of the row's ``n_valid = cdiv(end, L)`` splits, which
  merges the partials **in a fixed order** (chunks of ``SC`` splits per load, rescaled online:
  deterministic whatever the arrival order), writes the output and re-arms the counter
  (graph-safe, no memset). A row with one valid split writes directly.
* **Output directly as** ``[B*W, H*D]``: row ``b*W + j``, column ``(h*G + g)*D + d`` — the
  layout ``Forward`` feeds to ``w_o``, so the transpose copy of ``DenseLayout.gather`` is gone.

Splits are fixed per launch shape (``split_plan``: from ``attn_len``, so per CUDA-graph key); the
lengths are read on the device, so one captured graph serves every length inside its bucket.

Numerics: the same softmax(q·kᵀ/√D)·v as SDPA over the layout's mask, in another summation order
(and ``p`` rounded once to bf16 in bf16 models): results differ by rounding only, which tests bound
against SDPA. The interpreter works around two Triton interpreter defects (a bf16 ``dot`` that
multiplies raw storage, a truncating fp32→bf16 cast) as ``w12_gemm`` does.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from specpilot.kernels import pdl
from specpilot.kernels.decode_attn_plan import (
    DEFAULT_CONFIG,
    DecodeAttnConfig,
    block_d,
    block_m,
    split_plan,
)
from specpilot.kernels.gemm_common import _f32_to_bf16

LOG2E = 1.4426950408889634
MERGE_ELEMS = 4096
"""fp32 partial elements the merging program loads at once (16 KB of registers per CTA)."""


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return 4


def counter_buffer(batch: int, kv_heads: int, device: torch.device) -> Tensor:  # [B*H_kv] int32
    """Arrival counters for launches of ``batch`` sequences (zeros; each launch re-arms them)."""
    return torch.zeros(batch * kv_heads, dtype=torch.int32, device=device)


@triton.jit
def _merge_splits(
    part_ptr, stat_ptr, pair, n_splits, n_valid,
    ROWS: tl.constexpr, RM: tl.constexpr, BLOCK_D: tl.constexpr, SC: tl.constexpr,
):  # fmt: skip
    """Merge the fp32 partials ``[RM, BD]`` of splits ``0..n_valid-1`` of ``(b, h)`` in a fixed
    order, ``SC`` splits per load (so the loads of a chunk are in flight together), rescaling
    online between chunks. Returns ``acc [RM, BD]``, ``l [RM]`` (padding rows: zeros)."""
    offs_r = tl.arange(0, RM)
    r_ok = offs_r < ROWS
    offs_d = tl.arange(0, BLOCK_D)
    base = pair * n_splits
    m_run = tl.full([RM], float("-inf"), dtype=tl.float32)
    l_run = tl.zeros([RM], dtype=tl.float32)
    acc = tl.zeros([RM, BLOCK_D], dtype=tl.float32)
    for c in range(0, n_valid, SC):
        s_c = c + tl.arange(0, SC)  # [SC]
        ok = (s_c < n_valid)[:, None] & r_ok[None, :]  # [SC, RM]
        st_offs = (2 * (base + s_c))[:, None] * RM + offs_r[None, :]
        m_c = tl.load(stat_ptr + st_offs, mask=ok, other=float("-inf"), cache_modifier=".cg")
        l_c = tl.load(stat_ptr + st_offs + RM, mask=ok, other=0.0, cache_modifier=".cg")
        a_offs = ((base + s_c)[:, None, None] * RM + offs_r[None, :, None]) * BLOCK_D
        a = tl.load(
            part_ptr + a_offs + offs_d[None, None, :],
            mask=ok[:, :, None],
            other=0.0,
            cache_modifier=".cg",
        )  # [SC, RM, BD]
        m_new = tl.maximum(m_run, tl.max(m_c, 0))  # [RM]
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_run - m_safe)
        w_c = tl.exp2(m_c - m_safe[None, :])  # [SC, RM] weight of each split's partial
        l_run = l_run * alpha + tl.sum(l_c * w_c, 0)
        acc = acc * alpha[:, None] + tl.sum(a * w_c[:, :, None], 0)
        m_run = m_new
    return acc, l_run


@triton.jit
def _out_offsets(rows, b, h, stride_out, W: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                 BLOCK_D: tl.constexpr):  # fmt: skip
    """Where block rows ``g*W + j`` go in ``out [B*W, H*D]``: row ``b*W + j``, columns from
    ``(h*G + g)*D``; and their mask (real rows, real columns)."""
    offs_d = tl.arange(0, BLOCK_D)
    o_offs = (b * W + rows % W)[:, None] * stride_out + ((h * G + rows // W) * D)[:, None]
    return o_offs + offs_d[None, :], (rows < G * W)[:, None] & (offs_d < D)[None, :]


@triton.jit
def _store_out(out_ptr, o, o_offs, o_mask, OUT_BF16: tl.constexpr, INTERPRET: tl.constexpr):
    if OUT_BF16:
        tl.store(out_ptr + o_offs, _f32_to_bf16(o, INTERPRET), mask=o_mask)
    else:
        tl.store(out_ptr + o_offs, o.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit(do_not_specialize=["attn_len", "split_len", "n_splits"])
def _decode_attn_kernel(
    q_ptr, k_ptr, v_ptr, start_ptr, out_ptr, part_ptr, stat_ptr, count_ptr,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_start, stride_out,
    attn_len, split_len, n_splits, qk_scale,
    W: tl.constexpr, G: tl.constexpr, D: tl.constexpr, CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    RM: tl.constexpr, SC: tl.constexpr,
    DOT_F32: tl.constexpr, OUT_BF16: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.trigger(PDL)  # the o GEMV after this kernel may start streaming (kernels/pdl.py)
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    start = tl.load(start_ptr + b * stride_start).to(tl.int32)
    end = tl.minimum(start + W, attn_len)  # keys the block's last row sees
    lo = s * split_len
    if lo < end:  # programs past the row's length do nothing
        hi = tl.minimum(lo + split_len, end)
        offs_m = tl.arange(0, BLOCK_M)  # [BM] block row g*W + j
        offs_d = tl.arange(0, BLOCK_D)  # [BD]
        m_ok = offs_m < G * W
        d_ok = offs_d < D
        if CAUSAL:  # [BM] row g*W + j sees keys < limit
            limit = tl.minimum(start + offs_m % W + 1, attn_len)
        else:
            limit = tl.zeros([BLOCK_M], dtype=tl.int32) + end
        q = tl.load(
            q_ptr + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :],
            mask=m_ok[:, None] & d_ok[None, :],
            other=0.0,
        )  # [BM, BD]
        if DOT_F32:
            q = q.to(tl.float32)
        k_base = k_ptr + b * stride_kb + h * stride_kh
        v_base = v_ptr + b * stride_vb + h * stride_vh
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for n0 in range(lo, hi, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)  # [BN]
            kv_mask = (offs_n < hi)[:, None] & d_ok[None, :]
            kv_offs = offs_n[:, None] * stride_ks + offs_d[None, :]
            k = tl.load(k_base + kv_offs, mask=kv_mask, other=0.0)  # [BN, BD]
            if DOT_F32:
                qk = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                qk = tl.dot(q, tl.trans(k))  # [BM, BN] fp32
            visible = (offs_n[None, :] < hi) & (offs_n[None, :] < limit[:, None])
            qk = tl.where(visible, qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(qk - m_safe[:, None])  # [BM, BN]
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                v_base + offs_n[:, None] * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0
            )
            if DOT_F32:
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        n_valid = tl.cdiv(end, split_len)
        if n_valid == 1:
            o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            o_offs, o_mask = _out_offsets(offs_m, b, h, stride_out, W, G, D, BLOCK_D)
            _store_out(out_ptr, o, o_offs, o_mask, OUT_BF16, INTERPRET)
        else:  # partials of the G*W real rows: [pairs * n_splits, RM, BD] and [.., 2, RM]
            pair = b * tl.num_programs(1) + h
            idx = pair * n_splits + s
            p_offs = (idx * RM + offs_m[:, None]) * BLOCK_D + offs_d[None, :]
            tl.store(part_ptr + p_offs, acc, mask=m_ok[:, None])
            tl.store(stat_ptr + (2 * idx) * RM + offs_m, m_i, mask=m_ok)
            tl.store(stat_ptr + (2 * idx + 1) * RM + offs_m, l_i, mask=m_ok)
            tl.debug_barrier()  # every thread's partial is stored before the release
            arrived = tl.atomic_add(count_ptr + pair, 1, sem="acq_rel")
            if arrived == n_valid - 1:  # the row's last split merges them all
                acc_t, l_t = _merge_splits(
                    part_ptr, stat_ptr, pair, n_splits, n_valid, G * W, RM, BLOCK_D, SC
                )
                o = acc_t / tl.where(l_t > 0, l_t, 1.0)[:, None]
                o_offs, o_mask = _out_offsets(tl.arange(0, RM), b, h, stride_out, W, G, D, BLOCK_D)
                _store_out(out_ptr, o, o_offs, o_mask, OUT_BF16, INTERPRET)
                tl.atomic_xchg(count_ptr + pair, 0)


def decode_attention(
    q: Tensor,  # [B, H_kv, G*W, D] (row g*W + j), unit stride along D
    k_cache: Tensor,  # [B, H_kv, S, D], unit stride along D
    v_cache: Tensor,
    start: Tensor,  # [B] int: the block's first slot per sequence (its committed length)
    width: int,  # W
    attn_len: int,  # keys at or past it are never read
    counters: Tensor,  # [>= B*H_kv] int32 zeros (counter_buffer), re-armed by every launch
    causal: bool = True,
    cfg: DecodeAttnConfig = DEFAULT_CONFIG,
) -> Tensor:  # [B*W, H*D] in q's dtype: row b*W + j, column (h*G + g)*D + d
    """softmax(q·kᵀ/√D)·v of each block row over keys ``< start + j + 1`` (causal) or
    ``< start + W`` (a block), clipped to ``attn_len``; one launch (see the module doc)."""
    b, hkv, rows, d = q.shape
    if rows % width:
        raise ValueError(f"q has {rows} block rows, not a multiple of the width {width}")
    if k_cache.shape[:2] != (b, hkv) or v_cache.shape != k_cache.shape or k_cache.shape[3] != d:
        raise ValueError(f"caches {tuple(k_cache.shape)} do not match q {tuple(q.shape)}")
    if attn_len > k_cache.shape[2]:
        raise ValueError(f"attention length {attn_len} beyond the cache ({k_cache.shape[2]})")
    if counters.numel() < b * hkv or counters.dtype != torch.int32:
        raise ValueError(f"need >= {b * hkv} int32 counters, got {counters.numel()}")
    if q.stride(3) != 1:
        q = q.contiguous()
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    g = rows // width
    cfg = cfg.for_rows(rows)
    bm, bd = block_m(rows), block_d(d)
    splits, split_len = split_plan(attn_len, b, hkv, rows, cfg, num_sms(q.device))
    out = torch.empty(b * width, hkv * rows // width * d, dtype=q.dtype, device=q.device)
    rm = max(2, triton.next_power_of_2(rows))  # partial rows kept per split
    sc = max(1, MERGE_ELEMS // (rm * bd))  # splits per merge load (per shape: one compile)
    if splits > 1:
        part = torch.empty(b * hkv * splits, rm, bd, dtype=torch.float32, device=q.device)
        stat = torch.empty(b * hkv * splits, 2, rm, dtype=torch.float32, device=q.device)
    else:  # never written: one split stores the output directly
        part = stat = counters.view(torch.float32)
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    _decode_attn_kernel[(b, hkv, splits)](
        q, k_cache, v_cache, start, out, part, stat, counters,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        start.stride(0), out.stride(0),
        attn_len, split_len, splits, LOG2E / math.sqrt(d),
        W=width, G=g, D=d, CAUSAL=causal, BLOCK_M=bm, BLOCK_N=cfg.block_n, BLOCK_D=bd,
        RM=rm, SC=sc,
        DOT_F32=interpret or q.dtype == torch.float32, OUT_BF16=q.dtype == torch.bfloat16,
        INTERPRET=interpret, PDL=pdl.supported(q.device), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


__all__ = [
    "DecodeAttnConfig",
    "counter_buffer",
    "decode_attention",
    "num_sms",
]
