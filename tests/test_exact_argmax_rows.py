"""The graph-safe exact-argmax head abstains only for rows whose ids can be committed.

A verify forward computes rows no accept commits: idle batch rows (free slots, frozen rows) and
the bucket padding of packed and tree layouts. ``Layout.live_rows`` gives the rows that count, the
engine passes them to the head as ``valid``, and only a valid row that fails to certify sets the
flag. Here: the mask of each layout kind; the head (torch and fused forms) with a failing row in
and out of the mask; and the scheduler with more slots than requests (AR, chain, packed, tree) on
a peaked model with a head that poisons every row fed token 0 (what idle rows and their padding
feed): no abstain, tokens equal AR, and the poison did hit rows outside the mask.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import run_interpreted, torch_small_ops
from specpilot.drafters import NgramDrafter
from specpilot.drafters.tree import TreeShape
from specpilot.engine import Engine
from specpilot.engine.plans import ChainPlan, PackedPlan, TreePlan
from specpilot.engine.requests import Request
from specpilot.engine.scheduler import Scheduler
from specpilot.mechanisms.exact_argmax_graph import GraphArgmaxHead
from specpilot.models.layout import DenseLayout, PackedLayout, PackedRows
from specpilot.models.transformer import Transformer
from specpilot.synthetic import build_target, make_peaked
from test_exact_argmax import head_model, stock_ids
from test_exact_argmax_graph import peaked


# ---------------------------------------------------------------------- the masks
def test_live_rows_of_each_layout() -> None:
    active = torch.tensor([1, 0, 1])
    dense = DenseLayout.build(torch.tensor([4, 1, 6]), 2, 16, 1, torch.float32)
    assert dense.live_rows(active).tolist() == [True, True, False, False, True, True]
    rows = PackedRows.allocate(3, 4, torch.device("cpu"))
    rows.fill([2, 1, 3], 8)  # 6 real rows, then 2 rows of bucket padding
    start = torch.tensor([4, 1, 6])
    packed = PackedLayout.build(rows, 8, start, 16, 1, torch.float32, 32)
    assert packed.live_rows(active).tolist() == [True, True, False, True, True, True, False, False]
    assert packed.live_rows(torch.ones(3, dtype=torch.int64)).tolist() == [True] * 6 + [False] * 2


# ---------------------------------------------------------------------- the head
def _check_masked_head(head: GraphArgmaxHead, model: Transformer) -> None:
    """Row 2 fails to certify (a NaN): outside the mask no abstain and the other rows' ids are the
    stock argmax; inside it (or without a mask) the call abstains."""
    x = peaked(model, 4, torch.Generator().manual_seed(3))
    x[0, 2, 5] = float("nan")
    want = stock_ids(model, x)
    keep = torch.tensor([[True, True, False, True]])
    for valid, abstains in ((keep, False), (None, True), (torch.ones_like(keep), True),
                            (torch.tensor([[True, False, True, False]]), True)):  # fmt: skip
        ids = head.abstaining(x, valid)
        assert int(head.abstain_flag[0]) == int(abstains), valid
        assert bool(((ids >= 0) & (ids < model.cfg.vocab_size)).all())
        if not abstains:
            assert torch.equal(ids[keep], want[keep])
    assert head.stats() == {"calls": 4, "abstained_calls": 3, "rows": 16, "spared_calls": 1}
    with torch.inference_mode():
        head.abstaining(x[:, :2], keep[:, :2])  # rows 0 and 1 certify: nothing spared
    assert int(head.abstain_flag[0]) == 0 and head.stats()["spared_calls"] == 1


def test_rows_outside_the_mask_cannot_make_the_head_abstain() -> None:
    model = head_model(700, 64, 3)
    _check_masked_head(GraphArgmaxHead(model, candidates=4, use_triton=False), model)
    with pytest.raises(ValueError, match="valid"):
        GraphArgmaxHead(model, candidates=4).abstaining(torch.zeros(1, 3, 64), torch.ones(1, 2))


def test_the_fused_finish_honours_the_mask_in_interpreter() -> None:
    assert "masked fused ok" in run_interpreted([str(Path(__file__).resolve()), "fused"])


def _group_fused() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        model = head_model(300, 64, 9, dtype=dtype)
        head = GraphArgmaxHead(model, candidates=2, use_triton=True)
        assert head.fused
        _check_masked_head(head, model)
    print("masked fused ok")


# ---------------------------------------------------------------------- the engine
class PoisonTokenZero:
    """The graph head, fed NaN for every row whose stock argmax is 1: on the peaked model (next
    token = token + 1) the rows fed token 0, i.e. idle rows and the padding a packed layout copies
    from an idle row 0. Counts, on the device, the poisoned rows in and out of ``valid``."""

    def __init__(self, inner: GraphArgmaxHead) -> None:
        self.inner = inner
        self.abstain_flag = inner.abstain_flag
        self.hits = torch.zeros(2, dtype=torch.int64, device=inner.abstain_flag.device)

    def abstaining(self, x: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        poison = F.linear(x, self.inner.model.lm_head).argmax(dim=-1) == 1  # [B, R]
        live = torch.ones_like(poison) if valid is None else valid
        self.hits[0] += (poison & live).sum()
        self.hits[1] += (poison & ~live).sum()
        return self.inner.abstaining(torch.where(poison[..., None], float("nan"), x), valid)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def _run(engine: Engine, prompts: list[list[int]], news: list[int], slots: int) -> list[list[int]]:
    sched = Scheduler(engine, slots=slots, max_context=64)
    for i, (p, n) in enumerate(zip(prompts, news, strict=True)):
        sched.submit(Request(str(i), tuple(p), n))
    done: dict[str, list[int]] = {}
    while sched.has_work:
        for res in sched.step().finished:
            done[res.id] = res.tokens
    return [done[str(i)] for i in range(len(prompts))]


PLANS = {  # drafter, verify plan, AR steps per read-back
    "ar-window": lambda: (None, None, 4),
    "chain": lambda: (NgramDrafter(k=3), ChainPlan(), None),
    "packed": lambda: (NgramDrafter(k=3), PackedPlan(bucket=4), None),
    "tree": lambda: (NgramDrafter(k=3), TreePlan(shape=TreeShape.uniform(3, 2, 5, 2)), None),
}


def _check_idle_rows(plan: str, device: str = "cpu", fused: bool = False) -> None:
    """Four slots, three requests (row 0's ends first, so packed padding then copies an idle row):
    tokens equal AR, no verify redone, and the poison hit only rows outside the mask. On CUDA
    from CUDA graphs."""
    target = make_peaked(
        build_target("tiny-llama", device, torch.float32, seed=0, max_positions=96)
    )
    prompts = [[10 + i for i in range(8)], [20, 21, 22, 20, 21, 22, 23], [40, 41, 42, 43, 44, 45]]
    news = [3, 9, 6]  # no live row ever feeds token 0: the peaked continuation counts up
    small = torch_small_ops if fused and device == "cpu" else (lambda e: e)  # interpreted
    want = _run(small(Engine(target, graphs=False)), prompts, news, 1)
    head = PoisonTokenZero(GraphArgmaxHead(target, candidates=2, use_triton=fused))
    target.argmax_head = head
    drafter, verify_plan, sync_every = PLANS[plan]()
    engine = small(Engine(target, drafter, plan=verify_plan, sync_every=sync_every))
    assert _run(engine, prompts, news, 4) == want
    live_hits, idle_hits = head.hits.tolist()
    assert engine.abstains == 0 and live_hits == 0 and idle_hits > 0
    assert head.inner.stats()["spared_calls"] > 0 and head.inner.fused == fused
    assert engine.runner.use_graphs == (device == "cuda")


@pytest.mark.parametrize("plan", list(PLANS))
def test_idle_rows_and_padding_never_abstain(plan: str) -> None:
    _check_idle_rows(plan)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("plan", list(PLANS))
def test_cuda_graphs_idle_rows_never_abstain(plan: str) -> None:
    """The fused head from CUDA graphs (the live-row mask built inside the captured verify)."""
    _check_idle_rows(plan, "cuda", fused=True)


@pytest.mark.slow
def test_fused_head_idle_rows_in_interpreter() -> None:
    """The fused head in the engine (packed, tree: padding rows) under ``TRITON_INTERPRET=1``."""
    assert "fused idle ok" in run_interpreted([str(Path(__file__).resolve()), "engine"], 600)


def _group_engine() -> None:
    for plan in ("packed", "tree"):  # the AR window: test_exact_argmax_graph's fused engine test
        _check_idle_rows(plan, fused=True)
    print("fused idle ok")


if __name__ == "__main__":
    torch.set_num_threads(1)
    {"fused": _group_fused, "engine": _group_engine}[sys.argv[1]]()
