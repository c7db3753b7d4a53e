"""The kernel search inside ``specpilot tune``: per GPU, weight shape and width, the tiling of the
tensor-core W12 kernel (``kernels/w12_mma.py``) that runs fastest, measured on this GPU.

For each decoder weight shape of the target (``[N, K]``) and each width the engine will run
(1, k + 1, the tree and batched widths, as M buckets) the search:

1. checks every candidate tiling against the reference before timing it: a one-hot probe (x rows
   are unit vectors, so ``y`` must equal the checkpoint's weights bit for bit, escapes included)
   and random x within the fp32-reordering bound against the fp64 product;
2. times candidates in CUDA graphs over the target's own layers of that shape (rotated past the
   L2), next to cuBLAS (``F.linear`` on the bf16 weights) and the cold-start default
   (``kernels/w12_tilings.DEFAULT``): the best two tilings of a sweep, then their K splits, then
   the winner, the default and cuBLAS in interleaved rounds (medians);
3. counts compile time against the budget: a candidate is started only if its estimated compile
   (the mean of this search's compiles so far, a prior before the first) plus its timing fits in
   what is left; Triton keeps compiled kernels on disk, so a later process compiles nothing;
4. stores each winner in the memory under the GPU's fingerprint (``memory.fingerprint.
   gpu_fingerprint``: name, SMs, memory clock and bus, driver, torch, triton), shape and width. A
   later tune on the same GPU reads them back, checks each again and only re-times it once next
   to cuBLAS (a few percent of the first search's kernel seconds); a winner that fails its check
   is searched again.

The memory's accepted agent kernels for the ``w12-gemm`` slot on this GPU are candidates too,
re-checked in the sandbox at the target's shapes before they run here, then checked and timed
like a tiling (``tune/kernel_offer_check.py``); a cell one wins names it by source hash, and the
engine loads it from the memory there (``kernels/offers.py``), its tiling the fallback. A stored
offer winner is reused like a tiling once re-checked: the sandbox runs again unless the memory
holds its pass at this shape and these widths on this very weight (``offer_check``); only a
source the memory still holds as accepted is loaded.

The measuring tools (the check, the CUDA-graph timer, the compile budget, the rows) are in
``tune/kernel_measure.py``.

The table it returns (``MmaTilings``) goes into the tuned engine config (``EngineConfig.kernels``),
so ``generate``, ``bench``, ``compare`` and ``serve`` run the measured tilings. The hand-measured
``DEFAULT`` stays only as the cold start and the fallback for shapes not searched.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, replace
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from specpilot.kernels.w12_tilings import DEFAULT_TILINGS, MmaConfig, MmaTilings, bucket
from specpilot.tune.kernel_measure import (
    KERNEL,
    CompileBudget,
    KernelSearch,
    SearchRow,
    check,
    compile_key,
    graph_time,
)

CANDIDATES = (
    MmaConfig(block_r=64, block_k=256, num_warps=4, num_stages=3),
    MmaConfig(block_r=64, block_k=256, num_warps=4, num_stages=4),
    MmaConfig(block_r=64, block_k=512, num_warps=4, num_stages=2),
    MmaConfig(block_r=64, block_k=512, num_warps=4, num_stages=3),
    MmaConfig(block_r=64, block_k=128, num_warps=4, num_stages=4),
    MmaConfig(block_r=128, block_k=256, num_warps=8, num_stages=3),
    MmaConfig(block_r=128, block_k=128, num_warps=8, num_stages=4),
    MmaConfig(block_r=64, block_k=256, num_warps=8, num_stages=4, inner_split=2),
    MmaConfig(block_r=64, block_k=512, num_warps=8, num_stages=2, inner_split=2),
)
"""Tilings the search sweeps. Stream-K (``MmaConfig.stream_k``) is left out: on the H100 it ran
15-30% slower than split-K on every Llama-3-8B shape (docs/figures/issue-26.md). The two
``inner_split`` tilings give a 64-row tile 8 warps at the shared memory of 4 (sm_90 builds: 104
and 80 KB, 80 and 128 registers): on the H200 the searched grids of qkv, o and down had fewer
programs than SMs, one warp per scheduler (docs/figures/issue-26.md); not yet timed on a GPU."""
SPLITS = (1, 2, 3, 4, 6, 8)
STREAMS = (1, 2, 3, 4)
"""Programs per SM tried around a stream-K tiling (no new compile: only the grid changes)."""


def split_variants(
    cfg: MmaConfig, m: int, n: int, kp: int, device: torch.device
) -> list[MmaConfig]:
    """``cfg`` with each explicit K split of ``SPLITS`` that K allows (at most 16 programs per SM),
    its automatic split left out (already timed); a stream-K tiling with the other ``STREAMS``."""
    from specpilot.kernels.w12_mma import launch_shape

    if cfg.stream_k:
        return [replace(cfg, stream_k=s) for s in STREAMS if s != cfg.stream_k]
    grid, _, auto, _ = launch_shape(m, n, kp, cfg, device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    fit = [
        s
        for s in SPLITS
        if s != auto and s <= kp // cfg.block_k and grid[0] * grid[1] * s <= 16 * sms
    ]
    return [replace(cfg, split_k=s) for s in fit]


def _search_cell(
    weights: list[Tensor], w12s: list[Any], counters: list[Tensor], m: int,
    budget: CompileBudget, device: torch.device, rounds: int,
    offers: Mapping[str, Callable[..., Tensor]] | None = None, notes: list[str] | None = None,
) -> SearchRow:  # fmt: skip
    """One (shape, width): the sweep, the splits of the best two, the agent kernels ``offers``
    (source hash -> entry, re-checked already in the sandbox), then interleaved rounds."""
    from specpilot.kernels.w12_mma import w12_mma

    n, k = weights[0].shape
    x = torch.randn(m, k, device=device).to(torch.bfloat16)
    default = DEFAULT_TILINGS.config(m, n, k)
    offers = offers or {}
    own = [torch.zeros_like(c) for c in counters] if offers else []  # the agent kernels' counters

    def calls(cfg: MmaConfig | str) -> list[Callable[[], Any]]:
        fn = offers[cfg] if isinstance(cfg, str) else partial(w12_mma, cfg=cfg)
        cs = own if isinstance(cfg, str) else counters
        return [partial(fn, x, t, c) for t, c in zip(w12s, cs, strict=True)]

    timed: dict[MmaConfig | str, float] = {}
    tried = skipped = 0

    def attempt(cfg: MmaConfig | str) -> None:
        nonlocal tried, skipped
        key = ("offer", cfg, m) if isinstance(cfg, str) else compile_key(cfg, m, w12s[0].base)
        if cfg in timed or not budget.fits(key):
            skipped += cfg not in timed
            return
        t0 = time.perf_counter()
        tried += 1
        try:
            why = check(offers[cfg], weights[0], w12s[0], own[0], m) if isinstance(cfg, str) else check(cfg, weights[0], w12s[0], counters[0], m)  # fmt: skip
            if why is None:
                timed[cfg] = graph_time(calls(cfg), device)
        except Exception as e:  # an agent kernel or a tiling that fails to build or launch
            # is left out with a note; not the default (the fallback must run), nor a fault on
            # the device, after which nothing on it can be trusted
            if cfg == default or "CUDA" in str(e) or "illegal" in str(e):
                raise
            why = f"{type(e).__name__}: {e}"[:200]
        if why is not None and notes is not None:
            name = f"offer {cfg}" if isinstance(cfg, str) else f"tiling {cfg}"
            notes.append(f"{name} at {n}x{k} M={m}: {why}; not timed")
        budget.compiled_now(key, time.perf_counter() - t0)

    attempt(default)
    for cfg in CANDIDATES:
        attempt(cfg)
    tilings = [c for c in timed if isinstance(c, MmaConfig)]
    for cfg in sorted(tilings, key=timed.__getitem__)[:2]:
        for c in split_variants(cfg, m, n, w12s[0].padded_k, device):
            attempt(c)
    for h in offers:
        attempt(h)
    if default not in timed:
        raise RuntimeError(f"the default tiling failed its check on {n}x{k} at M={m}")
    best = min(timed, key=timed.__getitem__)
    arms = {"best": calls(best), "default": calls(default)}
    arms["cublas"] = [partial(F.linear, x, w) for w in weights]
    got: dict[str, list[float]] = {a: [] for a in arms}
    for _ in range(rounds):
        for a, cs in arms.items():
            got[a].append(1e6 * graph_time(cs, device))
    med = {a: statistics.median(v) for a, v in got.items()}
    if med["default"] <= med["best"]:
        best, med["best"] = default, med["default"]
    tiling = best if isinstance(best, MmaConfig) else min((c for c in timed if isinstance(c, MmaConfig)), key=timed.__getitem__)  # fmt: skip
    offer = best if isinstance(best, str) else None
    return SearchRow((n, k), bucket(m), tiling, med["best"], med["default"], med["cublas"], tried, skipped, offer=offer)  # fmt: skip


def _reuse_cell(
    hit: dict[str, Any], weights: list[Tensor], w12s: list[Any], counters: list[Tensor], m: int,
    device: torch.device, agents: Any, seconds_left: Callable[[], float], notes: list[str],
) -> SearchRow | None:  # fmt: skip
    """A cell's stored winner (``hit``: the memory's tiling, or an agent offer with its tiling
    as the fallback) checked again and re-timed once next to cuBLAS (an offer next to the
    default too; a tiling keeps the default time the search stored); None (a note says why) when
    it fails: the cell is searched again. An offer is re-checked first
    (``OfferCandidates.stored``: the sandbox, unless the memory holds its pass on this weight)."""
    from specpilot.kernels.offers import OfferRef
    from specpilot.kernels.w12_mma import w12_mma

    n, k = weights[0].shape
    cfg, stored = MmaConfig(**hit["config"]), hit["metrics"].get("offer")
    ref = OfferRef(**stored) if stored else None
    default = DEFAULT_TILINGS.config(m, n, k)
    fn: Callable[..., Tensor] | None = partial(w12_mma, cfg=cfg)
    cs, what = counters, "tiling"
    if ref is not None:
        what = f"winner, agent offer {ref.source_hash},"
        fn = agents.stored(weights[0], ref, hit["metrics"].get("offer_check"), seconds_left)
        cs = [torch.zeros_like(c) for c in counters]  # the agent kernel's own counters
    if fn is None:
        notes.append(f"{n}x{k} M<={m}: the stored {what} did not pass its re-check (above); searching again")  # fmt: skip
        return None
    try:
        why = check(fn, weights[0], w12s[0], cs[0], m)
    except Exception as e:  # an agent kernel that raises here is searched again, never fatal
        if ref is None:
            raise
        why = f"{type(e).__name__}: {e}"[:200]
    if why is not None:
        notes.append(f"{n}x{k} M<={m}: the stored {what} failed its check ({why}); searching again")  # fmt: skip
        return None
    x = torch.randn(m, k, device=device).to(torch.bfloat16)
    us = 1e6 * graph_time([partial(fn, x, t, c) for t, c in zip(w12s, cs, strict=True)], device)
    dus = hit["metrics"].get("default_us", us)  # a tiling: the first search's default time
    if ref is not None:  # foreign code: timed beside the default again (one graph, a kernel load)
        dus = 1e6 * graph_time([partial(w12_mma, x, t, c, cfg=default) for t, c in zip(w12s, counters, strict=True)], device)  # fmt: skip
    cub = 1e6 * graph_time([partial(F.linear, x, w) for w in weights], device)
    offer = ref.source_hash if ref is not None else None
    return SearchRow((n, k), m, cfg, us, dus, cub, reused=True, offer=offer)


def search_w12_mma(
    matrices: dict[tuple[int, int], list[Tensor]],
    widths: Sequence[int],
    device: torch.device,
    budget_s: float,
    store: Any | None = None,
    log: Callable[[str], None] = print,
    rounds: int = 3,
    offers: Sequence[Any] | None = None,
) -> KernelSearch:
    """Search the tilings of every ``[N, K]`` in ``matrices`` (a few of the target's own bf16
    weights of that shape each, the first checked, all rotated through the timings) at every
    width bucket of ``widths``, within ``budget_s`` seconds; reuse what ``store`` holds for this
    GPU (module docstring). ``offers``: agent kernels (``tune/kernel_agent.KernelOffer``) to
    try beside the tilings; None: the ones ``store`` holds as accepted for this GPU."""
    from specpilot.kernels.gemm_common import counter_buffer
    from specpilot.mechanisms.w12_format import encode
    from specpilot.memory.fingerprint import gpu_fingerprint
    from specpilot.tune.kernel_offer_check import OfferCandidates

    t_start = time.perf_counter()
    gpu = gpu_fingerprint(device)
    budget = CompileBudget(budget_s)
    buckets = list(dict.fromkeys(bucket(min(max(1, w), 64)) for w in widths))  # in order given
    known = store.tilings(gpu["key"], KERNEL) if store is not None else {}
    result = KernelSearch(tilings=DEFAULT_TILINGS, gpu=gpu)
    by_shape: dict[tuple[int, int, int], MmaConfig] = {}
    checks = sorted({*buckets, *(min(max(1, w), 64) for w in widths)})  # the offers' re-checks
    agents = OfferCandidates.make(offers, store, gpu["key"], device, checks, result.notes)
    encoded = {
        shape: ([encode(w, "v4") for w in ws], [counter_buffer(shape[0], device) for _ in ws])
        for shape, ws in matrices.items()
    }
    for m in buckets:  # every shape at the first width before any at the next (the budget)
        for (n, k), ws in matrices.items():
            w12s, counters = encoded[(n, k)]
            t0 = time.perf_counter()
            hit = known.get((n, k, m))
            row = None if hit is None else _reuse_cell(hit, ws, w12s, counters, m, device, agents, budget.left, result.notes)  # fmt: skip
            if row is not None:  # the stored winner, checked and re-timed once
                row.device_s = time.perf_counter() - t0
                result.rows.append(row)
                by_shape[(n, k, m)] = row.config
                agents.chosen((n, k, m), row.offer)
                continue
            if budget.left() < budget.estimate(compile_key(DEFAULT_TILINGS.config(m, n, k), m, w12s[0].base)):  # fmt: skip
                result.notes.append(f"{n}x{k} M<={m}: not searched, {budget.left():.0f}s of the kernel budget left (the default stays)")  # fmt: skip
                continue
            fns = agents.for_shape(ws[0], budget.left)
            row = _search_cell(ws, w12s, counters, m, budget, device, rounds, fns, result.notes)
            row.device_s = time.perf_counter() - t0
            result.rows.append(row)
            by_shape[(n, k, m)] = row.config
            agents.chosen((n, k, m), row.offer)
            if store is not None:
                store.put_tiling(gpu, KERNEL, (n, k), m, asdict(row.config),
                                 {"us": row.us, "default_us": row.default_us,
                                  "cublas_us": row.cublas_us, "device_s": row.device_s,
                                  "tried": row.tried, "skipped": row.skipped,
                                  "offer": agents.ref_json(row.offer),
                                  "offer_check": agents.check_record(ws[0], row.offer) if row.offer else None})  # fmt: skip
            log(row.line())
    result.tilings = MmaTilings(by_shape=by_shape, source=f"search {gpu['key']}")
    result.offers = agents.result()
    result.device_s = time.perf_counter() - t_start
    return result


def search_for_tune(
    kernel_budget: float | None,
    base: Any,
    executor: Any,
    device: torch.device,
    search_budget: float,
    store: Any,
    notes: list[str],
    record: dict[str, Any] | None = None,
    kernel_agent: Callable[[dict[tuple[int, int], list[Tensor]], Sequence[int], float], Any]
    | None = None,
) -> tuple[dict[str, Any] | None, float]:
    """``specpilot tune``'s kernel search, when W12 is searchable here (CUDA, the local
    executor): the tilings for ``EngineConfig.kernels`` and the seconds it took (the caller takes
    them off the search budget); its lines go to the console and to the report's ``notes``, its
    cells (which kernel won, its speedup over the default, device-seconds) into ``record``
    (``run.json``'s ``search``) as ``kernel_search``. ``kernel_agent(matrices, widths,
    seconds)``: asks the kernel sub-agent for sources first (``tune --kernel-agent``); its
    time comes off the kernel budget.
    ``kernel_budget`` None: a quarter of ``search_budget``, at most 120 s; 0 skips it."""
    from specpilot.tune.executors import LocalExecutor
    from specpilot.tune.space import directions_for

    budget = min(120.0, 0.25 * search_budget) if kernel_budget is None else kernel_budget
    names = {d.name for d in directions_for(base, device.type, executor.arch, executor.num_layers)}
    if budget <= 0 or device.type != "cuda" or "mechanism:w12" not in names:
        if kernel_agent is not None:
            notes.append("kernel agent: not asked (its kernels join the kernel search: CUDA, w12)")
        return None, 0.0
    if not isinstance(executor, LocalExecutor):
        notes.append("kernel search: runs with the local executor only (the defaults stay)")
        return None, 0.0
    t0 = time.perf_counter()
    print(f"kernel search: W12 tensor-core tilings, {budget:.0f}s ...", flush=True)
    matrices, widths = target_matrices(executor.evaluator.stock.model), search_widths(base.k, names, device.type)  # fmt: skip
    if kernel_agent is not None:
        kernel_agent(matrices, widths, 0.5 * budget)
        budget = max(budget - (time.perf_counter() - t0), 0.0)
    result = search_w12_mma(
        matrices, widths, device, budget, store,
        log=lambda m: print(m, flush=True),
    )  # fmt: skip
    for line in result.lines():
        print(line)
    notes.extend(result.lines())
    if record is not None:
        record["kernel_search"] = result.to_dict()
    kernels = {"w12_mma": result.tilings.to_json()}
    if result.offers is not None:
        kernels["w12_offers"] = result.offers.to_json()
    return kernels, time.perf_counter() - t0


def search_widths(k: int, directions: set[str], device_type: str) -> list[int]:
    """The widths a tune's search covers, first first (the budget may end before the last): AR's
    1, the chain verify's ``k + 1``, then the verify widths of the trees a tune tries first (the
    defaults and seeds of ``tree-verify``, where trees are searched: ``1 + max_nodes``, at most
    64)."""
    widths = [1, k + 1]
    if "mechanism:tree-verify" in directions:
        from specpilot.mechanisms import MECHANISMS
        from specpilot.tune.space import tree_width

        tree = MECHANISMS["tree-verify"]
        tried = (tree.resolve_knobs({}), *tree.seeds.get(device_type, ()))  # its first trials
        widths += sorted({min(tree_width(s), 64) for s in tried if "max_nodes" in s})
    return widths


def target_matrices(model: Any, copies: int = 4) -> dict[tuple[int, int], list[Tensor]]:
    """The decoder's weight matrices by shape: the first ``copies`` layers' of each (the search
    checks the first and rotates through all)."""
    out: dict[tuple[int, int], list[Tensor]] = {}
    for layer in model.layers[:copies]:
        for name in ("w_qkv", "w_o", "w_gate_up", "w_down"):
            w = getattr(layer, name, None)
            if isinstance(w, Tensor) and w.dtype == torch.bfloat16 and w.dim() == 2:
                out.setdefault((int(w.shape[0]), int(w.shape[1])), []).append(w.detach())
    return out


__all__ = [
    "CANDIDATES",
    "KERNEL",
    "CompileBudget",
    "KernelSearch",
    "SearchRow",
    "check",
    "search_for_tune",
    "search_w12_mma",
    "search_widths",
    "split_variants",
    "target_matrices",
]
