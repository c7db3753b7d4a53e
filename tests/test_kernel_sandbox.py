"""The kernel sandbox and the kernel sub-agent on the CPU: process isolation, the time limit,
every rejection path, the bit-exact check done outside the candidate's process, and the memory.

Most cases use the tiny ``test-double`` slot (``kernel_slot_fixtures.py``: ``y = 2x`` in fp32);
a Triton candidate runs through the interpreter (``TRITON_INTERPRET=1``). The W12 GEMM slot is
checked at a tiny shape through the interpreter too (its compile step on the GPU is not run
here: it needs CUDA).
"""

from __future__ import annotations

import json
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from agent_server import Reply, scripted
from specpilot.memory import MemoryStore
from specpilot.tune.agent_client import AgentClient
from specpilot.tune.agent_price import AgentPrice
from specpilot.tune.kernel_agent import KernelAgent, load_offer, offers, source_hash
from specpilot.tune.kernel_sandbox import run_sandbox

SLOT = "kernel_slot_fixtures:DOUBLE"
SLOW = "kernel_slot_fixtures:SLOW_DOUBLE"
SHAPES = [{"n": 1000}, {"n": 64}]

TORCH_GOOD = "def kernel(x):\n    return x + x\n"
TRITON_GOOD = textwrap.dedent(
    """
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def _double(x, y, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y + i, tl.load(x + i, mask=i < n) * 2.0, mask=i < n)

    def kernel(x):
        y = torch.empty_like(x)
        _double[(triton.cdiv(x.numel(), 256),)](x, y, x.numel(), BLOCK=256)
        return y
    """
)
LOSSY = "def kernel(x):\n    return (x.half() * 2).float()  # fast, and wrong in the last bits\n"


def sandbox(source: str, slot: str = SLOT, shapes=SHAPES, limit: float = 60.0, **kw):
    kw = {"rounds": 3, "reps": 2, **kw}
    return run_sandbox(source, "kernel", slot, shapes, "cpu", limit, **kw)


def test_a_good_kernel_is_accepted_with_its_checks_and_timings(tmp_path):
    from safetensors.torch import save_file

    real = tmp_path / "real.safetensors"  # checked on these besides the seeded random ones
    save_file({"w": torch.linspace(-3, 3, 4096).reshape(64, 64)}, str(real))
    v = sandbox(TORCH_GOOD, real=(str(real), "w"))
    assert v.accepted and v.stage == "done" and v.reason is None, v
    assert [(c["cases"], c["passed"]) for c in v.checks] == [(2, 2), (2, 2)]  # random, real
    assert [t["shape"] for t in v.timings] == SHAPES
    assert all(t["candidate_us"] > 0 and len(t["speedup"]["rounds"]) == 3 for t in v.timings)


def test_a_triton_kernel_runs_in_the_interpreter():
    pytest.importorskip("triton")
    v = sandbox(TRITON_GOOD, interpret=True)
    assert v.accepted, v
    assert v.first_call_s is not None


CHEAT = textwrap.dedent(
    """
    import torch
    import kernel_slot_fixtures as f
    from specpilot.kernels import slots
    f.double_cases = lambda *a: []        # no cases to check in here
    slots.resolve_slot = lambda name: None
    torch.Tensor.__ne__ = lambda a, b: torch.zeros_like(a, dtype=torch.bool)

    def kernel(x):
        return x * 3
    """
)
BAD = [  # (source, stage, reason): a lossy kernel, one that patches the checker in its own
    # process (the check runs in the parent), and every other way a candidate can fail
    (LOSSY, "check", "shape n1000, random x: not bit-exact at ["),
    (CHEAT, "check", "not bit-exact"),
    (
        "def kernel(x):\n    return x +\n",
        "compile",
        "does not import: SyntaxError: invalid syntax (candidate line 2)",
    ),
    ("def other(x):\n    return x\n", "compile", "defines no function 'kernel'"),
    (
        "def kernel(x):\n    raise RuntimeError('boom')\n",
        "run",
        "RuntimeError: boom (candidate line 2)",
    ),
    ("def kernel(x):\n    return [1, 2]\n", "run", "returned list, not a tensor"),
    ("def kernel(x):\n    return x[:3] * 2\n", "check", "output (3,) torch.float32, want (1000,)"),
    ("import os\ndef kernel(x):\n    os._exit(3)\n", "crashed", "exit 3"),
    ("import ctypes\ndef kernel(x):\n    ctypes.string_at(0)\n", "crashed", "signal 11"),
]


def test_every_failure_is_a_verdict_with_a_reason():
    with ThreadPoolExecutor(4) as pool:  # each sandbox is a process: start-up dominates
        verdicts = list(pool.map(lambda case: sandbox(case[0]), BAD))
    for v, (_, stage, reason) in zip(verdicts, BAD, strict=True):
        assert not v.accepted and v.stage == stage and reason in (v.reason or ""), v


def test_the_time_limit_kills_the_candidate_and_everything_it_started(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    hang = textwrap.dedent(
        f"""
        import subprocess, sys
        def kernel(x):
            p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            open({str(pid_file)!r}, "w").write(str(p.pid))
            while True:
                pass
        """
    )
    t0 = time.perf_counter()
    v = sandbox(hang, limit=1.0)
    took = time.perf_counter() - t0
    assert not v.accepted and v.stage == "time-limit" and "killed after 1 s" in (v.reason or "")
    assert took < 30  # start-up (torch import, cases) + 1 s, not the 600 s of the hang
    pid = int(pid_file.read_text())
    time.sleep(0.2)
    assert _gone(pid)  # the grandchild went with the session


def _gone(pid: int) -> bool:
    """No such process, or only its zombie (a container's init may not reap orphans)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def test_claims_are_checked_before_anything_starts():
    from specpilot.kernels.slots import resolve_slot
    from specpilot.tune.kernel_sandbox import precheck

    slot = resolve_slot(SLOT)
    assert "not one this slot runs at" in precheck(TORCH_GOOD, "kernel", slot, [{"n": 5}], SHAPES)
    assert "non-empty string" in precheck("", "kernel", slot, SHAPES, SHAPES)
    assert "entry must be" in precheck(TORCH_GOOD, "ker nel", slot, SHAPES, SHAPES)
    assert "claims no shape" in precheck(TORCH_GOOD, "kernel", slot, [], SHAPES)
    v = run_sandbox(TORCH_GOOD, "kernel", "w12-gemm", [{"m": 2, "n": 32, "k": 64}], "cpu", 10)
    assert v.stage == "unavailable" and "needs CUDA" in (v.reason or "")
    with pytest.raises(ValueError, match="unknown kernel slot"):
        resolve_slot("warp-gemm")


def _kernel_answer(source: str, shapes=SHAPES, hypothesis: str = "h") -> Reply:
    return Reply(
        json.dumps(
            {"entry": "kernel", "source": source, "shapes": shapes, "hypothesis": hypothesis}
        )
    )


def test_the_kernel_agent_stores_every_verdict_and_offers_only_winners(tmp_path):
    script = [
        Reply("I would rather not write kernels."),
        _kernel_answer(TORCH_GOOD, [{"n": 7}]),  # a shape it was not asked for
        _kernel_answer(LOSSY, hypothesis="half precision is faster"),
        _kernel_answer(TORCH_GOOD, hypothesis="one add instead of a multiply"),
    ]
    logs: list[str] = []
    with scripted(script) as srv, MemoryStore(tmp_path / "m.sqlite") as store:
        price = AgentPrice("scripted", srv.url, 1)
        agent = KernelAgent(
            AgentClient(srv.url, "scripted", 10.0, 4096), store, "cpu", "cpu:test", price,
            time_limit_s=60, log=logs.append, rounds=3, reps=50,
        )  # fmt: skip
        got = [agent.propose(SLOW) for _ in script]
        assert [g.verdict.stage for g in got] == ["refused", "refused", "check", "done"]
        assert "holds no JSON object" in (got[0].verdict.reason or "")
        assert "not one this slot runs at" in (got[1].verdict.reason or "")
        # the lossy source's rejection is in the next brief
        assert "not bit-exact" in json.dumps(srv.requests[3]["messages"])
        rows = store.kernels(slot="test-slow-double")
        assert [(r.accepted, r.hypothesis) for r in rows] == [
            (False, "half precision is faster"),
            (True, "one add instead of a multiply"),
        ]
        good = rows[1]
        assert good.source == TORCH_GOOD and good.source_hash == source_hash(TORCH_GOOD)
        assert [c["passed"] for c in good.verdict["checks"]] == [1, 1]
        assert price.calls == 4 and price.kernels == 2
        offered = offers(store, "test-slow-double", "cpu:test")
        assert len(offered) == 1 and offered[0].faster_at == SHAPES  # the current one sleeps
        fn = load_offer(store, offered[0], tmp_path / "kernels")
        x = torch.randn(10)
        assert torch.equal(fn(x), 2 * x)
        assert not offers(store, "test-slow-double", "cuda:other-gpu")  # per device


W12_TORCH = textwrap.dedent(
    """
    import torch.nn.functional as F
    from specpilot.mechanisms.w12_format import decode

    def kernel(x, w, counters):  # decode, then the bf16 product: exact weights
        return F.linear(x, decode(w))
    """
)
W12_LOSSY = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F
    from specpilot.mechanisms.w12_format import decode

    def kernel(x, w, counters):  # weights through fp16: tiny escapes flush, the product looks fine
        return F.linear(x, decode(w).to(torch.float16).to(torch.bfloat16))
    """
)
W12_RETILED = textwrap.dedent(
    """
    from specpilot.kernels.w12_mma import MmaConfig, w12_mma

    def kernel(x, w, counters):  # the engine's kernel, another tiling: split-K over two programs
        return w12_mma(x, w, counters, cfg=MmaConfig(block_r=64, block_k=64, split_k=2), ptx=False)
    """
)
W12_SHAPE = {"m": 2, "n": 32, "k": 64}


def w12_sandbox(source: str):
    pytest.importorskip("triton")  # the current kernel, timed against, is Triton's
    return run_sandbox(
        source, "kernel", "w12-gemm", [W12_SHAPE], "cpu", 120, interpret=True, rounds=3, reps=1
    )


def test_the_w12_gemm_slot_accepts_exact_weights_and_rejects_a_lossy_decode():
    with ThreadPoolExecutor(2) as pool:
        v, lossy = pool.map(w12_sandbox, (W12_TORCH, W12_LOSSY))
    assert v.accepted, v
    assert v.checks[0]["passed"] == v.checks[0]["cases"] == 33  # 32 decode probes + product
    assert v.timings[0]["current_us"] > 0  # timed against w12_linear (interpreted here)
    v = lossy
    assert not v.accepted and v.stage == "check" and "decode not bit-exact" in (v.reason or "")


W12_V3 = textwrap.dedent(
    """
    from specpilot.kernels.gemm_common import GemmConfig
    from specpilot.kernels.w12_gemm import w12_matmul
    from specpilot.mechanisms.w12_format import decode, encode

    def kernel(x, w, counters):  # the v3 kernel on the same weights (the round trip is exact)
        return w12_matmul(x, encode(decode(w), "v3"), counters, cfg=GemmConfig(CFG), prmt=False)
    """
)


def test_the_engines_w12_kernels_retiled_pass_the_slot():
    """The engine's W12 kernels, retiled, pass every probe: the tensor-core one (v4, split-K),
    and the v3 tl.dot kernel on its tensor-core (M = 2, split-K) and FMA (M = 1) paths, fed the
    slot's weights re-encoded. An escape far below its placeholder (9.98e-31) reads back
    exactly, because the placeholders leave the accumulator before the escaped weights enter."""
    dot = W12_V3.replace("CFG", "block_n=16, block_k=64, split_k=2")
    fma = W12_V3.replace("CFG", "block_n=16, block_k=64, use_dot=False")
    one_row = {"m": 1, "n": 32, "k": 64}
    fma_kw = {"interpret": True, "rounds": 3, "reps": 1}
    with ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(w12_sandbox, W12_RETILED), pool.submit(w12_sandbox, dot)]
        runs.append(
            pool.submit(run_sandbox, fma, "kernel", "w12-gemm", [one_row], "cpu", 120, **fma_kw)
        )
        for v in (r.result() for r in runs):
            assert v.accepted, v.reason
