"""Fused decode GEMVs: the prologues (RMSNorm, SiLU·mul) and the residual epilogue against the
unfused torch composition, the engine with the mechanism (spec == AR == unfused), its registry
entry, install checks and its cost model.

Kernel checks run in a subprocess (``python tests/test_fused_gemv.py <group>``) because the
Triton interpreter must be switched on before triton is imported.

How "equal" is checked: a prologue alone is read back through an identity weight (each output is
one exact product ``x'·1``), so it is compared value for value with the torch reference; a fused
GEMV is compared bit for bit with the unfused bf16 GEMV applied to that prologue's output (the
same kernel, so the same fp32 summation order), and against the torch composition (another
summation order) within ``w12_gemm``'s bound ``2^-8 |y| + K·2^-23·Σ|x||w|``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from conftest import run_interpreted, tiny_config, tiny_model, torch_small_ops
from specpilot.errors import SpecPilotError
from specpilot.mechanisms import MECHANISMS

ROOT = Path(__file__).resolve().parents[1]


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 ulps between two bf16 tensors of finite values (same-sign ordering)."""

    def key(t: torch.Tensor) -> torch.Tensor:
        i = t.view(torch.int16).to(torch.int32)
        return torch.where(i < 0, -(i & 0x7FFF), i)

    return (key(a) - key(b)).abs()


def _error_ratio(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, add: torch.Tensor) -> float:
    """max |y - exact| / (half a bf16 ulp + K·2^-23·Σ|x||w|) with ``add`` the bias or residual."""
    xd, wd = x.double(), w.double()
    z = xd @ wd.T + add.double()
    bound = 2.0**-8 * z.abs() + x.shape[1] * 2.0**-23 * (xd.abs() @ wd.abs().T) + 2.0**-133
    return float(((y.double() - z).abs() / bound).max())


def _with_escapes(w: torch.Tensor, seed: int) -> torch.Tensor:
    """``w`` with a few values outside any 15-exponent window (W12 escapes), several per row."""
    g = torch.Generator().manual_seed(seed)
    out = w.clone()
    idx = torch.randperm(w.numel(), generator=g)[: max(4, w.numel() // 40)]
    vals = torch.tensor([3.0, -2.5, 1e-30, 0.0], dtype=w.dtype)
    out.view(-1)[idx] = vals[torch.arange(len(idx)) % len(vals)]
    return out


# ---------------------------------------------------------------- interpreter (subprocess)
@pytest.mark.parametrize("fmt", ["bf16", "w12"])
def test_kernels_match_the_unfused_composition_in_interpreter(fmt: str) -> None:
    out = run_interpreted([str(Path(__file__).resolve()), "kernels", fmt], 180)
    assert "kernels ok" in out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_engine_with_fused_gemvs_in_interpreter(arch: str) -> None:
    """bf16 engine tokens with the fused kernels equal those of the torch composition of the
    same steps, AR and spec (see :class:`ComposedSteps`)."""
    out = run_interpreted([str(Path(__file__).resolve()), "engine", arch], 180)
    assert "engine ok" in out


def _group_kernels(fmt: str) -> None:
    """``fmt`` bf16: the prologues, the fused bf16 GEMVs, bad input; w12: the fused W12 GEMVs."""
    from specpilot.kernels import reference
    from specpilot.kernels.fused_gemv import (
        norm_gemv,
        norm_linear_ref,
        residual_gemv,
        silu_gemv,
        silu_linear_ref,
    )
    from specpilot.kernels.gemm_common import counter_buffer
    from specpilot.kernels.w12_gemv import GemvConfig, bf16_gemv, w12_gemv
    from specpilot.mechanisms.w12_format import decode, encode

    cases = [  # (M, N, K, config): ragged K and N, split-K on and off, M = 1..4
        (1, 48, 96, GemvConfig(block_n=16, block_k=64)),
        (2, 32, 128, GemvConfig(block_n=32, block_k=64, split_k=2)),
        (3, 40, 72, GemvConfig(block_n=16, block_k=64, split_k=1)),
        (4, 16, 192, GemvConfig(block_n=16, block_k=64, split_k=3)),
    ]
    eps = 1e-5
    for i, (m, n, k, cfg) in enumerate(cases):
        g = torch.Generator().manual_seed(i)
        x = (3 * torch.randn(m, k, generator=g)).to(torch.bfloat16)
        nw = (1 + 0.2 * torch.randn(k, generator=g)).to(torch.bfloat16)
        w = (0.1 * torch.randn(n, k, generator=g)).to(torch.bfloat16)
        bias = torch.randn(n, generator=g).to(torch.bfloat16)
        res = torch.randn(m, n, generator=g).to(torch.bfloat16)
        gate_up = (2 * torch.randn(m, 2 * k, generator=g)).to(torch.bfloat16)
        eye = torch.eye(k, dtype=torch.bfloat16)
        c_eye, c = counter_buffer(k, x.device), counter_buffer(n, x.device)
        # the prologues alone, read back through the identity
        xn = norm_gemv(x, nw, eps, eye, c_eye, cfg=cfg)  # [M, K]
        act = silu_gemv(gate_up, eye, c_eye, cfg=cfg)
        for got, want in (
            (xn, reference.rms_norm_ref(x, nw, eps)),
            (act, reference.silu_mul_ref(gate_up)),
        ):
            d = _ulps(got, want)
            # same rounding steps; fp32 sum order of the statistics (and exp) may move one ulp
            assert int(d.max()) <= 1 and float((d > 0).float().mean()) <= 0.02, (i, d.max())
        if fmt == "bf16":
            # fused == unfused GEMV of the prologue's output, bit for bit (same kernel, same order)
            y_norm = norm_gemv(x, nw, eps, w, c, bias, cfg=cfg)
            assert torch.equal(y_norm, bf16_gemv(xn, w, c, bias, cfg=cfg)), i
            y_silu = silu_gemv(gate_up, w[:, :k], c, residual=res, cfg=cfg)
            y_res = residual_gemv(act, w[:, :k], c, res, cfg=cfg)
            assert torch.equal(y_silu, y_res), i
            assert torch.equal(silu_gemv(gate_up, w, c, cfg=cfg), bf16_gemv(act, w, c, cfg=cfg)), i
            # against the torch composition: fp32 summation order only
            assert _error_ratio(y_norm, xn, w, bias) <= 1.0, i
            assert _error_ratio(y_res, act, w, res) <= 1.0, i
            ref = norm_linear_ref(x, nw, eps, w, bias)
            assert int(_ulps(y_norm, ref).max()) <= 2, i
            assert int(_ulps(y_silu, silu_linear_ref(gate_up, w, res)).max()) <= 2, i
            assert int(c.abs().sum()) == 0 and int(c_eye.abs().sum()) == 0, "counters re-arm"
        if fmt != "w12":
            continue
        # W12 weights with escapes (gathered activations go through the prologue too): equal
        # to the W12 GEMV of the prologue's output, bit for bit
        t = encode(_with_escapes(w, i))
        assert t.num_escapes > 0
        assert torch.equal(norm_gemv(x, nw, eps, t, c, bias, cfg=cfg), w12_gemv(xn, t, c, bias, cfg=cfg)), i  # fmt: skip
        tk = encode(_with_escapes(w[:, :k].contiguous(), i))
        y12 = silu_gemv(gate_up, tk, c, residual=res, cfg=cfg)
        assert torch.equal(y12, residual_gemv(act, tk, c, res, cfg=cfg)), i
        assert _error_ratio(y12, act, decode(tk), res) <= 1.0, i
    if fmt == "w12":
        print("kernels ok")
        return
    # bad input: a clear error, not a wrong answer
    x, w = torch.ones(1, 64, dtype=torch.bfloat16), torch.ones(16, 64, dtype=torch.bfloat16)
    c = counter_buffer(16, x.device)
    for call, msg in (
        (lambda: residual_gemv(x, w, c, torch.ones(2, 16, dtype=torch.bfloat16)), "residual"),
        (lambda: norm_gemv(x, torch.ones(63, dtype=torch.bfloat16), 1e-5, w, c), "norm weight"),
        (lambda: silu_gemv(x, w, c), "gate_up"),
        (lambda: norm_gemv(torch.ones(5, 64, dtype=torch.bfloat16), x[0], 1e-5, w, c), "rows"),
    ):
        with pytest.raises(ValueError, match=msg):
            call()
    print("kernels ok")


class ComposedSteps:
    """The unfused steps the mechanism replaces, as the torch composition (``reference`` RMSNorm
    and SiLU·mul, ``F.linear``, ``addmm``'s one-rounding residual), behind the same seam.

    Why not the engine's own unfused Triton path: under the interpreter ``decode_triton``'s
    RMSNorm and SiLU·mul round with the interpreter's bf16 cast, which is not round-to-nearest-even
    (it differs from ``reference`` in most elements; on a GPU the cast is RNE), so tokens would
    differ for that reason alone. Everything else the engine runs is the same in both."""

    def __init__(self, layer: object, names: tuple[str, ...], max_m: int, eps: float) -> None:
        self.layer, self.names, self.max_m, self.eps = layer, names, max_m, eps

    def takes(self, name: str, rows: int) -> bool:
        return name in self.names and rows <= self.max_m

    def norm_linear(self, name, x, norm_weight, bias):  # type: ignore[no-untyped-def]
        from specpilot.kernels.fused_gemv import norm_linear_ref

        return norm_linear_ref(x, norm_weight, self.eps, getattr(self.layer, name), bias)

    def linear_residual(self, name, x, a):  # type: ignore[no-untyped-def]
        return torch.addmm(x, a, getattr(self.layer, name).t())

    def silu_linear_residual(self, name, x, gate_up):  # type: ignore[no-untyped-def]
        from specpilot.kernels.fused_gemv import silu_linear_ref

        return silu_linear_ref(gate_up, getattr(self.layer, name), x)


def _group_engine(arch: str) -> None:
    """llama: AR (M = 2) and chain verify (M = 4) through the fused kernels; qwen2 (the qkv bias
    rides on the fused norm GEMV): AR, then with W12 on qkv and gate_up (fused in W12's GEMV).
    RoPE and the norms the GEMVs do not take run on torch (``torch_small_ops``)."""
    from engine_cases import tokens
    from specpilot.drafters import NgramDrafter
    from specpilot.engine import Engine, generate
    from specpilot.mechanisms.fused_gemv import MATRIX_SETS, install
    from specpilot.mechanisms.w12 import install as install_w12
    from specpilot.models.transformer import Transformer

    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 3]]
    cfg = tiny_config(arch=arch, vocab=101, layers=2)
    target = Transformer(cfg, dtype=torch.bfloat16)
    target.init_random(3, std=0.15)
    for layer in target.layers:
        layer.fused_steps = ComposedSteps(layer, MATRIX_SETS["all"], 4, cfg.rms_norm_eps)
    composed = tokens(generate(torch_small_ops(Engine(target, fuse_residual=True)), prompts, 4))
    fused = install(target, "all", max_m=4, block_n=64, block_k=64)
    ar = tokens(generate(torch_small_ops(Engine(target, fuse_residual=True)), prompts, 4))
    assert ar == composed, (arch, ar, composed)
    calls = sum(f.calls for f in fused)
    assert calls >= 3 * cfg.num_layers * 4, calls  # every AR step (M = 2) went through them
    # prefill rows (> max_m) never reach the fused kernels; nor does the stock forward
    target(torch.tensor([prompts[1]]), target.allocate_cache(1, 32))  # M = 2, stock
    assert sum(f.calls for f in fused) == calls
    if arch == "llama":  # spec: one prompt, k = 3 -> verify rows M = 4, fused too
        spec = tokens(generate(torch_small_ops(Engine(target, NgramDrafter(k=3))), prompts[:1], 4))
        assert spec == ar[:1] and sum(f.calls for f in fused) > calls, (spec, ar)
    else:  # W12 on qkv and gate_up: their norms fused into the W12 GEMV (M = 2: W12's GEMV)
        install_w12(target, layers="gate_up_qkv", max_m=4)
        both = tokens(generate(torch_small_ops(Engine(target, fuse_residual=True)), prompts, 3))
        assert sum(f.calls for f in fused) - calls == 2 * cfg.num_layers * 4  # 2 AR steps
        assert sum(f.w12_calls for f in fused) == 2 * cfg.num_layers * 2
        assert both == [t[:3] for t in ar], (both, ar)
    print("engine ok")


# ---------------------------------------------------------------- registry, install, cost
def test_registry_entry_and_tuner_direction() -> None:
    mech = MECHANISMS["fused-gemv"]
    assert mech.plug_point == "kernel_choice" and mech.component == "overhead"
    assert mech.applies.allows("cuda", "bf16", "ngram", "single", "llama")
    assert not mech.applies.allows("cuda", "fp32", "ngram", "single", "llama")
    assert not mech.applies.allows("cpu", "bf16", "ngram", "single", "llama")
    knobs = mech.resolve_knobs({"max_m": 4, "matrices": "o_down"})
    assert knobs == {
        "matrices": "o_down",
        "max_m": 4,
        "block_n": 16,
        "block_k": 1024,
        "num_warps": 4,
        "pdl": True,
    }
    with pytest.raises(ValueError, match="max_m"):
        mech.resolve_knobs({"max_m": 3})
    from specpilot.engine.config import DeploymentSpec, EngineConfig
    from specpilot.tune.space import directions_for

    base = EngineConfig(DeploymentSpec(target="m", drafter="ngram", dtype="bf16"), k=4)
    assert "mechanism:fused-gemv" in {d.name for d in directions_for(base, "cuda", "llama")}
    assert "mechanism:fused-gemv" not in {d.name for d in directions_for(base, "cpu", "llama")}


def test_install_refuses_what_it_cannot_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    from specpilot.mechanisms.fused_gemv import install

    model = tiny_model(tiny_config(), 0)  # fp32
    with pytest.raises(SpecPilotError, match="bf16"):
        install(model)
    build = types.SimpleNamespace(target=types.SimpleNamespace(model=model), notes=[])
    with pytest.raises(SpecPilotError, match="bf16"):
        MECHANISMS["fused-gemv"].apply(build, MECHANISMS["fused-gemv"].resolve_knobs({}))  # type: ignore[arg-type]
    from specpilot.models.transformer import Transformer

    bf = Transformer(tiny_config(), dtype=torch.bfloat16)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")
    with pytest.raises(SpecPilotError, match="max_m"):
        install(bf, max_m=8)
    with pytest.raises(SpecPilotError, match="tiling"):
        install(bf, block_n=24)
    with pytest.raises(SpecPilotError, match="matrices"):
        install(bf, matrices="lm_head")
    assert all(layer.fused_steps is None for layer in bf.layers)


def test_cost_model() -> None:
    from specpilot.mechanisms.fused_gemv_cost import H200_KERNELS, KernelCosts, predict
    from specpilot.synthetic import TARGET_SHAPES

    cfg = TARGET_SHAPES["llama3-8b"]
    bw = 4.25e12
    costs = KernelCosts(rms_norm_s=2e-6, silu_mul_s=1.5e-6, reduce_s=1.8e-6, gap_s=0.5e-6)
    p = predict(cfg, bw, "all", costs=costs, l2_Bps=1e30)
    by = {m.matrix: m for m in p.matrices}
    assert by["w_qkv"].kernels_s == pytest.approx(2.5e-6)  # the input norm and its gap
    assert by["w_o"].kernels_s == pytest.approx(2.3e-6)  # cuBLAS's split-K reduce
    assert by["w_down"].kernels_s == pytest.approx(2.0e-6 + 2.3e-6)  # SiLU·mul and a reduce
    assert p.kernels_removed == 32 * 5
    assert p.saved_s == pytest.approx(32 * (2.5 + 2.3 + 2.5 + 4.3) * 1e-6, rel=1e-6)
    assert p.speedup(5e-3) == pytest.approx(5e-3 / (5e-3 - p.saved_s))
    # a slower GEMV gives time back: bytes / BW · (1/eff_fused − 1/eff_cublas)
    slow = predict(cfg, bw, "down", costs=costs, cublas_eff=0.9, fused_eff={"w_down": 0.7})
    stream = 4096 * 14336 * 2 / bw
    assert slow.matrices[0].gemv_delta_s == pytest.approx(stream / 0.7 - stream / 0.9)
    assert slow.saved_s < 0  # 4.3 µs less kernel time cannot pay for 8.8 µs more stream time
    # the norm prologue's row reads scale with rows and programs
    a = predict(cfg, bw, "norms", rows=1, programs=100).matrices[0].prologue_s
    b = predict(cfg, bw, "norms", rows=4, programs=100).matrices[0].prologue_s
    assert b == pytest.approx(4 * a) and a > 0
    assert predict(cfg, bw).saved_s > 0 and H200_KERNELS.gap_s == pytest.approx(0.268e-3 / 464)
    with pytest.raises(ValueError, match="positive"):
        predict(cfg, 0.0)


def test_measured_cublas_times_lose_the_kernels_fusing_removes_before_the_prediction() -> None:
    """A timing of what the engine runs (norm kernel + GEMV) fed to ``predict`` through
    ``gemv_alone_eff``: the predicted saving per matrix is that timing less the fused one, with
    the removed kernels counted once."""
    from specpilot.mechanisms.fused_gemv_cost import (
        KernelCosts,
        gemv_alone_eff,
        matrix_bytes,
        predict,
    )
    from specpilot.synthetic import TARGET_SHAPES

    cfg, bw = TARGET_SHAPES["llama3-8b"], 4.25e12
    costs = KernelCosts(rms_norm_s=2e-6, silu_mul_s=1.5e-6, reduce_s=1.8e-6, gap_s=0.5e-6)
    stream = matrix_bytes(cfg, "w_qkv") / bw
    t_engine = 2.5e-6 + stream / 0.9  # the norm and its gap, then a GEMV at 90% of bandwidth
    assert gemv_alone_eff(cfg, "w_qkv", t_engine, bw, costs) == pytest.approx(0.9)
    for t_fused in (t_engine - 1e-6, t_engine + 2e-6):  # a win and a loss
        p = predict(
            cfg, bw, "norms", costs=costs, l2_Bps=float("inf"),
            cublas_eff={"w_qkv": gemv_alone_eff(cfg, "w_qkv", t_engine, bw, costs), "w_gate_up": 0.9},
            fused_eff={"w_qkv": matrix_bytes(cfg, "w_qkv") / bw / t_fused},
        )  # fmt: skip
        assert p.matrices[0].saved_s == pytest.approx(t_engine - t_fused, rel=1e-9, abs=1e-12)
    with pytest.raises(ValueError, match="removed kernels"):
        gemv_alone_eff(cfg, "w_qkv", 2e-6, bw, costs)


def _group_sm90() -> None:
    """Compile the fused GEMV variants for sm_90 (ptxas, no GPU needed); print registers and
    spill bytes per variant from ``cuobjdump -res-usage``."""
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from specpilot.kernels.w12_gemv_kernel import _gemv_kernel

    ptrs = ("x64_ptr", "*i64"), ("x16_ptr", "*bf16"), ("w_ptr", "*i64"), ("sm_ptr", "*i32")
    ptrs += ("codes_ptr", "*i32"), ("off_ptr", "*i32"), ("rec_ptr", "*i32"), ("val_ptr", "*bf16")
    ptrs += ("bias_ptr", "*bf16"), ("g64_ptr", "*i64"), ("g16_ptr", "*bf16"), ("y_ptr", "*bf16")
    ptrs += (("part_ptr", "*fp32"),)
    ptrs += (("count_ptr", "*i32"),)
    ints = [
        "M",
        "N",
        "K",
        "stride_x64",
        "stride_ym",
        "stride_bm",
        "up_words",
        "row_words",
        "base",
        "k_split",
        "split",
    ]
    sig = dict(ptrs) | dict.fromkeys(ints, "i32") | {"eps": "fp32"}
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    variants = ((1, False, 4, 4, False), (2, True, 4, 8, False), (0, True, 1, 4, False))
    variants += ((0, False, 1, 4, True), (1, True, 1, 4, True), (2, True, 2, 4, True))  # W12, PTX
    for prologue, has_bias, rows, warps, w12 in variants:
        const = dict(W12=w12, PTX=w12, HAS_BIAS=has_bias, PROLOGUE=prologue, EVEN=True,
                     ROWS=rows, BLOCK_N=16, BLOCK_K=1024, ESC_STEP=16, MAX_SPLIT=16,
                     INTERPRET=False, PDL_TRIGGER=True, PDL_WAIT=has_bias)  # fmt: skip
        src = ASTSource(_gemv_kernel, sig | dict.fromkeys(const, "constexpr"), constexprs=const)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"])
            f.flush()
            usage = subprocess.run(
                [str(tool), "-res-usage", f.name], capture_output=True, text=True
            ).stdout
        reg = re.search(r"REG:(\d+)", usage)
        local = re.search(r"LOCAL:(\d+)", usage)
        assert reg and local, usage
        print(
            f"w12={w12} prologue={prologue} rows={rows} regs={reg.group(1)} local={local.group(1)}"
        )
    print("sm90 ok")


def test_fused_variants_compile_for_sm90_without_spills(tmp_path: Path) -> None:
    """The GPU code path is not run here, but it must compile for the H200 (sm_90): each fused
    variant through ptxas, with no local memory (spills). Triton here may be newer than 3.6."""
    triton = pytest.importorskip("triton")
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        pytest.skip("no bundled CUDA tools in this triton")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "TRITON_CACHE_DIR": str(tmp_path)}
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "sm90"], env=env, capture_output=True,
        text=True, timeout=120, cwd=ROOT / "tests",
    )  # fmt: skip
    assert out.returncode == 0 and "sm90 ok" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
    assert all(line.endswith("local=0") for line in out.stdout.splitlines() if "regs=" in line)


@pytest.mark.slow
def test_gpu_script_tiny_in_interpreter(tmp_path: Path) -> None:
    """The bench script's kernel part on tiny shapes: checks, timings, the summary (about 12 s in
    the interpreter). Its end-to-end part (``--no-e2e`` here: 4 minutes interpreted) installs the
    mechanism the engine tests above check in the interpreter, and runs on the GPU
    (``bench/device.sh kernels``)."""
    import json

    out = run_interpreted(
        [
            str(ROOT / "bench" / "fused_gemv_gpu.py"),
            "--tiny",
            "--out",
            str(tmp_path),
            "--budget-s",
            "5",
            "--no-w12",
            "--no-e2e",
        ],
        400,
    )
    assert "fused GEMV" in out
    res = json.loads((tmp_path / "fused_gemv_gpu.json").read_text())
    for name, mat in res["matrices"].items():
        for m, row in mat["rows"].items():
            assert row["check"]["err_over_bound"] <= 1.0, (name, m)
            assert row["check"].get("prologue_max_ulps", 0) <= 1, (name, m)
            assert all("us" in row[v] for v in ("cublas", "gemv", "fused")), (name, m)
    assert "e2e" not in res


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused kernels' GPU path")
def test_cuda_graph_engine_with_fused_gemvs_equals_without() -> None:
    """On CUDA (graphs, the Triton path, RNE casts): bf16 tokens with the mechanism equal those
    without it, AR for a batch of two and spec with chain verify (M = 4)."""
    from engine_cases import tokens
    from specpilot.drafters import NgramDrafter
    from specpilot.engine import Engine, generate
    from specpilot.mechanisms.fused_gemv import install
    from specpilot.models.transformer import Transformer

    cfg = tiny_config(arch="qwen2", vocab=113, layers=3)
    target = Transformer(cfg, dtype=torch.bfloat16, device="cuda")
    target.init_random(0, std=0.15)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 3]]
    want = tokens(generate(Engine(target), prompts, 24))
    fused = install(target, "all", max_m=4)
    engine = Engine(target)
    assert tokens(generate(engine, prompts, 24)) == want
    assert engine.runner.captures > 0 and sum(f.calls for f in fused) > 0
    spec = tokens(generate(Engine(target, NgramDrafter(k=3)), prompts[:1], 24))
    assert spec == want[:1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="programmatic dependent launch: sm_90")
def test_cuda_pdl_gemvs_equal_plain_launches() -> None:
    """With programmatic dependent launch (kernels/pdl.py) every GEMV output is bit for bit the
    plain launch's (the same sums in the same order), after a kernel that writes its input; and
    the engine from CUDA graphs with W12 and the fused GEMVs under PDL gives the tokens of the
    engine without either."""
    from engine_cases import tokens
    from specpilot.engine import Engine, generate
    from specpilot.kernels import pdl
    from specpilot.kernels.decode_triton import rms_norm
    from specpilot.kernels.fused_gemv import residual_gemv
    from specpilot.kernels.gemm_common import counter_buffer
    from specpilot.kernels.w12_gemv import GemvConfig
    from specpilot.mechanisms.fused_gemv import install
    from specpilot.mechanisms.w12 import install as install_w12
    from specpilot.models.transformer import Transformer

    if not pdl.supported(torch.device("cuda")):
        pytest.skip("this GPU or Triton has no programmatic dependent launch")
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(3)
    w = (0.05 * torch.randn(512, 1024, generator=g, device=dev)).to(torch.bfloat16)
    nw = torch.ones(1024, dtype=torch.bfloat16, device=dev)
    c = counter_buffer(512, dev)
    for m in (1, 2, 4):
        x = torch.randn(m, 1024, generator=g, device=dev).to(torch.bfloat16)
        r = torch.randn(m, 512, generator=g, device=dev).to(torch.bfloat16)
        ys = []
        for pdl_on in (False, True):  # the norm kernel writes what the GEMV reads right after
            cfg = GemvConfig(block_n=16, block_k=256, pdl=pdl_on)
            ys.append(residual_gemv(rms_norm(x, nw, 1e-5), w, c, r, cfg=cfg))
        torch.cuda.synchronize()
        assert torch.equal(ys[0], ys[1]), m
    cfg_model = tiny_config(arch="qwen2", vocab=113, layers=3)
    target = Transformer(cfg_model, dtype=torch.bfloat16, device="cuda")
    target.init_random(0, std=0.15)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 3]]
    want = tokens(generate(Engine(target), prompts, 24))
    install_w12(target, layers="mlp", max_m=4, pdl=True)
    fused = install(target, "qkv_o", max_m=4, pdl=True)
    engine = Engine(target)
    assert tokens(generate(engine, prompts, 24)) == want
    assert engine.runner.captures > 0 and sum(f.calls for f in fused) > 0


if __name__ == "__main__":
    if sys.argv[1] == "engine":
        _group_engine(sys.argv[2])
    elif sys.argv[1] == "kernels":
        _group_kernels(sys.argv[2])
    else:
        {"sm90": _group_sm90}[sys.argv[1]]()


def test_tilings_that_spill_are_refused_before_any_build() -> None:
    """Issue 26's fused-gemv anomaly (0.08x AR at tau 1): block_n 64 x block_k 1024 over 4 warps
    is 512 weights per thread, which sm_90 builds spill (4.3-6.1 KB of stack per thread); the
    config refuses it, so a tune candidate with it fails in milliseconds instead of running."""
    from specpilot.kernels.w12_gemv import GemvConfig, fits_registers

    assert fits_registers(16, 1024, 4) and fits_registers(64, 1024, 8)
    assert not fits_registers(64, 1024, 4) and not fits_registers(32, 1024, 2)
    with pytest.raises(ValueError, match="spill"):
        GemvConfig(block_n=64, block_k=1024, num_warps=4)
    GemvConfig(block_n=64, block_k=512, num_warps=4)  # 256 per thread: allowed
