"""From the kernel sub-agent to the engine: a scripted agent's W12 kernels, judged by the sandbox,
taken by the kernel search as candidates (re-checked at the target's shapes, timed, chosen),
reused by a second search over the same memory (searched again where a stored offer fails its
re-check), and run by the engine's W12 linear, loaded from the memory (``kernels/offers.py``).

The search and the engine run through the Triton interpreter in a subprocess
(``run_interpreted``, ``TRITON_INTERPRET=1`` before triton imports); the search's timer is a
test hook that makes the good offer the fastest (half the tilings' time), so the choice is
deterministic, not a measurement.
"""

from __future__ import annotations

import json
import sys
import textwrap
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import run_interpreted
from specpilot.kernels.offers import KernelOffers, OfferRef

GOOD = textwrap.dedent(
    """
    import torch.nn.functional as F
    from specpilot.mechanisms.w12_format import decode

    CALLS = [0]

    def kernel(x, w, counters):  # decode, then the bf16 product: exact weights
        CALLS[0] += 1
        return F.linear(x, decode(w))
    """
)
LOSSY = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F
    from specpilot.mechanisms.w12_format import decode

    def kernel(x, w, counters):  # weights through fp16: tiny escapes flush
        return F.linear(x, decode(w).to(torch.float16).to(torch.bfloat16))
    """
)
SNEAKY = textwrap.dedent(
    """
    import os
    import torch
    import torch.nn.functional as F
    from specpilot.mechanisms.w12_format import decode

    with open(MARKER, "a") as f:  # every process that imports this source says so
        f.write(f"{os.getpid()}\\n")

    def kernel(x, w, counters):  # exact at the slot's shape (N = 32), lossy where N > 32
        d = decode(w)
        if w.shape[0] > 32:
            d = d.to(torch.float16).to(torch.bfloat16)
        return F.linear(x, d)
    """
)
SLOT_SHAPE = {"m": 2, "n": 32, "k": 64}


def test_an_offer_goes_from_the_agent_through_the_search_to_the_engine(tmp_path: Path) -> None:
    out = run_interpreted([str(Path(__file__).resolve()), "flow", str(tmp_path)], timeout=400)
    assert "flow ok" in out, out


def test_offers_in_the_engine_config_and_what_the_memory_refuses(tmp_path: Path) -> None:
    import types

    from specpilot.engine.config import EngineConfig
    from specpilot.engine.deployment import DeploymentSpec
    from specpilot.kernels.offers import source_hash
    from specpilot.memory import MemoryStore

    mem = tmp_path / "m.sqlite"
    with MemoryStore(mem) as store:
        ok = store.add_kernel("w12-gemm", "dev", source_hash(GOOD), "kernel", GOOD,
                              [SLOT_SHAPE], {"accepted": True}, "h")  # fmt: skip
        bad = store.add_kernel("w12-gemm", "dev", source_hash(LOSSY), "kernel", LOSSY,
                               [SLOT_SHAPE], {"accepted": False}, "h")  # fmt: skip
    good_ref = OfferRef("w12-gemm", "dev", source_hash(GOOD), "kernel", ok)
    cells = {
        (64, 64, 1): good_ref,
        (64, 64, 4): OfferRef("w12-gemm", "dev", source_hash(LOSSY), "kernel", bad),
        (96, 64, 1): OfferRef("w12-gemm", "dev", source_hash(LOSSY), "kernel", ok),  # wrong hash
    }
    dep = DeploymentSpec(target="t", drafter="none", device="cpu", dtype="bf16")
    cfg = EngineConfig(deployment=dep, k=0, kernels={"w12_offers": KernelOffers(str(mem), cells).to_json()})  # fmt: skip
    offers = EngineConfig.from_dict(json.loads(cfg.to_json())).kernel_offers()
    assert offers is not None and offers.cells == cells
    fns, notes = offers.load(tmp_path / "kernels")
    assert list(fns) == [(64, 64, 1)]  # only the source the memory holds as accepted
    assert len(notes) == 2 and all("not accepted in the memory" in n for n in notes)
    assert fns[(64, 64, 1)].__module__.startswith("kernel_w12_gemm_")
    gone = KernelOffers(str(tmp_path / "missing.sqlite"), cells).load()
    assert gone[0] == {} and "no memory" in gone[1][0]

    # no kernel search here (the CPU): the kernel agent is not asked, and the report says so
    from specpilot.tune.kernel_search import search_for_tune

    notes: list[str] = []
    asked: list[object] = []
    executor = types.SimpleNamespace(arch="llama", num_layers=2)
    got = search_for_tune(None, cfg, executor, torch.device("cpu"), 300.0, None, notes, {}, asked.append)  # fmt: skip
    assert got == (None, 0.0) and not asked and "kernel agent: not asked" in notes[0]


# ------------------------------------------------------------ in the interpreter (subprocess)
def _flow(tmp: Path) -> None:
    import os
    import types

    from agent_server import Reply, scripted
    from conftest import tiny_config, torch_small_ops
    from specpilot.engine import Engine, generate
    from specpilot.engine.config import EngineConfig
    from specpilot.engine.deployment import DeploymentSpec
    from specpilot.mechanisms import MECHANISMS
    from specpilot.memory import MemoryStore
    from specpilot.memory.fingerprint import gpu_fingerprint
    from specpilot.models.transformer import Transformer
    from specpilot.tune import kernel_search as ks
    from specpilot.tune.agent_client import AgentClient
    from specpilot.tune.agent_price import AgentPrice
    from specpilot.tune.kernel_agent import (
        KernelAgent,
        ask_for_kernels,
        load_offer,
        offers,
        source_hash,
    )

    marker = tmp / "sneaky-imports.txt"
    sneaky = f"MARKER = {str(marker)!r}\n" + SNEAKY
    cpu = torch.device("cpu")
    key = gpu_fingerprint(cpu)["key"]

    def answer(source: str, shapes: list | None = None) -> Reply:
        return Reply(json.dumps({"entry": "kernel", "source": source, "shapes": shapes,
                                 "hypothesis": "h"}))  # fmt: skip

    cfg = tiny_config()  # o: [64, 64], gate_up: [288, 64]
    stock = Transformer(cfg, dtype=torch.bfloat16, max_positions=256)
    stock.init_random(0, std=0.1)
    mats = {s: ws for s, ws in ks.target_matrices(stock, copies=2).items() if s in ((64, 64), (288, 64))}  # fmt: skip
    script = [answer(GOOD), answer(LOSSY, [SLOT_SHAPE]), answer(sneaky, [SLOT_SHAPE])]
    with scripted(script) as srv, MemoryStore(tmp / "m.sqlite") as store:
        client = AgentClient(srv.url, "scripted", 30.0, 4096)
        price = AgentPrice("scripted", srv.url, 1)
        # tune --kernel-agent 1: at the target's shapes (no claim: every one asked), real weights
        first = ask_for_kernels(client, store, price, cpu, mats, (1, 3), 1, 120.0, lambda m: None)
        assert first[0].verdict.accepted, first[0].verdict
        assert [c["shape"] for c in first[0].verdict.checks] == [{"m": m, "n": n, "k": 64} for n in (64, 288) for m in (1, 3)]  # fmt: skip
        assert all(c["cases"] == c["passed"] > 2 for c in first[0].verdict.checks)
        agent = KernelAgent(
            client, store, "cpu", key, price, time_limit_s=120, interpret=True,
            log=lambda m: None, rounds=3, reps=1,
        )  # fmt: skip
        got = [first[0].verdict, *(agent.propose("w12-gemm", [SLOT_SHAPE]).verdict for _ in range(2))]  # fmt: skip
        assert price.kernels == 3 and price.blocked_seconds > 0  # priced as the team's calls
        # (b) the lossy kernel: rejected by the sandbox, never an offer, never loadable
        assert [v.accepted for v in got] == [True, False, True], got
        assert "decode not bit-exact" in (got[1].reason or "")
        offered = offers(store, "w12-gemm", key)
        assert [o.source_hash for o in offered] == [source_hash(GOOD), source_hash(sneaky)]
        lossy_row = store.kernels(slot="w12-gemm", accepted=False)[0]
        with pytest.raises(ValueError, match="not accepted"):
            load_offer(store, types.SimpleNamespace(slot="w12-gemm", device=key, source_hash=lossy_row.source_hash, entry="kernel", row=lossy_row.id), tmp / "k")  # fmt: skip

        # the search: no tilings beyond the default (the interpreter is slow), no K splits
        # (CUDA), and a timer that makes the good offer twice as fast as every tiling
        def timer(calls: list, device: torch.device, reps: int = 4) -> float:
            mod = getattr(calls[0].func, "__module__", "")
            return 0.5e-6 if mod.startswith("kernel_w12_gemm_") else 1e-6

        ks.CANDIDATES = ()
        ks.split_variants = lambda *a, **k: []
        ks.graph_time = timer
        result = ks.search_w12_mma(mats, (1, 3), cpu, 600.0, store, log=lambda m: None, rounds=1)
        assert str(os.getpid()) not in marker.read_text().split()  # (b) never ran in here
        assert len(marker.read_text().split()) >= 2  # the sandboxes did import it
        assert any("failed its re-check at 64x64" in n and "decode not bit-exact" in n for n in result.notes), result.notes  # fmt: skip
        print("\n".join(result.lines()))  # the report's lines (the test's timer: not a measurement)
        cells = json.loads(json.dumps(result.to_dict()))["cells"]  # as run.json holds them
        assert len(cells) == 4 and all(c["kernel"] == f"offer {source_hash(GOOD)}" for c in cells), cells  # fmt: skip
        assert all(c["speedup_vs_default"] == 2.0 and c["device_s"] > 0 for c in cells)
        assert all(f"agent offer {source_hash(GOOD)}" in r.line() for r in result.rows)
        assert result.offers is not None and set(result.offers.cells) == {(n, k, m) for n, k in mats for m in (1, 4)}  # fmt: skip
        stored = store.tilings(key, "w12_mma")
        assert all(v["metrics"]["offer"]["source_hash"] == source_hash(GOOD) for v in stored.values())  # fmt: skip
        assert all(v["metrics"]["offer_check"]["widths"] == [1, 3, 4] for v in stored.values())
        _search_again(ks, mats, store, result, offered[1].ref(), marker)

    # the engine: the config carries the choice; the W12 linear loads the offer from the memory
    dep = DeploymentSpec(target="t", drafter="none", device="cpu", dtype="bf16")
    kernels = {"w12_mma": result.tilings.to_json(), "w12_offers": result.offers.to_json()}
    conf = EngineConfig.from_dict(json.loads(EngineConfig(deployment=dep, k=0, kernels=kernels).to_json()))  # fmt: skip
    model = Transformer(cfg, dtype=torch.bfloat16, max_positions=256)
    model.load_state_dict(stock.state_dict())
    build = types.SimpleNamespace(
        target=types.SimpleNamespace(model=model), kernel_tilings=conf.mma_tilings(),
        kernel_offers=conf.kernel_offers(), notes=[],
    )  # fmt: skip
    w12 = MECHANISMS["w12"]
    w12.apply(build, w12.resolve_knobs({"kernel": "mma", "max_m": 64, "layers": "all"}))  # type: ignore[arg-type]
    assert any("agent kernels in 4 cell(s)" in n for n in build.notes), build.notes
    lin = model.layers[0].linear_fns["w_o"]
    fn = lin.offers[1]
    assert set(lin.offers) == {1, 4} and not model.layers[0].linear_fns["w_qkv"].offers
    seq = [3, 17, 5]
    via_offer = generate(torch_small_ops(Engine(model)), [seq], 5)[0].tokens
    via_stock = generate(torch_small_ops(Engine(stock)), [seq], 5)[0].tokens
    assert fn.__globals__["CALLS"][0] >= 5 * 4, fn.__globals__["CALLS"]  # 2 layers x o, gate_up
    assert via_offer == via_stock, (via_offer, via_stock)
    assert str(os.getpid()) not in marker.read_text().split()
    print("flow ok")


def _search_again(ks: Any, mats: dict, store: Any, first: Any, sneaky: OfferRef, marker: Path) -> None:  # fmt: skip
    """A second search over the same memory re-uses the cells the good offer won: no sandbox
    (its pass at these shapes, widths and weights is in the memory), no sweep, three timings a
    cell; then a stored offer that fails its re-check, and one whose source the memory no
    longer holds, are searched again (with the test's timer: counts, not a measurement)."""
    import os
    from dataclasses import asdict

    from specpilot.kernels.offers import source_hash
    from specpilot.memory.fingerprint import gpu_fingerprint
    from specpilot.tune import kernel_sandbox

    sandboxed: list[str] = []
    timed: list[object] = []
    real_sandbox, real_timer = kernel_sandbox.run_sandbox, ks.graph_time

    def sandbox(source: str, *a: Any, **kw: Any) -> Any:
        sandboxed.append(source_hash(source))
        return real_sandbox(source, *a, **kw)

    def timer(calls: list, device: torch.device, reps: int = 4) -> float:
        timed.append(calls[0].func)
        return real_timer(calls, device, reps)

    kernel_sandbox.run_sandbox, ks.graph_time = sandbox, timer
    good, cpu = source_hash(GOOD), torch.device("cpu")
    second = ks.search_w12_mma(mats, (1, 3), cpu, 600.0, store, log=lambda m: None, rounds=1)
    assert [(r.reused, r.tried, r.offer) for r in second.rows] == [(True, 0, good)] * 4, second.lines()  # fmt: skip
    assert sandboxed == [] and sum("not run again" in n for n in second.notes) == 2, second.notes
    assert len(timed) == 3 * 4  # per cell the offer, the default and cuBLAS once (a search: 5)
    assert second.offers is not None and second.offers.cells == first.offers.cells
    assert second.device_s <= 0.1 * first.device_s, (second.device_s, first.device_s)

    gpu = gpu_fingerprint(cpu)
    stored = store.tilings(gpu["key"], ks.KERNEL)
    for cell, ref in (((64, 64, 1), sneaky), ((288, 64, 4), replace(second.offers.cells[(288, 64, 4)], row=9999))):  # fmt: skip
        hit = stored[cell]  # the good offer's pass stays in the record: it names its source
        store.put_tiling(gpu, ks.KERNEL, cell[:2], cell[2], hit["config"], {**hit["metrics"], "offer": asdict(ref)})  # fmt: skip
    sandboxed.clear()
    third = ks.search_w12_mma(mats, (1, 3), cpu, 600.0, store, log=lambda m: None, rounds=1)
    rows = {(*r.shape, r.width): r for r in third.rows}
    assert [c for c, r in rows.items() if not r.reused] == [(64, 64, 1), (288, 64, 4)], third.lines()  # fmt: skip
    assert all(r.offer == good for r in rows.values()) and rows[(64, 64, 1)].tried == 2
    assert sandboxed == [sneaky.source_hash, good, sneaky.source_hash], sandboxed
    notes = "\n".join(third.notes)
    assert f"64x64 M<=1: the stored winner, agent offer {sneaky.source_hash}, did not pass its re-check (above); searching again" in notes, notes  # fmt: skip
    assert f"offer {sneaky.source_hash}: failed its re-check at 64x64" in notes
    assert f"288x64 M<=4: the stored winner, agent offer {good}, did not pass" in notes
    assert f"offer {good}: kernel {good} of w12-gemm is not accepted in the memory" in notes
    assert str(os.getpid()) not in marker.read_text().split()  # never imported in here
    assert all(v["metrics"]["offer"]["row"] != 9999 for v in store.tilings(gpu["key"], ks.KERNEL).values())  # fmt: skip
    kernel_sandbox.run_sandbox, ks.graph_time = real_sandbox, real_timer
    print(f"kernel seconds: first search {first.device_s:.2f}, second {second.device_s:.3f} "
          f"({100 * second.device_s / first.device_s:.1f}%), third (2 of 4 cells searched "
          f"again) {third.device_s:.2f}")  # fmt: skip


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    {"flow": _flow}[sys.argv[1]](Path(sys.argv[2]))
