"""The fused tree accept + K/V compaction kernel (``kernels/tree_accept.py``) against the torch
rule (``accepted_path`` + ``compact_kv``), run on the CPU through ``TRITON_INTERPRET=1``: exactly
equal ``n``, path, committed tokens and caches over many random trees (ragged batches, frozen
rows, all rejected, full-depth accepts, ties between branches at equal depth), fp32 and bf16
caches; and the engine with the fused accept equal to plain AR token for token in fp32, its
caches equal to the torch path's. Where the choice between the two is made: CPU tests below."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from conftest import run_interpreted
from specpilot.engine.accept import use_fused_tree_accept
from specpilot.engine.trees import tree_tables


def random_tree(rng: random.Random, nodes: int, max_depth: int) -> tuple[list[int], list[int]]:
    """Parents (-1: the root) and depths of a random tree in DFS pre-order, at most
    ``max_depth`` deep: node i hangs below a node on the path to node i - 1 (or the root)."""
    parents, depths, path = [], [], []
    for i in range(nodes):
        path = path[: rng.randint(0, min(len(path), max_depth - 1))]
        parents.append(path[-1] if path else -1)
        depths.append(len(path) + 1)
        path.append(i)
    return parents, depths


PATTERNS = ("random", "rejected", "full_depth", "ties", "one_branch")
TRIALS = 75


def random_case(rng: random.Random, pattern: str, batch: int, width: int, k: int) -> dict:
    """Tree buffers as ``TreeBuffers`` holds them: ``tokens``, ``argmax``, ``topo``,
    ``visible`` of ``batch`` ragged rows (row trees of 0..width-1 nodes, depth <= k), plus
    ``active``. Patterns force the argmax: random over a vocabulary of 3 (partial accepts and
    coincident siblings), every node rejected, one deepest leaf's whole path accepted, every
    node accepted (ties at equal depth everywhere), one random branch accepted."""
    topo = torch.zeros(4, batch, width, dtype=torch.int64)
    vis = torch.zeros(batch, width, width, dtype=torch.bool)
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    tokens = torch.randint(0, 3, (batch, width), generator=gen)
    argmax = torch.randint(0, 3, (batch, width), generator=gen)
    for row in range(batch):
        n = rng.randint(0, width - 1)
        parents, depths = random_tree(rng, n, k)
        t, v = tree_tables(parents, depths, [0] * n, width)
        topo[:, row], vis[row] = torch.tensor(t), torch.tensor(v)
        if pattern == "rejected":
            argmax[row] = 7  # no token is 7
        elif pattern == "ties":
            tokens[row], argmax[row] = 1, 1
        elif pattern in ("full_depth", "one_branch") and n:
            deepest = max(depths)
            pool = [j for j in range(n) if pattern == "one_branch" or depths[j] == deepest]
            j = rng.choice(pool)
            while j >= 0:  # accept every node on the leaf's root path
                argmax[row, parents[j] + 1] = tokens[row, j + 1]
                j = parents[j]
    active = torch.tensor([int(rng.random() < 0.85) for _ in range(batch)], dtype=torch.int64)
    return dict(tokens=tokens, argmax=argmax, topo=topo, visible=vis, active=active)


def _group_kernel() -> None:
    from specpilot.engine.accept import accepted_path, compact_kv
    from specpilot.kernels.tree_accept import tree_accept_compact
    from specpilot.models.kv_cache import KVCache

    rng = random.Random(0)
    seen = dict.fromkeys(("moved", "rejected", "full_depth", "tie", "frozen", "empty_tree"), 0)
    cases = 0
    for trial in range(TRIALS):
        pattern = PATTERNS[trial % len(PATTERNS)]
        batch, width = rng.randint(1, 4), rng.choice([2, 5, 9, 17, 33, 65])
        k = rng.randint(1, width - 1)
        case = random_case(rng, pattern, batch, width, k)
        layers, heads, slots, dim = (
            rng.randint(1, 2),
            rng.choice([1, 2]),
            80,
            rng.choice([16, 24, 32]),
        )
        dtype = torch.bfloat16 if trial % 3 == 0 else torch.float32
        committed = torch.tensor([rng.randint(1, slots - width) for _ in range(batch)])
        ks = [torch.randn(batch, heads, slots, dim).to(dtype) for _ in range(layers)]
        vs = [torch.randn(batch, heads, slots, dim).to(dtype) for _ in range(layers)]
        ref = KVCache([x.clone() for x in ks], [x.clone() for x in vs], torch.zeros(batch))
        got = KVCache([x.clone() for x in ks], [x.clone() for x in vs], torch.zeros(batch))
        n0, src0 = accepted_path(**case, k=k)
        compact_kv(ref, committed - 1, src0)
        chain0 = case["argmax"].gather(1, src0.clamp(max=width - 1))
        chain = torch.full((batch, k + 3), -5, dtype=torch.int64)
        n1, src1 = tree_accept_compact(
            case["tokens"], case["argmax"], case["topo"], case["visible"], case["active"],
            committed, k, [*got.k, *got.v], got.tensor_offsets(), chain,
        )  # fmt: skip
        assert torch.equal(n1, n0), (trial, n1, n0)
        assert torch.equal(src1, src0), (trial, src1, src0)
        assert torch.equal(chain[:, : k + 1], chain0) and bool((chain[:, k + 1 :] == -5).all())
        for a, b in zip(got.k + got.v, ref.k + ref.v, strict=True):
            assert torch.equal(a, b), trial
        cases += 1
        ident = torch.arange(k + 1)
        depth = case["topo"][1]
        for row in range(batch):
            on, nodes = bool(case["active"][row]), int(case["topo"][3][row].sum()) - 1
            seen["frozen"] += not on
            seen["empty_tree"] += on and nodes == 0
            if not on or nodes == 0:
                continue
            seen["moved"] += not torch.equal(src0[row], ident)
            seen["rejected"] += int(n0[row]) == 0
            seen["full_depth"] += int(n0[row]) == int(depth[row].max())
            tok, am, par = case["tokens"][row], case["argmax"][row], case["topo"][0][row]
            ok = (tok == am[par]) & case["topo"][3][row].bool()
            ok[0] = True
            acc = ~(case["visible"][row] & ~ok[None, :]).any(dim=1)
            seen["tie"] += int((acc & (depth[row] == n0[row])).sum()) >= 2
    assert cases == TRIALS and min(seen.values()) >= 5, seen
    print("kernel ok", seen)


def _group_engine() -> None:
    """The engine with the fused accept (the Triton kernel, interpreted) against plain AR and
    against the torch accept: same tokens, same caches. The forward stays on torch ops, so only
    the accept runs in the interpreter (fast enough for CI)."""
    import specpilot.kernels.tree_accept as kernel_mod
    import specpilot.models.forward as forward_mod
    from specpilot.engine import Engine, generate
    from specpilot.engine.plans import TreePlan
    from specpilot.engine.tree_policy import FixedTree, RaggedTrees
    from test_gpu_path import stock_ar, tiny, toks
    from test_static_tree import BATCH_PROMPTS, TREES, _sim

    forward_mod.triton_usable = lambda device: False  # type: ignore[assignment]
    from specpilot.drafters.static_tree import StaticTree

    real, moved = kernel_mod.tree_accept_compact, [0]

    def spy(*args, **kw):  # counts rows whose accepted path left the first-choice chain
        n, src = real(*args, **kw)
        moved[0] += int((src != torch.arange(src.shape[1])).any(dim=1).sum())
        return n, src

    kernel_mod.tree_accept_compact = spy

    ragged = RaggedTrees(StaticTree.chain(7), TREES["wide12"], budget=11.0)  # 3 of 5 rows: the tree
    for arch, policy in (("llama", FixedTree(TREES["bushy10"])), ("qwen3", ragged)):
        model = tiny(arch, seed=6)
        want = stock_ar(model, BATCH_PROMPTS, 30)
        caches = []
        for fused in (True, False):
            plan = TreePlan(policy, bucket=16, fused_accept=fused)
            eng = Engine(model, _sim(model, 1.0), plan=plan, attn_bucket=16)
            got = generate(eng, BATCH_PROMPTS, 30)
            assert plan.fused is fused and toks(got) == want, (arch, fused)
            assert sum(r.stats.committed - r.stats.cycles for r in got) > 40  # drafts accepted
            assert eng.cache is not None
            caches.append(eng.cache)
        for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v, strict=True):
            assert torch.equal(a, b), arch
        assert moved[0] >= 6, (arch, moved)  # the kernel moved K/V of many rows
        moved[0] = 0
    print("engine ok")


def test_fused_tree_accept_equals_torch_rule_in_interpreter() -> None:
    out = run_interpreted([str(Path(__file__).resolve()), "kernel"], 240)
    assert "kernel ok" in out


def test_engine_with_fused_tree_accept_equals_ar_in_interpreter() -> None:
    assert "engine ok" in run_interpreted([str(Path(__file__).resolve()), "engine"], 240)


def test_the_choice_of_tree_accept(monkeypatch: pytest.MonkeyPatch) -> None:
    """Torch ops on the CPU, the kernel under the interpreter (and on CUDA); forcing the kernel
    where Triton cannot run is one sentence."""
    from conftest import tiny_config, tiny_model
    from specpilot.drafters import DraftModelDrafter
    from specpilot.drafters.static_tree import StaticTree
    from specpilot.engine import Engine, generate
    from specpilot.engine.plans import fixed_tree_plan

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not use_fused_tree_accept(torch.device("cpu"))
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert use_fused_tree_accept(torch.device("cpu"))
    monkeypatch.delenv("TRITON_INTERPRET")
    model = tiny_model(tiny_config(), 0)
    plan = fixed_tree_plan(StaticTree.chain(3), fused_accept=True)
    with pytest.raises(ValueError, match="Triton"):
        generate(Engine(model, DraftModelDrafter(model, k=3), plan=plan), [[1, 2, 3]], 4)


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    {"kernel": _group_kernel, "engine": _group_engine}[sys.argv[1]]()
