"""Split-KV decode attention: the launch plan, the kernel against SDPA under the layout's mask
(interpreted), the engine with the mechanism (fp32: spec == AR == the SDPA path), the registry
entry and the cost model. The CUDA test (skipped here) runs it from graphs in fp32 and bf16.
"""

from __future__ import annotations

import json
import random
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import run_interpreted, tiny_config, tiny_model
from engine_cases import check_cuda_drafter_equals_ar, repetitive_prompt, tokens
from specpilot.costmodel.gaps import mechanisms_for
from specpilot.drafters import NgramDrafter
from specpilot.engine import Engine, generate
from specpilot.errors import SpecPilotError
from specpilot.forcing.check import force_sequence
from specpilot.kernels.decode_attn_plan import MAX_ROWS, MAX_SPLITS, DecodeAttnConfig, split_plan
from specpilot.kernels.reference import decode_attention_ref
from specpilot.mechanisms import MECHANISMS
from specpilot.mechanisms.decode_attn import SplitKVAttention, install, uninstall
from specpilot.mechanisms.decode_attn_cost import predict
from specpilot.models.layout import DenseLayout, PackedLayout, PackedRows, block_mask
from specpilot.synthetic import TARGET_SHAPES
from specpilot.tune.space import directions_for

HERE = str(Path(__file__).resolve())


# ---------------------------------------------------------------------- the launch plan
@pytest.mark.parametrize("attn_len", [1, 17, 128, 384, 4096, 8192, 100_000])
@pytest.mark.parametrize("rows", [1, 4, 32, 64])
def test_split_plan_covers_the_bucket(attn_len: int, rows: int) -> None:
    for cfg in (DecodeAttnConfig(), DecodeAttnConfig(keys_per_split=96, block_n=32)):
        splits, split_len = split_plan(attn_len, 1, 8, rows, cfg, 132)
        assert split_len % cfg.for_rows(rows).block_n == 0 and 1 <= splits <= MAX_SPLITS
        assert (splits - 1) * split_len < attn_len <= splits * split_len  # no empty split
        if cfg.keys_per_split and attn_len <= MAX_SPLITS * 96:
            assert split_len == 96
        if not cfg.keys_per_split:  # partials stay small against the K/V a split reads
            assert split_len >= min(4 * rows, attn_len) or splits == 1


def test_split_plan_fills_the_gpu_at_batch_one() -> None:
    cfg = DecodeAttnConfig()
    assert split_plan(4096, 1, 8, 4, cfg, 132) == (32, 128)  # 256 programs for 132 SMs
    assert split_plan(384, 1, 8, 4, cfg, 132) == (6, 64)  # an AR step steps 64 keys at a time
    assert split_plan(384, 1, 8, 64, cfg, 132) == (2, 256)  # 64 rows: >= 4 x 64 keys a split
    assert split_plan(4096, 16, 8, 4, cfg, 132)[0] == 3  # 16 sequences: 384 programs
    with pytest.raises(ValueError, match="block_n"):
        DecodeAttnConfig(block_n=48)


def test_automatic_tiling_follows_the_query_rows() -> None:
    auto = DecodeAttnConfig()
    assert (auto.for_rows(4).block_n, auto.for_rows(4).num_warps) == (64, 2)  # AR, group 4
    assert (auto.for_rows(32).block_n, auto.for_rows(32).num_warps) == (64, 8)  # width-8 verify
    assert (auto.for_rows(64).block_n, auto.for_rows(64).num_warps) == (32, 4)
    given = DecodeAttnConfig(block_n=16, num_warps=4)
    assert given.for_rows(4) is given  # what the caller set is kept
    half = DecodeAttnConfig(num_warps=4).for_rows(4)
    assert (half.block_n, half.num_warps) == (64, 4)


def test_dense_layouts_carry_their_lengths() -> None:
    start = torch.tensor([3, 9])
    lay = DenseLayout.build(start, 4, 16, 2, torch.float32, causal=False)
    assert lay.start is start and not lay.causal
    assert lay.mask is not None and torch.equal(
        lay.mask, block_mask(start, 4, 16, 2, torch.float32, causal=False)
    )
    exact = DenseLayout.build(torch.tensor([5]), 1, 6, 2, torch.float32, host_start=5)
    assert exact.mask is None and exact.causal and exact.start is not None
    assert DenseLayout.writes(start, 2).start is None  # no attention: nothing to read


# ---------------------------------------------------------------------- interpreted
def test_kernel_interpreted() -> None:
    assert "kernel ok" in run_interpreted([HERE, "kernel"], 120)


def _case(
    rng: random.Random, b: int, hkv: int, g: int, w: int, d: int, starts: list[int], attn: int,
    causal: bool, dtype: torch.dtype, keys_per_split: int, block_n: int,
) -> None:  # fmt: skip
    from specpilot.kernels.decode_attn import counter_buffer, decode_attention

    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    s = attn + 5
    q = torch.randn(b, hkv, g * w, d, generator=gen).to(dtype)
    k = torch.randn(b, hkv, s, d, generator=gen).to(dtype)
    v = torch.randn(b, hkv, s, d, generator=gen).to(dtype)
    start = torch.tensor(starts)
    want = decode_attention_ref(q, k, v, start, w, attn, causal)
    k_bad, v_bad = k.clone(), v.clone()
    for i, st in enumerate(starts):  # keys no row may see: never read (NaN would show)
        k_bad[i, :, st + w :] = float("nan")
        v_bad[i, :, st + w :] = float("nan")
    counters = counter_buffer(b, hkv, q.device)
    cfg = DecodeAttnConfig(keys_per_split=keys_per_split, block_n=block_n)
    got = decode_attention(q, k_bad, v_bad, start, w, attn, counters, causal, cfg)
    assert got.shape == (b * w, hkv * g * d) and got.dtype == dtype
    assert torch.isfinite(got).all()
    err = (got.float() - want.float()).abs().max().item()
    tol = 2e-6 if dtype == torch.float32 else 2 * 2**-8 * want.float().abs().max().item()
    assert err <= tol, (b, hkv, g, w, starts, attn, causal, dtype, err)
    assert counters.eq(0).all()  # re-armed for the next launch (graph replays)
    again = decode_attention(q, k_bad, v_bad, start, w, attn, counters, causal, cfg)
    assert torch.equal(again, got)  # the merge order is fixed


def _group_kernel() -> None:
    rng = random.Random(0)
    f32, bf16 = torch.float32, torch.bfloat16
    cases = [
        # b, hkv, g, w, d, starts, attn, causal, dtype, keys_per_split, block_n
        (1, 2, 2, 1, 16, [0], 40, True, f32, 0, 16),  # length 1
        (1, 2, 4, 1, 32, [44], 64, True, f32, 16, 16),  # 45 keys: not a multiple of the split
        (2, 2, 2, 3, 32, [5, 90], 100, True, f32, 32, 16),  # rows of different lengths, W > 1
        (3, 1, 4, 2, 16, [0, 33, 126], 128, True, f32, 16, 16),  # MQA, a row at the bucket end
        (2, 2, 1, 4, 16, [10, 60], 96, False, f32, 32, 16),  # a non-causal block
        (2, 1, 2, 5, 24, [7, 3], 256, True, f32, 0, 32),  # bucket far past every length, D = 24
        (2, 2, 2, 3, 32, [5, 90], 100, True, bf16, 32, 16),
        (1, 2, 4, 1, 16, [200], 256, True, bf16, 0, 16),
        (1, 1, 4, 1, 128, [700], 768, True, f32, 16, 16),  # 44 splits: 6 merge loads
        (1, 1, 4, 16, 128, [300], 384, True, bf16, 64, 16),  # 64 rows: one split per load
    ]
    for case in cases:
        _case(rng, *case)  # type: ignore[arg-type]
    print("kernel ok")


def test_kernel_compiles_for_hopper() -> None:
    """The kernel lowers to sm_90 PTX with this machine's Triton (the H200 runs Triton 3.6):
    bf16 with tensor-core dots and fp32 with the ``ieee`` dot, both with the split counter."""
    triton = pytest.importorskip("triton")
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError:
        pytest.skip("this Triton has no ASTSource / GPUTarget")
    import inspect

    from specpilot.kernels.decode_attn import _decode_attn_kernel

    names = list(inspect.signature(_decode_attn_kernel.fn).parameters)
    for elt, w, dot_f32 in (("bf16", 1, False), ("fp32", 16, True)):
        consts = dict(W=w, G=4, D=128, CAUSAL=True, BLOCK_M=max(16, 4 * w), BLOCK_N=64,
                      BLOCK_D=128, RM=4 * w, SC=max(1, 8 // w), DOT_F32=dot_f32,
                      OUT_BF16=elt == "bf16", INTERPRET=False, PDL=True)  # fmt: skip
        ptrs = {n: f"*{elt}" for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")}
        ptrs |= {"start_ptr": "*i64", "part_ptr": "*fp32", "stat_ptr": "*fp32", "count_ptr": "*i32"}
        sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in names}
        sig["qk_scale"] = "fp32"
        try:
            src = ASTSource(fn=_decode_attn_kernel, signature=sig, constexprs=consts)
            kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32))
        except (RuntimeError, FileNotFoundError) as e:  # no ptxas here: skip; a real error fails
            missing = ("not found", "cannot find", "no such file")
            if isinstance(e, RuntimeError) and not any(m in str(e).lower() for m in missing):
                raise
            pytest.skip(f"cannot compile for sm_90 here: {e}")
        ptx = kernel.asm["ptx"]
        assert "atom" in ptx and (dot_f32 or "mma" in ptx), elt
        assert "griddepcontrol.launch_dependents" in ptx, elt  # kernels/pdl.py's trigger


def test_engine_interpreted() -> None:
    out = run_interpreted([HERE, "engine"], 200)
    assert "engine ok" in out


def _group_engine() -> None:
    cfg = tiny_config(arch="qwen3", vocab=113, heads=4, kv_heads=2, layers=1)
    target = tiny_model(cfg, 0)
    rng = random.Random(1)
    prompts = [repetitive_prompt(rng, cfg.vocab_size, n) for n in (1, 21)]
    want = tokens(generate(Engine(target), prompts, 10))  # SDPA in the layer body
    attn = install(target, keys_per_split=32, block_n=16)
    assert tokens(generate(Engine(target), prompts, 10)) == want  # AR
    ar_calls = attn.calls
    assert ar_calls > 0
    engine = Engine(target, NgramDrafter(k=3))
    got = generate(engine, prompts, 10)  # chain verify
    assert tokens(got) == want and sum(sum(r.stats.drafted) for r in got) > 0
    assert attn.calls > ar_calls
    _packed_and_custom_masks_keep_sdpa(engine, attn)
    with pytest.raises(SpecPilotError, match="already"):
        install(target)
    uninstall(target)
    print("engine ok")


def _packed_and_custom_masks_keep_sdpa(engine: Engine, attn: SplitKVAttention) -> None:
    """A packed layout (ragged / tree verify) and a dense one with its own mask take SDPA."""
    fwd, cfg = engine.fwd, engine.target.cfg
    gen = torch.Generator().manual_seed(0)
    b, w, s, hkv, d = 2, 3, 16, cfg.num_kv_heads, cfg.head_dim
    g = cfg.num_heads // hkv
    q = torch.randn(b, hkv, g * w, d, generator=gen)
    k, v = torch.randn(2, b, hkv, s, d, generator=gen)
    start = torch.tensor([4, 9])
    rows = PackedRows.allocate(b, w, q.device)
    rows.fill([w, w], b * w)
    packed = PackedLayout.build(rows, b * w, start, s, g, q.dtype, s)
    custom = DenseLayout(b, w, s, torch.arange(b * w), block_mask(start, w, s, g, q.dtype))
    calls = attn.calls
    for lay in (packed, custom):
        sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=lay.mask)
        assert torch.equal(fwd.attend(q, k, v, lay), lay.gather(sdpa))
    assert attn.calls == calls
    dense = DenseLayout.build(start, w, s, g, q.dtype)
    want = decode_attention_ref(q, k, v, start, w, s)
    assert (fwd.attend(q, k, v, dense) - want).abs().max() < 1e-5 and attn.calls == calls + 1
    wide = MAX_ROWS // g + 1  # a prefill chunk: more query rows than a program holds
    q = torch.randn(b, hkv, g * wide, d, generator=gen)
    k, v = torch.randn(2, b, hkv, wide + 9, d, generator=gen)
    lay = DenseLayout.build(start, wide, wide + 9, g, q.dtype)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=lay.mask)
    assert torch.equal(fwd.attend(q, k, v, lay), lay.gather(sdpa)) and attn.calls == calls + 1


def test_gpu_bench_script_runs_tiny_on_the_cpu(tmp_path: Path) -> None:
    """``bench/decode_attn_gpu.py --tiny`` end to end under the interpreter: every section runs
    and the correctness section passes (the GPU numbers come from the H200 run)."""
    script = str(Path(__file__).resolve().parents[1] / "bench" / "decode_attn_gpu.py")
    printed = run_interpreted([script, "--tiny", "--out", str(tmp_path), "--rounds", "1"], 200)
    out = json.loads((tmp_path / "decode_attn_gpu.json").read_text())
    sec = out["sections"]
    assert not [name for name, v in sec.items() if isinstance(v, dict) and "error" in v]
    assert sec["correctness"]["all_ok"] and sec["correctness"]["graph_ok"]
    assert sec["timing"]["rows"] and sec["e2e"]["contexts"]["24"]["ar_tokens_equal"]
    assert "correctness: all ok True" in printed


# ---------------------------------------------------------------------- plain CPU
def test_the_stock_path_never_uses_the_plug_point() -> None:
    cfg = tiny_config(layers=1)
    target = tiny_model(cfg, 0)
    want = tokens(generate(Engine(target), [[1, 2, 3]], 3))

    def refuse(*args: object) -> torch.Tensor:
        raise AssertionError("the torch path took the attention plug point")

    target.dense_attention = refuse  # type: ignore[assignment]
    # stock forward (token forcing) and, without Triton, the engine's layer body: SDPA
    logits = target(torch.tensor([[1, 2, 3]]), target.allocate_cache(1, 8)).logits
    assert logits.shape == (1, 3, cfg.vocab_size)
    if not Engine(target).fwd.use_triton:
        assert tokens(generate(Engine(target), [[1, 2, 3]], 3)) == want
        with pytest.raises(SpecPilotError, match="Triton"):
            install(tiny_model(cfg, 0))


# ---------------------------------------------------------------------- registry
def test_registry_entry_and_tuner_direction() -> None:
    mech = MECHANISMS["split-kv"]
    assert mech.component == "attn_kv" and mech.plug_point == "kernel_choice"
    assert mech.applies.allows("cuda", "bf16", "none", "single", "llama")
    assert not mech.applies.allows("cpu", "fp32", "ngram", "single", "llama")
    assert mech.resolve_knobs({"warps": 8}) == {"keys_per_split": 0, "block_n": 0, "warps": 8}
    with pytest.raises(ValueError, match="block_n"):
        mech.resolve_knobs({"block_n": 48})
    refs = {r.name: r.status for r in mechanisms_for("attn_kv")}
    assert refs["split-kv"] == "registered"
    from specpilot.engine.config import DeploymentSpec, EngineConfig

    base = EngineConfig(DeploymentSpec(target="m", drafter="ngram", dtype="bf16"), k=4)
    assert "mechanism:split-kv" in {d.name for d in directions_for(base, "cuda", "llama")}
    assert "mechanism:split-kv" not in {d.name for d in directions_for(base, "cpu", "llama")}
    model = tiny_model(tiny_config(layers=1), 0)
    build = types.SimpleNamespace(target=types.SimpleNamespace(model=model), notes=[])
    if Engine(model).fwd.use_triton:
        mech.apply(build, mech.resolve_knobs({}))  # type: ignore[arg-type]
        assert model.dense_attention is not None and "split-kv" in build.notes[0]
    else:
        with pytest.raises(SpecPilotError, match="CUDA"):
            mech.apply(build, mech.resolve_knobs({}))  # type: ignore[arg-type]


# ---------------------------------------------------------------------- cost model
def test_cost_model() -> None:
    cfg = TARGET_SHAPES["llama3-8b"]
    bw, launch, sms = 4.25e12, 2.5e-6, 132
    kv_row = 2 * 8 * 128 * 2  # K and V bytes per key and layer
    p = predict(cfg, [300], 1, 384, bw, launch, sms)
    assert p.split_kv.launches == 1 and p.sdpa.launches == 2 and not p.sdpa_measured
    assert p.split_kv.bytes >= 301 * kv_row and p.sdpa.bytes >= 384 * kv_row
    assert p.split_kv.programs == 8 * 5 and p.sdpa.programs == 8  # 5 splits of 64 keys work
    assert p.saved_s > 0 and p.speedup(4.9e-3) > 1
    # a longer bucket costs SDPA and not the kernel (it reads only the true length)
    longer = predict(cfg, [300], 1, 1024, bw, launch, sms)
    assert longer.sdpa.seconds > p.sdpa.seconds
    assert longer.split_kv.bytes - p.split_kv.bytes < 0.05 * p.split_kv.bytes
    # the measured SDPA time replaces the modelled one
    m = predict(cfg, [300], 1, 384, bw, launch, sms, sdpa_s=8.8e-6)
    assert m.sdpa_measured and m.sdpa.seconds == 8.8e-6
    assert m.saved_s == pytest.approx(32 * (8.8e-6 - m.split_kv.seconds))
    # a batch of rows at different lengths reads the sum of their lengths
    two = predict(cfg, [100, 2000], 8, 2048 + 128, bw, launch, sms)
    assert two.split_kv.bytes >= (108 + 2008) * kv_row
    with pytest.raises(ValueError):
        predict(cfg, [1], 1, 128, 0.0, launch, sms)


# ---------------------------------------------------------------------- CUDA
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_graphs_with_split_kv() -> None:
    """From CUDA graphs: fp32 AR and chain verify equal the SDPA path's tokens; in bf16 every
    token of AR and of chain verify with the mechanism passes token forcing (the split layout
    follows the block width, so W = 1 and W = 5 round differently: near-ties may differ)."""
    cfg = tiny_config(arch="qwen3", vocab=113, hidden=256, heads=8, kv_heads=2, layers=3)
    rng = random.Random(7)
    prompts = [repetitive_prompt(rng, cfg.vocab_size, rng.randint(1, 200)) for _ in range(3)]
    for dtype in (torch.float32, torch.bfloat16):
        from specpilot.models.transformer import Transformer

        target = Transformer(cfg, dtype=dtype, device="cuda")
        target.init_random(0, std=0.15)
        want = tokens(generate(Engine(target), prompts, 40))
        install(target)
        ar = tokens(generate(Engine(target), prompts, 40))
        if dtype == torch.float32:
            assert ar == want
        engine = Engine(target, NgramDrafter(k=4))
        spec = tokens(generate(engine, prompts, 40))
        assert engine.runner.captures > 0
        if dtype == torch.float32:
            assert spec == ar
        else:
            for prompt, out in [*zip(prompts, ar, strict=True), *zip(prompts, spec, strict=True)]:
                assert force_sequence(target, "bf16", prompt, out).mismatches == 0
        if dtype == torch.float32:  # eager vs graphs, and the scheduler, with the kernel
            check_cuda_drafter_equals_ar(target, NgramDrafter(k=4), graphs=True)
        uninstall(target)


if __name__ == "__main__":
    {"kernel": _group_kernel, "engine": _group_engine}[sys.argv[1]]()
