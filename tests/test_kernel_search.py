"""The kernel search's pieces (``tune/kernel_search.py``): tilings tables and their JSON, the
engine config that carries them, the memory's kernels table keyed by GPU fingerprint, the
compile-time budget, the per-kind build estimates of the tune loop; the search itself on a GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specpilot.engine.config import EngineConfig
from specpilot.engine.deployment import DeploymentSpec
from specpilot.kernels.w12_tilings import DEFAULT_TILINGS, MmaConfig, MmaTilings, bucket
from specpilot.memory import MemoryStore
from specpilot.memory.fingerprint import gpu_fingerprint
from specpilot.tune.build_estimate import BuildEstimates, kind
from specpilot.tune.kernel_search import CompileBudget, compile_key


def test_tilings_lookup_and_json() -> None:
    assert [bucket(m) for m in (1, 2, 3, 9, 16, 17, 64)] == [1, 2, 4, 16, 16, 32, 64]
    with pytest.raises(ValueError, match="at most 64"):
        bucket(65)
    special = MmaConfig(block_r=128, block_k=128, num_warps=8, split_k=3)
    t = MmaTilings(by_shape={(6144, 4096, 16): special}, source="search abc")
    assert t.config(9, 6144, 4096) == special
    assert t.config(1, 6144, 4096) == DEFAULT_TILINGS.config(1, 6144, 4096)
    assert t.config(16, 4096, 4096) == DEFAULT_TILINGS.config(16, 4096, 4096)
    back = MmaTilings.from_json(json.loads(json.dumps(t.to_json())))
    assert back.by_shape == t.by_shape and back.source == "search abc"
    halves = MmaTilings(by_shape={(4096, 4096, 1): MmaConfig(num_warps=8, inner_split=2)})
    assert MmaTilings.from_json(json.loads(json.dumps(halves.to_json()))).by_shape == {
        (4096, 4096, 1): MmaConfig(num_warps=8, inner_split=2)
    }
    old = {"by_shape": [[64, 128, 1, {"block_r": 64, "block_k": 256, "num_warps": 4,
                                      "num_stages": 3, "split_k": 0}]]}  # fmt: skip
    assert MmaTilings.from_json(old).config(1, 64, 128).inner_split == 1  # rows stored before it
    with pytest.raises(ValueError, match="block_r"):
        MmaConfig(block_r=32)
    with pytest.raises(ValueError, match="num_warps"):
        MmaConfig(block_r=64, num_warps=8)
    assert MmaConfig().tokens(1) == 16 and MmaConfig().tokens(17) == 32


def test_engine_config_carries_the_tilings() -> None:
    dep = DeploymentSpec(target="smollm2-135m", drafter="none", device="cpu", dtype="fp32")
    plain = EngineConfig(deployment=dep, k=0)
    assert "kernels" not in json.loads(plain.to_json())  # old configs (and hashes) unchanged
    assert plain.mma_tilings() is None
    t = MmaTilings(by_shape={(64, 128, 1): MmaConfig(split_k=2)}, source="search x")
    cfg = EngineConfig(deployment=dep, k=0, kernels={"w12_mma": t.to_json()})
    again = EngineConfig.from_dict(json.loads(cfg.to_json()))
    got = again.mma_tilings()
    assert got is not None and got.by_shape == t.by_shape


def test_memory_keeps_kernel_winners_by_gpu(tmp_path: Path) -> None:
    gpu = gpu_fingerprint(torch.device("cpu"))
    assert len(gpu["key"]) == 16 and gpu["torch"] == torch.__version__
    with MemoryStore(tmp_path / "m.sqlite") as store:
        store.put_tiling(gpu, "w12_mma", (6144, 4096), 16, {"block_r": 64}, {"us": 12.0})
        store.put_tiling(gpu, "w12_mma", (6144, 4096), 16, {"block_r": 128}, {"us": 11.0})
        store.put_tiling({**gpu, "key": "other"}, "w12_mma", (1, 2), 1, {}, {})
        got = store.tilings(gpu["key"], "w12_mma")
    assert got == {(6144, 4096, 16): {"config": {"block_r": 128}, "metrics": {"us": 11.0}}}


def test_compile_budget_refuses_what_would_overrun() -> None:
    now = [0.0]
    b = CompileBudget(30.0, clock=lambda: now[0])
    key = compile_key(MmaConfig(), 16, 110)
    assert b.fits(key)  # the prior (6 s) fits in 30 s
    b.compiled_now(key, 20.4)  # one compile took 20 s
    now[0] = 15.0  # 15 s left: a known kernel runs, a new compile (~20 s) does not start
    assert b.fits(key)
    other = compile_key(MmaConfig(num_stages=2), 16, 110)
    assert not b.fits(other) and b.estimate(other) == pytest.approx(20.4)


def test_a_tiling_that_fails_to_build_is_left_out_with_a_note(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A swept tiling whose build raises (say Triton out of resources on a new GPU) costs a note,
    not the tune; the default raising, or a fault on the device, still stops the search (the
    check and the timer are stand-ins: no GPU here, not a measurement)."""
    import types

    import specpilot.tune.kernel_search as ks

    bad = MmaConfig(block_r=64, block_k=256, num_warps=8, num_stages=4, inner_split=2)
    fault = MmaConfig(block_r=64, block_k=128, num_warps=4, num_stages=4)
    raising = {bad: RuntimeError("out of resource: shared memory")}

    def check(cfg: MmaConfig, *a: object) -> str | None:
        if cfg in raising:
            raise raising[cfg]
        return "decode not bit-exact" if cfg == fault else None

    monkeypatch.setattr(ks, "check", check)
    monkeypatch.setattr(ks, "graph_time", lambda calls, device, reps=4: 1e-6)
    monkeypatch.setattr(ks, "split_variants", lambda *a, **k: [])
    monkeypatch.setattr(ks, "CANDIDATES", (bad, fault, MmaConfig(num_stages=3)))
    w = torch.zeros(64, 256, dtype=torch.bfloat16)
    w12 = types.SimpleNamespace(base=110, padded_k=256)
    cpu = torch.device("cpu")
    notes: list[str] = []
    row = ks._search_cell([w], [w12], [torch.zeros(4)], 1, CompileBudget(60.0), cpu, 1, None, notes)
    assert row.tried == 4 and row.config in (
        MmaConfig(num_stages=3),
        DEFAULT_TILINGS.config(1, 64, 256),
    )
    assert any("tiling" in n and "out of resource" in n and "not timed" in n for n in notes), notes
    assert any("decode not bit-exact" in n for n in notes), notes  # a wrong tiling is named too
    raising[DEFAULT_TILINGS.config(1, 64, 256)] = RuntimeError("out of resource")
    with pytest.raises(RuntimeError):  # the fallback itself must run
        ks._search_cell([w], [w12], [torch.zeros(4)], 1, CompileBudget(60.0), cpu, 1, None, [])
    del raising[DEFAULT_TILINGS.config(1, 64, 256)]
    raising[bad] = RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered")
    with pytest.raises(RuntimeError, match="illegal"):  # the device cannot be trusted after it
        ks._search_cell([w], [w12], [torch.zeros(4)], 1, CompileBudget(60.0), cpu, 1, None, [])


def test_search_covers_the_tree_widths_after_every_shape_at_the_chain_widths(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The tune's widths: 1, k + 1, then the tree seeds' verify widths where trees are searched;
    the search takes every shape at a width before any shape at the next, so a budget that runs
    out leaves the widest cells at their defaults (stand-ins for the cell's search: no GPU)."""
    import specpilot.tune.kernel_search as ks
    from specpilot.tune.kernel_measure import SearchRow

    assert ks.search_widths(7, {"mechanism:w12"}, "cuda") == [1, 8]
    assert ks.search_widths(7, {"mechanism:w12", "mechanism:tree-verify"}, "cuda") == [
        1,
        8,
        25,
        33,
        49,
    ]
    cells: list[tuple[int, int, int]] = []

    def cell(ws: list, w12s: list, counters: list, m: int, *a: object) -> SearchRow:
        n, k = ws[0].shape
        cells.append((n, k, m))
        return SearchRow((n, k), m, MmaConfig(), 1.0, 1.0, 1.0, 1, 0)

    monkeypatch.setattr(ks, "_search_cell", cell)
    g = torch.Generator().manual_seed(0)
    mats = {(64, 64): [torch.randn(64, 64, generator=g).to(torch.bfloat16)],
            (128, 64): [torch.randn(128, 64, generator=g).to(torch.bfloat16)]}  # fmt: skip
    ks.search_w12_mma(mats, [1, 8, 49], torch.device("cpu"), 600.0, None, log=lambda m: None)
    assert cells == [
        (64, 64, 1),
        (128, 64, 1),
        (64, 64, 8),
        (128, 64, 8),
        (64, 64, 64),
        (128, 64, 64),
    ]


def test_build_estimates_stop_a_candidate_that_would_overrun() -> None:
    dep = DeploymentSpec(target="t", drafter="block", device="cuda", dtype="bf16")
    fused = EngineConfig(deployment=dep, k=15, mechanisms={"fused-gemv": {"block_n": 16}})
    stock = EngineConfig(deployment=dep, k=15)
    mma = EngineConfig(deployment=dep, k=15, mechanisms={"w12": {"kernel": "mma"}})
    est = BuildEstimates([(json.loads(fused.to_json()), 83.0)])  # an earlier run's trial
    ok, why = est.fits([fused], 40.0)
    assert not ok and "83s" in why and "40s" in why
    assert est.fits([stock, mma], 40.0) == (True, "")  # kinds never seen: the generic check
    assert kind(mma) != kind(EngineConfig(deployment=dep, k=15, mechanisms={"w12": {}}))
    est.record(mma, 10.0)
    assert est.estimate(mma) == 10.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the search times kernels on a GPU")
def test_search_on_gpu_then_reuse(tmp_path: Path) -> None:
    from specpilot.tune.kernel_search import search_w12_mma

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    mats = {(512, 1024): [(0.02 * torch.randn(512, 1024, generator=g, device=dev)).to(torch.bfloat16) for _ in range(2)]}  # fmt: skip
    with MemoryStore(tmp_path / "m.sqlite") as store:
        first = search_w12_mma(mats, (1, 16), dev, 120.0, store, log=lambda m: None, rounds=1)
        second = search_w12_mma(mats, (1, 16), dev, 120.0, store, log=lambda m: None, rounds=1)
    assert len(first.rows) == 2 and all(not r.reused for r in first.rows)
    assert all(r.reused for r in second.rows)
    assert second.tilings.by_shape == first.tilings.by_shape
