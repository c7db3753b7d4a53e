"""Fused Triton kernels of the graph-safe exact-argmax certificate: few launches per call.

The torch form of the certificate (``mechanisms/exact_argmax_graph.certify_fixed``, the head's
``fused=False``) runs ~140 small ops per call, which inside a CUDA graph cost about what the INT8
head saves. These kernels compute the same quantities in four launches around the INT8 GEMM, an
``amax`` and a ``topk``:

* :func:`row_terms_fused` — one program per row: ``x_scale = 2^e`` (``max|x| = m·2^e``,
  m ∈ [0.5, 1), from the fp32 bits), ``xq = bf16(x / x_scale)``, and in float64 the norms
  ``||x||``, ``||x_scale·xq||``, ``||x − x_scale·xq||`` padded by ``1 + 2^-40`` and the terms
  ``a, b, tau`` rounded *up* to float32 (round to nearest, then one ulp up when below: exactly
  ``cheap_head.round_up_f32``). Rows with a subnormal or huge ``max|x|``, or with an element
  that is or scales to below 2^-120, are marked not ok (the torch form would go on; here they
  abstain: no subnormal reaches a kernel that may flush it). Equals ``cheap_head.row_terms``
  otherwise, up to float64 summation order in the norms (covered by the pad).
* :func:`block_bounds_fused` — one program per (vocabulary block, row): the bound epilogue over
  the INT8 GEMM's fp32 output (``c = scaled · x_scale``, ``D``, block maxima of ``c ± D``; NaN or
  ±inf in ``c`` gives ``upper = +inf``), the same arithmetic as ``argmax_bound.bounds_from_sums``.
* ``refine_logits`` (``kernels/argmax_certify.py``) — float64 logits of the C chosen blocks.
* :func:`finish_fused` — one program for the call: per row the step-2 check on the (C+1)-th
  upper bound, the refine intervals (``exact_argmax_cert.refine_intervals``) and the pick
  (``ids [R]``), then the call's abstain flag (rows outside the call's ``valid`` mask do not
  count) and the head's counters.

All run under ``TRITON_INTERPRET=1`` at small shapes (tests compare them with the torch form).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from specpilot.kernels.argmax_bound import PAD
from specpilot.kernels.cheap_head import TAU_PAD, UNDERFLOW_PER_OP, CheapHead, RowTerms
from specpilot.kernels.gemm_common import _f32_to_bf16


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _up(v):
    """float64 ≥ 0 → the smallest float32 ≥ v (round to nearest, then one ulp up if below)."""
    f = v.to(tl.float32)
    bumped = (f.to(tl.int32, bitcast=True) + 1).to(tl.float32, bitcast=True)
    return tl.where(f.to(tl.float64) < v, bumped, f)


@triton.jit
def terms_kernel(
    x_ptr,  # [R, H] model dtype
    xq_ptr,  # [R, H] bf16 out
    xs_ptr,  # [R] f32 out: x_scale
    a_ptr,  # [R] f32 out
    b_ptr,  # [R] f32 out
    tau_ptr,  # [R] f32 out
    xn_ptr,  # [R] f64 out: ||x|| padded
    ok_ptr,  # [R] bool out
    k_ptr,  # [K_LEN] f64 constants (:func:`fused_constants`)
    stride_x,
    H: tl.constexpr,
    BLOCK_H: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    r = tl.program_id(0)
    eps_stock = tl.load(k_ptr + 0)
    tau_fixed = tl.load(k_ptr + 1)  # tau_stock + TAU_PAD
    cheap_tau_coef = tl.load(k_ptr + 2)  # (H + 2)·UNDERFLOW_PER_OP·scale_max
    grow = tl.load(k_ptr + 3)  # 1 + 2u_out
    overflow_norm = tl.load(k_ptr + 4)  # max_logit / 4 / omega_max
    pad = tl.load(k_ptr + 5)  # 1 + 2^-40
    ks = tl.arange(0, BLOCK_H)
    kmask = ks < H
    x = tl.load(x_ptr + r * stride_x + ks, mask=kmask, other=0.0).to(tl.float32)
    finite = tl.sum(tl.where(kmask & ((x != x) | (tl.abs(x) == float("inf"))), 1, 0)) == 0
    amax = tl.max(tl.where(kmask & (x == x), tl.abs(x), 0.0))
    expo = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 126  # amax = m·2^expo
    in_range = (amax > 0) & (expo >= -125) & (expo <= 126)
    expo = tl.where(in_range, expo, 0)
    x_scale = ((expo + 127) << 23).to(tl.float32, bitcast=True)  # 2^expo, exact
    inv_scale = ((127 - expo) << 23).to(tl.float32, bitcast=True)  # 2^-expo, exact
    xq = _f32_to_bf16(x * inv_scale, INTERPRET)  # exact scaling, then rounded
    tl.store(xq_ptr + r * H + ks, xq, mask=kmask)
    xd = x.to(tl.float64)
    xs = xq.to(tl.float32).to(tl.float64) * x_scale.to(tl.float64)  # exact
    x_norm = tl.sqrt(tl.sum(xd * xd)) * pad
    a = tl.sqrt(tl.sum(xs * xs)) * pad
    d = xd - xs
    b = tl.sqrt(tl.sum(d * d)) * pad + eps_stock * x_norm
    tau = 2.0 * cheap_tau_coef * x_scale.to(tl.float64) + tau_fixed
    # No subnormal anywhere (a GPU may flush it, in x, in x·2^-e or in the cheap products):
    sub = kmask & (x != 0) & ((tl.abs(x) < 2.0**-126) | (tl.abs(x * inv_scale) < 2.0**-120))
    normal = tl.sum(tl.where(sub, 1, 0)) == 0
    ok = finite & normal & in_range & (x_norm == x_norm) & (x_norm < overflow_norm)
    tl.store(xs_ptr + r, x_scale)
    tl.store(a_ptr + r, _up(a * grow))
    tl.store(b_ptr + r, _up(b * grow))
    tl.store(tau_ptr + r, _up(tau * grow))
    tl.store(xn_ptr + r, x_norm)
    tl.store(ok_ptr + r, ok)


@triton.jit
def bounds_kernel(
    c_ptr,  # [R, V] f32: fl(cheap sum)·scale (the INT8 GEMM's output)
    beta_ptr,  # [V] f32
    omega_ptr,  # [V] f32
    xs_ptr,  # [R] f32
    a_ptr,
    b_ptr,
    tau_ptr,
    up_ptr,  # [R, nb] f32 out
    lo_ptr,  # [R, nb] f32 out
    V,
    nb,
    kc,
    pad,
    BLOCK_V: tl.constexpr,
):
    blk = tl.program_id(0)
    r = tl.program_id(1)
    vs = blk * BLOCK_V + tl.arange(0, BLOCK_V)
    vmask = vs < V
    c = tl.load(c_ptr + r * V + vs, mask=vmask, other=0.0) * tl.load(xs_ptr + r)
    beta = tl.load(beta_ptr + vs, mask=vmask, other=0.0)
    omega = tl.load(omega_ptr + vs, mask=vmask, other=0.0)
    d = tl.load(a_ptr + r) * beta + tl.load(b_ptr + r) * omega  # ≤ 3 roundings
    d = (d + kc * tl.abs(c) + tl.load(tau_ptr + r)) * pad
    bad = (c != c) | (tl.abs(c) == float("inf"))
    up = tl.where(bad, float("inf"), c + d)
    lo = tl.where(bad, float("nan"), c - d)
    up = tl.where(vmask, up, float("-inf"))
    lo = tl.where(vmask, lo, float("-inf"))
    tl.store(up_ptr + r * nb + blk, tl.max(up, axis=0))
    lo_max = tl.max(lo, axis=0)
    lo_bad = tl.sum(tl.where(vmask & bad, 1, 0), axis=0) > 0
    tl.store(lo_ptr + r * nb + blk, tl.where(lo_bad, float("nan"), lo_max))


@triton.jit
def finish_kernel(
    s_ptr,  # [R, N] f64 refine logits (N = C·BLOCK)
    top_ptr,  # [R, CT] f32 top upper bounds, sorted (CT = C or C + 1)
    topi_ptr,  # [R, CT] int64 their blocks
    best_ptr,  # [R] f32 M_r
    omega_ptr,  # [V] f32
    xn_ptr,  # [R] f64
    rok_ptr,  # [R] bool: the row terms' ok
    valid_ptr,  # [R] bool: rows the flag speaks for (read only with HAS_VALID)
    ids_ptr,  # [R] int64 out
    flag_ptr,  # [1] int64 out: 1 when some valid row is not certified
    counts_ptr,  # [4] int64 in/out: calls, abstained calls, rows, spared calls
    V,
    C,
    CT,
    k_ptr,  # [K_LEN] f64 constants
    R_ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    N_POW: tl.constexpr,
    HAS_VALID: tl.constexpr,
):
    """One program for the call: every row's pick and ok, then the call's flag and counters."""
    j = tl.arange(0, N_POW)
    slot = j // BLOCK  # candidate block of each refined row
    jmask = j < C * BLOCK
    coef_norm = tl.load(k_ptr + 6)  # (1 + 2u)(1 + 2^-30)(eps + 2H·2^-53)
    coef_abs = tl.load(k_ptr + 7)  # (1 + 2u)(1 + 2^-30)·u_out
    coef_tau = tl.load(k_ptr + 8)  # (1 + 2u)(1 + 2^-30)·tau_out
    all_ok = tl.full((), 1, tl.int32)  # every row certified
    valid_ok = tl.full((), 1, tl.int32)  # every valid row certified
    for r in range(R_ROWS):
        best = tl.load(best_ptr + r)
        top = tl.load(top_ptr + r * CT + slot, mask=jmask, other=float("-inf"))
        blk = tl.load(topi_ptr + r * CT + slot, mask=jmask, other=0)
        v = blk * BLOCK + (j % BLOCK)
        cand = jmask & (v < V) & (top >= best)
        vv = tl.where(cand, v, 0)
        s = tl.load(s_ptr + r * C * BLOCK + j, mask=jmask, other=0.0)
        omega = tl.load(omega_ptr + vv, mask=cand, other=0.0).to(tl.float64)
        err = coef_norm * tl.load(xn_ptr + r) * omega + coef_abs * tl.abs(s) + coef_tau
        err = err + 2.0**-50 * tl.abs(s)
        lo = tl.where(cand, s - err, float("-inf"))
        hi = tl.where(cand, s + err, float("-inf"))
        pick_lo = tl.max(lo, axis=0)
        first = tl.min(tl.where(lo == pick_lo, j, N_POW), axis=0)  # lowest index, like argmax
        others = tl.max(tl.where(j == first, float("-inf"), hi), axis=0)
        first_top = tl.load(top_ptr + r * CT)
        ok = (tl.load(rok_ptr + r) != 0) & (first_top < float("inf")) & (best == best)
        ok = ok & (best > float("-inf")) & (pick_lo > float("-inf")) & (pick_lo > others)
        if CT > C:  # every block left out is below M_r (step 2)
            ok = ok & (tl.load(top_ptr + r * CT + C) < best)
        tl.store(ids_ptr + r, tl.sum(tl.where(j == first, vv, 0), axis=0))
        all_ok = all_ok * ok.to(tl.int32)
        if HAS_VALID:
            ok = ok | (tl.load(valid_ptr + r) == 0)
        valid_ok = valid_ok * ok.to(tl.int32)
    flag = (1 - valid_ok).to(tl.int64)
    tl.store(flag_ptr, flag)
    tl.store(counts_ptr, tl.load(counts_ptr) + 1)
    tl.store(counts_ptr + 1, tl.load(counts_ptr + 1) + flag)
    tl.store(counts_ptr + 2, tl.load(counts_ptr + 2) + R_ROWS)
    tl.store(counts_ptr + 3, tl.load(counts_ptr + 3) + (valid_ok - all_ok).to(tl.int64))


K_LEN = 9


def fused_constants(
    head: CheapHead,
    eps_stock: float,
    tau_stock: float,
    max_logit: float,
    grow: float,
    refine: tuple[float, float, float],  # exact_argmax_cert.refine_coefficients
    device: torch.device,
) -> Tensor:  # [K_LEN] float64
    """The float64 constants of the kernels, as a device tensor (Triton would pass Python floats
    as float32, rounded to nearest: below the value half the time). Build once, outside graphs."""
    cheap_tau = (head.hidden + 2) * UNDERFLOW_PER_OP * head.scale_max
    vals = [
        eps_stock, tau_stock + TAU_PAD, cheap_tau, grow,
        max_logit / 4 / max(head.omega_max, 2.0**-126), 1 + 2.0**-40, *refine,
    ]  # fmt: skip
    return torch.tensor(vals, dtype=torch.float64, device=device)


def row_terms_fused(
    x: Tensor,  # [R, H]
    head: CheapHead,
    consts: Tensor,  # from fused_constants
) -> RowTerms:
    """:func:`cheap_head.row_terms` in one launch (module docstring)."""
    r, h = x.shape
    dev = x.device
    if x.stride(1) != 1 or head.fmt != "int8":
        raise ValueError("fused row terms: want an int8 head and unit stride along the hidden size")
    f32 = torch.float32
    xq = torch.empty(r, h, dtype=torch.bfloat16, device=dev)
    xs, a, b, tau = (torch.empty(r, dtype=f32, device=dev) for _ in range(4))
    x_norm = torch.empty(r, dtype=torch.float64, device=dev)
    ok = torch.empty(r, dtype=torch.bool, device=dev)
    terms_kernel[(r,)](
        x, xq, xs, a, b, tau, x_norm, ok, consts, x.stride(0),
        H=h, BLOCK_H=1 << (h - 1).bit_length(), INTERPRET=_interpret(), num_warps=4,
    )  # fmt: skip
    return RowTerms(xq=xq, x_scale=xs, a=a, b=b, tau=tau, x_norm=x_norm, ok=ok)


def block_bounds_fused(
    head: CheapHead, terms: RowTerms, kc: float, scaled: Tensor
) -> tuple[Tensor, Tensor]:
    """``(upper, lower) [R, nb]`` from the INT8 GEMM's fp32 output ``scaled [R, V]``."""
    r, v = scaled.shape
    nb = head.num_blocks
    upper = torch.empty(r, nb, dtype=torch.float32, device=scaled.device)
    lower = torch.empty(r, nb, dtype=torch.float32, device=scaled.device)
    bounds_kernel[(nb, r)](
        scaled, head.beta, head.omega, terms.x_scale, terms.a, terms.b, terms.tau, upper, lower,
        v, nb, kc, PAD, BLOCK_V=head.block, num_warps=2,
    )  # fmt: skip
    return upper, lower


def finish_fused(
    s_hat: Tensor,  # [R, C·block] float64
    top_values: Tensor,  # [R, CT] float32 sorted
    top_blocks: Tensor,  # [R, CT] int64
    best_lower: Tensor,  # [R] float32
    head: CheapHead,
    terms: RowTerms,
    consts: Tensor,  # from fused_constants
    candidates: int,
    flag: Tensor,  # [1] int64 out: the abstain flag
    counts: Tensor,  # [4] int64: calls, abstained calls, rows, spared calls (added to)
    valid: Tensor | None = None,  # [R] bool: rows the flag speaks for (None: all)
) -> Tensor:  # ids [R] int64 (meaningful for valid rows when the flag is 0; always in [0, V))
    """The certificate's last step, one program for the call (module docstring)."""
    r, n = s_hat.shape
    ids = torch.empty(r, dtype=torch.int64, device=s_hat.device)
    if not (top_values.is_contiguous() and top_blocks.is_contiguous()):
        raise ValueError("finish: want contiguous top-k values and blocks")
    if valid is not None and (valid.shape != (r,) or valid.dtype != torch.bool):
        raise ValueError(f"finish: want a [{r}] bool valid mask")
    finish_kernel[(1,)](
        s_hat, top_values, top_blocks, best_lower, head.omega, terms.x_norm, terms.ok,
        terms.ok if valid is None else valid.contiguous(), ids, flag, counts, head.vocab,
        candidates, top_values.shape[1], consts, R_ROWS=r, BLOCK=head.block,
        N_POW=1 << (n - 1).bit_length(), HAS_VALID=valid is not None, num_warps=4,
    )  # fmt: skip
    return ids


__all__ = ["K_LEN", "block_bounds_fused", "finish_fused", "fused_constants", "row_terms_fused"]
