"""The graph-safe certified exact-argmax head: fixed shapes, no host sync, an abstain flag.

It certifies by the proof of ``mechanisms/exact_argmax.py`` (steps 1–5) with fixed shapes:

1. **Cheap pass** — one INT8 GEMV/GEMM over the head with fp32 output
   (``kernels/argmax_certify.int8_block_bounds``), the per-element bound and the block maxima
   ``upper, lower [R, nb]``; ``M_r = max_b lower``.
2. **Top-C blocks** — per row the ``C`` blocks with the largest upper bounds (``topk``). The row
   is certifiable only if the (C+1)-th largest upper bound is ``< M_r``: then every candidate
   block of step 3 (``upper ≥ M_r``) is among the C, so every maximiser of the stock logits is.
3. **Refine** — ``x · w_v`` in float64 for those ``C·block`` vocabulary rows per row
   (``refine_logits``), the candidates' intervals of step 5, and the pick: certified when its
   lower end is above every other candidate's upper end.
4. **Abstain** — ``abstain_flag [1]`` (int64, on the device) is 1 when any *valid* row of the
   call is not certified (``valid [B, R]`` bool, default every row); the returned ids are then
   meaningless. The ids of rows outside ``valid`` are meaningless whatever the flag (but always
   in ``[0, V)``): the engine's verify passes its layout's live rows
   (``Layout.live_rows``), so that idle batch rows and bucket padding, whose ids no accept
   commits (``Engine.forward_block``), cannot make the verify abstain. Nothing here syncs with
   the host.

:meth:`GraphArgmaxHead.abstaining` is that computation, for callers that honour the flag: the
engine's verify forward (``Forward.argmax(..., may_abstain=True)``), whose accept commits nothing
while the flag is set and whose host then redoes the verify with the stock head
(``engine/engine.py``, the abstain protocol). Calling the head itself (prefill, probes, cost
measurements) reads the flag on the host and answers with the stock head when it is set, so every
caller that does not know of the flag still gets the stock argmax.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specpilot.kernels import triton_usable
from specpilot.kernels.argmax_bound import block_bounds_ref
from specpilot.kernels.argmax_certify import int8_block_bounds, refine_logits, refine_logits_ref
from specpilot.kernels.cheap_head import CheapHead, RowTerms, prepare_cheap_head
from specpilot.mechanisms.exact_argmax_cert import (
    BoundsFn,
    StockRounding,
    bound_rows,
    certified_pick,
    cheap_format,
    kc_coefficient,
    refine_coefficients,
    refine_intervals,
    stock_argmax,
    stock_rounding,
)
from specpilot.models.transformer import Transformer


def certify_fixed(
    x: Tensor,  # [N, H] final-normed hidden rows
    head: CheapHead,
    lm_head: Tensor,  # [V, H] stock weights
    stock: StockRounding,
    candidates: int,
    counters: Tensor | None,  # split-K buffer of the INT8 GEMM; None: the torch bound pass
    triton_refine: bool = False,
    valid: Tensor | None = None,  # [N] bool: the rows ``ok`` speaks for (None: all)
) -> tuple[Tensor, Tensor, Tensor]:
    """``(ids [N], ok [] bool, spared [] bool)``: ``ids`` is the stock argmax of every valid row
    when ``ok``; ``spared``: ok only because a row that failed is not valid; fixed shapes."""
    if counters is not None:

        def bounds_fn(h: CheapHead, t: RowTerms, kc: float) -> tuple[Tensor, Tensor]:
            return int8_block_bounds(h, t, kc, counters)

        bounds: BoundsFn = bounds_fn
    else:
        bounds = block_bounds_ref
    bd = bound_rows(x, head, stock, bounds)
    nb, bsz = head.num_blocks, head.block
    c = min(candidates, nb)
    top = bd.upper.topk(min(c + 1, nb), dim=1)  # sorted, [N, C(+1)]
    blocks = top.indices[:, :c]  # [N, C]
    ok = bd.ok
    if nb > c:  # every block left out is below M_r: no candidate is missed (step 2)
        ok = ok & (top.values[:, c] < bd.best_lower)
    ids = (blocks[:, :, None] * bsz + torch.arange(bsz, device=x.device)).flatten(1)  # [N, C·b]
    in_vocab = ids < head.vocab
    ids = ids.clamp(max=head.vocab - 1)
    refine = refine_logits if triton_refine else refine_logits_ref
    s_hat = refine(x, lm_head, blocks, bsz)  # [N, C·b] float64
    cand_blk = top.values[:, :c] >= bd.best_lower[:, None]  # [N, C]
    cand = cand_blk[:, :, None].expand(-1, -1, bsz).flatten(1) & in_vocab
    omega = head.omega[ids].double()  # [N, C·b]
    lo, hi = refine_intervals(s_hat, omega, bd.terms.x_norm, cand, stock, head.hidden)
    pick, certified = certified_pick(lo, hi)
    row_ok = ok & certified  # [N]
    ok_all = row_ok.all()
    if valid is None:
        return ids.gather(1, pick[:, None]).squeeze(1), ok_all, torch.zeros_like(ok_all)
    ok_valid = (row_ok | ~valid).all()
    return ids.gather(1, pick[:, None]).squeeze(1), ok_valid, ok_valid & ~ok_all


def certify_fused(
    x: Tensor,  # [N, H] final-normed hidden rows
    head: CheapHead,  # int8
    lm_head: Tensor,  # [V, H] stock weights
    stock: StockRounding,
    candidates: int,
    counters: Tensor,  # split-K buffer of the INT8 GEMM
    consts: Tensor,  # kernels/argmax_fused.fused_constants of this head and stock rounding
    flag: Tensor,  # [1] int64 out: 1 when some valid row is not certified
    counts: Tensor,  # [4] int64: calls, abstained calls, rows, spared calls (added to)
    valid: Tensor | None = None,  # [N] bool: the rows the flag speaks for (None: all)
) -> Tensor:
    """:func:`certify_fixed` in few launches (``kernels/argmax_fused.py``): row terms, the INT8
    GEMM, the bound epilogue, ``amax`` and ``topk``, the refine, the finish (which writes the
    flag and the counters); returns the ids ``[N]``."""
    from specpilot.kernels.argmax_fused import block_bounds_fused, finish_fused, row_terms_fused
    from specpilot.kernels.int8_gemm import int8_matmul

    terms = row_terms_fused(x, head, consts)
    scaled = int8_matmul(terms.xq, head.weight, head.scale, counters, out_dtype=torch.float32)
    upper, lower = block_bounds_fused(head, terms, kc_coefficient(head, stock), scaled)
    nb = head.num_blocks
    c = min(candidates, nb)
    top = upper.topk(min(c + 1, nb), dim=1)  # sorted, [N, C(+1)]
    s_hat = refine_logits(x, lm_head, top.indices[:, :c], head.block)  # [N, C·b] float64
    best = lower.amax(dim=1)  # [N] M_r
    return finish_fused(
        s_hat, top.values, top.indices, best, head, terms, consts, c, flag, counts, valid
    )


class GraphArgmaxHead:
    """The ``Transformer.argmax_head`` plug with an abstain flag (module docstring)."""

    graph_safe = False
    """Calling the head reads its flag on the host; :meth:`abstaining` is the graph-safe path."""

    def __init__(
        self,
        model: Transformer,
        fmt: str = "auto",
        block: int = 64,
        candidates: int = 8,
        use_triton: bool | None = None,
        fused: bool | None = None,
    ) -> None:
        """``use_triton``: the INT8 GEMM and the Triton refine (default: wherever Triton runs);
        ``fused``: with them the fused row-terms, bound and finish kernels (default: with
        ``use_triton`` and an int8 copy), else the torch epilogue."""
        dev = model.device
        fmt = cheap_format(fmt, dev, "int8")
        if candidates < 1:
            raise ValueError(f"candidate blocks must be at least 1, got {candidates}")
        self.model = model
        self.head = prepare_cheap_head(model.lm_head.detach(), fmt, block)
        if use_triton is None:
            use_triton = triton_usable(dev)
        self.use_triton = use_triton
        self.candidates = candidates
        self.counters: Tensor | None = None
        if use_triton and fmt == "int8":
            from specpilot.kernels.int8_gemm import counter_buffer

            self.counters = counter_buffer(self.head.vocab, dev)
        if fused is None:
            fused = self.counters is not None
        if fused and self.counters is None:
            raise ValueError("The fused certificate needs Triton and the int8 copy.")
        self.fused = fused
        self._consts: dict[StockRounding, Tensor] = {}
        if fused:  # built here, outside any graph capture (the settings of today)
            self.constants(stock_rounding(model.dtype, dev, self.head.hidden))
        self.abstain_flag = torch.zeros(1, dtype=torch.int64, device=dev)
        """1 when the last call could not certify every valid row (its ids are then meaningless)."""
        self.counts = torch.zeros(4, dtype=torch.int64, device=dev)
        """On the device: calls, abstained calls, rows, spared calls (read with :meth:`stats`)."""

    def abstaining(
        self,
        x: Tensor,  # [B, R, H]
        valid: Tensor | None = None,  # [B, R] bool: rows whose ids the caller reads (None: all)
    ) -> Tensor:  # [B, R] int64
        """Certified ids and ``abstain_flag`` (set only for a valid row that is not certified;
        the ids of the other rows may be anything); graph-safe (fixed shapes, no host sync)."""
        b, r, h = x.shape
        stock = stock_rounding(self.model.dtype, x.device, h)
        rows, lm = x.reshape(b * r, h), self.model.lm_head
        if valid is not None:
            if valid.shape != (b, r):
                raise ValueError(f"valid: want shape {(b, r)}, got {tuple(valid.shape)}")
            valid = valid.reshape(b * r).to(torch.bool)
        if self.fused:
            assert self.counters is not None
            consts = self.constants(stock)
            ids = certify_fused(
                rows, self.head, lm, stock, self.candidates, self.counters, consts,
                self.abstain_flag, self.counts, valid,
            )  # fmt: skip
            return ids.view(b, r)
        ids, ok, spared = certify_fixed(
            rows, self.head, lm, stock, self.candidates, self.counters, self.use_triton, valid
        )
        self.abstain_flag.copy_((~ok).to(torch.int64).view(1))
        self.counts[0] += 1
        self.counts[1] += self.abstain_flag[0]
        self.counts[2] += b * r
        self.counts[3] += spared.to(torch.int64)
        return ids.view(b, r)

    def constants(self, stock: StockRounding) -> Tensor:
        """The fused kernels' float64 constants for ``stock`` (a host→device copy the first time
        a rounding model is seen: matmul precision settings changed since construction)."""
        if stock not in self._consts:
            from specpilot.kernels.argmax_fused import fused_constants

            refine = refine_coefficients(stock, self.head.hidden)
            self._consts[stock] = fused_constants(
                self.head, stock.eps, stock.tau, stock.max_logit, 1 + 2 * stock.u_out, refine,
                self.model.device,
            )  # fmt: skip
        return self._consts[stock]

    def __call__(self, x: Tensor) -> Tensor:  # x: [B, R, H] → [B, R] int64
        ids = self.abstaining(x)
        if bool(self.abstain_flag[0]):  # host sync: only callers that ignore the flag
            return stock_argmax(self.model, x)
        return ids

    def stats(self) -> dict[str, int]:
        """Calls, abstained calls, rows certified, and spared calls: calls that did not abstain
        only because every row that failed was outside ``valid`` (idle rows, padding)."""
        calls, abstained, rows, spared = (int(v) for v in self.counts.tolist())
        return {"calls": calls, "abstained_calls": abstained, "rows": rows, "spared_calls": spared}


__all__ = ["GraphArgmaxHead", "certify_fixed", "certify_fused"]
