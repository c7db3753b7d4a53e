"""L2 prefetch: the kernel's chunking (interpreted), the layer body's phase points, the mechanism's
hooks (engine tokens unchanged, hooks removable), its registry entry and its cost model.

On the CPU the prefetch itself is a no-op (``launch_mode`` ``none``) or, under the interpreter,
the kernel without its PTX; the CUDA test (skipped here) runs the real prefetches inside graphs.
"""

from __future__ import annotations

import importlib.util
import os
import random
import sys
import types
from pathlib import Path

import pytest
import torch

from conftest import run_interpreted, tiny_config, tiny_model
from engine_cases import repetitive_prompt, tokens
from specpilot.drafters import NgramDrafter
from specpilot.drafters.tree import TreeShape
from specpilot.engine import Engine, generate
from specpilot.engine.plans import TreePlan
from specpilot.errors import SpecPilotError
from specpilot.kernels.l2_prefetch import (
    PrefetchSpec,
    byte_range,
    launch_mode,
    num_chunks,
    prefetch_l2,
)
from specpilot.mechanisms import MECHANISMS
from specpilot.mechanisms.l2_prefetch import NEXT_MATRIX, PHASE_SETS, MiB, install, installed
from specpilot.mechanisms.l2_prefetch_cost import matrix_bytes, predict
from specpilot.models.layer import PHASE_POINTS
from specpilot.synthetic import TARGET_SHAPES
from specpilot.tune.space import directions_for, skipped_mechanisms

HAS_TRITON = importlib.util.find_spec("triton") is not None


# ---------------------------------------------------------------------- kernel
def test_byte_ranges_are_clipped_and_aligned():
    t = torch.zeros(10, 7)  # 280 bytes
    assert byte_range(t, 1000) == (0, 272)  # clipped to the tensor, rounded down to 16
    assert byte_range(t, 100, offset=20) == (16, 112)
    assert byte_range(t, 0) == (0, 0) and byte_range(t, 50, offset=400) == (272, 272)
    assert num_chunks(0, 272, PrefetchSpec("line")) == 3
    assert num_chunks(0, 272, PrefetchSpec("bulk", chunk=64)) == 5
    with pytest.raises(SpecPilotError, match="contiguous"):
        byte_range(t.t(), 16)
    with pytest.raises(SpecPilotError, match="instruction"):
        PrefetchSpec("l1")
    with pytest.raises(SpecPilotError, match="power of two"):
        PrefetchSpec("bulk", chunk=48)
    with pytest.raises(SpecPilotError, match="program"):
        PrefetchSpec("line", programs=0)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="checks the plain CPU path")
def test_nothing_is_launched_on_the_cpu():
    t = torch.zeros(64, 64)
    assert launch_mode(t.device) == "none"
    assert prefetch_l2(t, 4096, PrefetchSpec()) is None


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_interpreted_kernel_and_engine():
    """In a subprocess (the interpreter must be on before triton is imported): the kernel's trace
    covers each range exactly once, and an engine with the hooks runs the launch path."""
    out = run_interpreted([str(Path(__file__).resolve()), "interpret"], 200)
    assert "trace ok" in out and "engine ok" in out


def _check_trace(t: torch.Tensor, nbytes: int, offset: int, spec: PrefetchSpec) -> None:
    lo, hi = byte_range(t, nbytes, offset)
    n = num_chunks(lo, hi, spec)
    trace = torch.zeros((3, n), dtype=torch.int64)
    trace[:2] = -1
    prefetch_l2(t, nbytes, spec, offset, trace=trace)
    offs, sizes = trace[0].tolist(), trace[1].tolist()
    assert trace[2].tolist() == [1] * n, "a chunk was visited never or twice"
    assert offs == sorted(offs) and all(0 < s <= spec.chunk_bytes and s % 16 == 0 for s in sizes)
    pos = lo
    for o, s in zip(offs, sizes, strict=True):  # contiguous, no gap, no overlap
        assert o == pos, (o, pos)
        pos += s
    assert pos == hi


def _group_interpret() -> None:
    assert os.environ["TRITON_INTERPRET"] == "1"
    assert launch_mode(torch.device("cpu")) == "interpret"
    rng = random.Random(0)
    for _ in range(12):
        t = torch.zeros(rng.randint(1, 300), rng.randint(1, 90))
        spec = PrefetchSpec(
            rng.choice(("line", "bulk")), rng.randint(1, 5), chunk=rng.choice((0, 16, 256, 1024))
        )
        total = t.numel() * 4
        _check_trace(t, rng.randint(0, total + 100), rng.randint(0, total // 2), spec)
    # spanning several loop steps of several programs
    _check_trace(torch.zeros(400, 400), 640_000, 0, PrefetchSpec("line", programs=3))
    print("trace ok")
    cfg = tiny_config(arch="qwen3", vocab=113)
    target = tiny_model(cfg, 0)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9]]
    want = tokens(generate(Engine(target), prompts, 6))
    pf = install(target, phases="all", mb=1, stream="side", programs=2)
    assert tokens(generate(Engine(target, NgramDrafter(k=3)), prompts, 6)) == want
    assert pf.issued > 0 and pf.issued % (cfg.num_layers * 4) == 0
    print("engine ok")


# ---------------------------------------------------------------------- the plug point
def test_the_layer_body_calls_every_phase_point_in_order():
    cfg = tiny_config(layers=2)
    target = tiny_model(cfg, 0)
    seen: list[tuple[int, str]] = []
    for i, layer in enumerate(target.layers):
        for point in PHASE_POINTS:
            layer.phase_hooks[point] = lambda i=i, point=point: seen.append((i, point))
    want = tokens(generate(Engine(tiny_model(cfg, 0)), [[1, 2, 3]], 3))
    assert tokens(generate(Engine(target), [[1, 2, 3]], 3)) == want
    per_forward = [(i, p) for i in range(cfg.num_layers) for p in PHASE_POINTS]
    assert len(seen) % len(per_forward) == 0 and len(seen) >= len(per_forward)
    assert seen[: len(per_forward)] == per_forward
    assert set(NEXT_MATRIX) | set(NEXT_MATRIX.values()) == set(PHASE_POINTS)


# ---------------------------------------------------------------------- the mechanism
@pytest.mark.parametrize("seed", range(2))
def test_engine_tokens_are_unchanged_and_hooks_come_out(seed):
    """AR, chain and tree verify with the hooks installed equal AR without them (fp32)."""
    cfg = tiny_config(arch=("llama", "qwen2")[seed], vocab=101, tie=bool(seed))
    target = tiny_model(cfg, seed)
    rng = random.Random(seed)
    prompts = [repetitive_prompt(rng, cfg.vocab_size, rng.randint(2, 30)) for _ in range(3)]
    want = tokens(generate(Engine(target), prompts, 20))
    for phases, stream in (("all", "side"), ("attention+norms", "same"), ("mlp", "side")):
        pf = install(target, phases=phases, mb=2, stream=stream)
        n_points = len(PHASE_SETS[phases])
        assert len(pf.phases) == cfg.num_layers * n_points
        assert pf.side is None  # no side stream on the CPU
        assert tokens(generate(Engine(target), prompts, 20)) == want
        tree = TreePlan(shape=TreeShape.uniform(4, 2, 6))
        for plan in (None, tree):
            got = generate(Engine(target, NgramDrafter(k=4), plan=plan), prompts, 20)
            assert tokens(got) == want, (phases, plan)
        assert pf.issued > 0 and pf.issued % (cfg.num_layers * n_points) == 0
        assert installed(target) is pf
        pf.detach()
        assert all(not layer.phase_hooks for layer in target.layers)
        assert installed(target) is None
        issued = pf.issued
        generate(Engine(target), prompts, 4)
        assert pf.issued == issued  # detached: no hook runs
        pf.attach()
        generate(Engine(target), prompts, 4)
        assert pf.issued > issued
        pf.detach()


def test_prefetch_bytes_are_capped_by_the_matrix():
    cfg = tiny_config(layers=1)
    target = tiny_model(cfg, 0)
    pf = install(target, phases="all", mb=1)
    layer = target.layers[0]
    for p in pf.phases:
        assert p.nbytes == p.weight.numel() * 4 < MiB  # tiny matrices: the whole matrix
    assert {id(p.weight) for p in pf.phases} == {
        id(getattr(layer, m)) for m in ("w_qkv", "w_o", "w_gate_up", "w_down")
    }
    pf.detach()


def test_matrices_read_elsewhere_are_skipped_and_hooks_are_not_shared():
    target = tiny_model(tiny_config(layers=2), 0)
    for layer in target.layers:
        layer.linear_fns["w_gate_up"] = lambda x, b=None: x  # another storage (e.g. W12)
    pf = install(target, phases="all", mb=1)
    assert all(p.weight.shape[0] != 2 * target.cfg.intermediate_size for p in pf.phases)
    assert len(pf.phases) == 2 * 3
    pf.detach()
    target.layers[1].phase_hooks["attention"] = lambda: None
    with pytest.raises(SpecPilotError, match="already hooks"):
        install(target, phases="attention")
    assert not target.layers[0].phase_hooks  # nothing was installed


def test_registry_entry_and_tuner_direction(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # no GPU name to screen by
    mech = MECHANISMS["l2-prefetch"]
    assert mech.plug_point == "layer_phases" and mech.component == "mlp"
    assert mech.applies.allows("cuda", "bf16", "ngram", "single", "llama")
    assert mech.applies.allows("cuda", "fp32", "none", "batched", "qwen3")
    assert not mech.applies.allows("cpu", "fp32", "ngram", "single", "llama")
    knobs = mech.resolve_knobs({"mb": 16, "stream": "same"})
    assert knobs == {
        "phases": "all",
        "mb": 16,
        "stream": "same",
        "instruction": "auto",
        "programs": 8,
    }
    with pytest.raises(ValueError, match="phases"):
        mech.resolve_knobs({"phases": "lm_head"})
    with pytest.raises(ValueError, match="mb"):
        mech.resolve_knobs({"mb": 100})
    model = tiny_model(tiny_config(layers=2), 0)
    build = types.SimpleNamespace(target=types.SimpleNamespace(model=model), notes=[])
    mech.apply(build, knobs)  # type: ignore[arg-type]
    assert "l2-prefetch: 8 prefetches per forward" in build.notes[0]
    assert all(layer.phase_hooks for layer in model.layers)
    from specpilot.engine.config import DeploymentSpec, EngineConfig

    base = EngineConfig(DeploymentSpec(target="m", drafter="ngram", dtype="bf16"), k=4)
    assert "mechanism:l2-prefetch" in {d.name for d in directions_for(base, "cuda", "llama")}
    assert "mechanism:l2-prefetch" not in {d.name for d in directions_for(base, "cpu", "llama")}
    assert any(
        s.startswith("l2-prefetch: not for device cpu")
        for s in skipped_mechanisms(base, "cpu", "llama")
    )


@pytest.mark.parametrize(("gpu", "screened"), [("NVIDIA H200", True), ("NVIDIA H100 80GB", False)])
def test_the_tuner_skips_it_on_a_gpu_where_it_measured_a_loss(monkeypatch, gpu, screened):
    from specpilot.engine.config import DeploymentSpec, EngineConfig

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gpu)
    base = EngineConfig(DeploymentSpec(target="m", drafter="ngram", dtype="bf16"), k=4)
    searched = "mechanism:l2-prefetch" in {d.name for d in directions_for(base, "cuda", "llama")}
    skipped = [s for s in skipped_mechanisms(base, "cuda", "llama") if s.startswith("l2-prefetch")]
    assert searched is not screened
    assert bool(skipped) is screened
    if screened:
        assert "measured slower on this GPU (NVIDIA H200)" in skipped[0]
    cpu = EngineConfig(DeploymentSpec(target="m", drafter="ngram", dtype="bf16", device="cpu"), k=4)
    assert MECHANISMS["l2-prefetch"].screened_out(cpu) is None  # not a CUDA deployment


# ---------------------------------------------------------------------- cost model
def test_cost_model():
    cfg = TARGET_SHAPES["llama3-8b"]
    assert matrix_bytes(cfg, "w_qkv") == 6144 * 4096 * 2
    assert matrix_bytes(cfg, "w_gate_up") == 28672 * 4096 * 2
    bw, launch = 4.25e12, 2.5e-6
    side = predict(cfg, bw, launch, "all", mb=16, stream="side", context=512)
    for p in side.phases:
        assert p.prefetch_bytes == 16 * MiB
        assert p.saved_s == pytest.approx(min(16 * MiB / bw, p.window_s))
    # a long context keeps HBM busy during attention: no window there
    long = predict(cfg, bw, launch, "attention", mb=16, context=64_000)
    assert long.phases[0].window_s == 0.0 and long.saved_s == 0.0
    # few bytes: the saving is the fetch time; the same stream pays one launch for it
    small = predict(cfg, bw, launch, "norms", mb=1, stream="same")
    assert small.phases[0].saved_s == pytest.approx(MiB / bw - launch)
    # capped by the matrix, by L2, and by a measured window
    capped = predict(cfg, bw, launch, "attention", mb=48, l2_bytes=40 * MiB)
    assert capped.phases[0].prefetch_bytes == matrix_bytes(cfg, "w_o") == 32 * MiB
    assert predict(cfg, bw, launch, "mlp", mb=48, l2_bytes=40 * MiB).phases[0].prefetch_bytes == (
        40 * MiB
    )
    measured = predict(cfg, bw, launch, "attention", mb=32, windows={"attention": 1e-6})
    assert measured.saved_s == pytest.approx(cfg.num_layers * 1e-6)
    assert side.saved_s == pytest.approx(cfg.num_layers * sum(p.saved_s for p in side.phases))
    assert side.speedup(5e-3) == pytest.approx(5e-3 / (5e-3 - side.saved_s))


# ---------------------------------------------------------------------- CUDA
@pytest.mark.skipif(not torch.cuda.is_available(), reason="real prefetches need a GPU")
@pytest.mark.parametrize("stream", ["side", "same"])
def test_cuda_graphs_with_prefetch_equal_without(stream: str) -> None:
    """Inside CUDA graphs, with real prefetches on either stream: fp32 and bf16 tokens equal
    those of the same engine without the mechanism (its kernels are untouched)."""
    cfg = tiny_config(arch="qwen3", vocab=113, layers=3)
    for dtype in (torch.float32, torch.bfloat16):
        target = _cuda_model(cfg, dtype)
        rng = random.Random(7)
        prompts = [repetitive_prompt(rng, cfg.vocab_size, rng.randint(1, 40)) for _ in range(3)]
        want = tokens(generate(Engine(target), prompts, 40))
        pf = install(target, phases="all", mb=1, stream=stream, programs=2)
        for drafter in (None, NgramDrafter(k=4)):
            engine = Engine(target, drafter)
            assert tokens(generate(engine, prompts, 40)) == want, (dtype, drafter)
            assert engine.runner.captures > 0
        assert pf.issued > 0
        pf.detach()


def _cuda_model(cfg, dtype):
    from specpilot.models.transformer import Transformer

    model = Transformer(cfg, dtype=dtype, device="cuda")
    model.init_random(0, std=0.15)
    return model


if __name__ == "__main__":
    {"interpret": _group_interpret}[sys.argv[1]]()
