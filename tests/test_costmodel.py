"""The cost model: hand-computed bytes and FLOPs, the speedup algebra on synthetic timings, the
acceptance formula against real counts, on-paper predictions, the engine's forward pieces
against the engine's own forward, the trial bound, and the report files (JSON + PNG) from a real
run of the one engine on a tiny model (CPU; CUDA graphs when a GPU is present)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specpilot.config import SIZE_FIELDS
from specpilot.costmodel.acceptance import AcceptanceCurve
from specpilot.costmodel.accounting import (
    Work,
    block_drafter_work,
    chain_verify,
    draft_model_work,
    forward_work,
    total,
    tree_verify,
)
from specpilot.costmodel.bound import FORMULA, cycle_bound, engine_speedup_bound
from specpilot.costmodel.gaps import mechanisms_for
from specpilot.costmodel.hardware import GPUS, Ceilings, gpu_spec, measure_ceilings
from specpilot.costmodel.measure import measure_forward
from specpilot.costmodel.model import Prediction, Term, build_cycle, width_probs
from specpilot.costmodel.paper import PAPER_LABEL, predict_on_paper
from specpilot.costmodel.shapes import BLOCK_DRAFTERS, DRAFT_MODELS, TARGETS
from specpilot.engine import AcceptanceStats

LLAMA3_8B = TARGETS["llama3-8b"]
SMOLLM2 = TARGETS["smollm2-135m"]


# ---------------------------------------------------------------------- accounting, by hand
def test_llama3_8b_ar_step_by_hand():
    """Llama-3-8B, bf16 (2 bytes), one token at a context of 1000."""
    w = forward_work(LLAMA3_8B, tokens=1, context=1000, elem_bytes=2)
    # MLP: 32 layers × (3 · 4096 · 14336 weights + 4096 norm) × 2 bytes; 32 · 6 · 4096 · 14336 FLOPs
    assert w["mlp"].weight_bytes == 11_274_551_296
    assert w["mlp"].flops == 11_274_289_152
    # Attention projections: 4096·(4096 + 2·1024) + 4096·4096 + 4096 = 41,947,136 per layer.
    assert w["attn_proj"].weight_bytes == 41_947_136 * 32 * 2
    assert w["attn_proj"].flops == 32 * 2 * (4096 * 6144 + 4096 * 4096)
    # Attention over the cache: K and V of 1001 keys × 1024 wide, + the new K/V, q in, out.
    assert w["attn_kv"].other_bytes == 32 * (2 * 1001 * 1024 + 2 * 1024 + 2 * 4096) * 2
    assert w["attn_kv"].flops == 32 * 4 * 1001 * 4096
    # LM head: 128256 × 4096 + final norm; argmax reads 128256 logits.
    assert w["lm_head"].weight_bytes == (128256 * 4096 + 4096) * 2 == 1_050_681_344
    assert w["lm_head"].flops == 2 * 4096 * 128256
    assert w["argmax"].other_bytes == 128256 * 2 + 8
    # Every weight once, the (untied) input embedding table not streamed: 15.01 GB.
    assert LLAMA3_8B.num_params() == 8_030_261_248
    weights = total(w).weight_bytes
    assert weights == (8_030_261_248 - 128256 * 4096) * 2 == 15_009_849_344
    assert w["embedding"].bytes == 2 * 4096 * 2 and w["embedding"].flops == 0
    assert total(w).launches == 1 + 32 * (4 + 1 + 4) + 2 + 1


def test_smollm2_chain_verify_by_hand():
    """SmolLM2-135M, fp32 (4 bytes), verify of k = 8 drafts (9 tokens) at a context of 100."""
    w = chain_verify(SMOLLM2, k=8, context=100, elem_bytes=4)
    assert w["attn_proj"].weight_bytes == 30 * (576 * 960 + 576 * 576 + 576) * 4 == 106_237_440
    assert w["attn_proj"].flops == 30 * 2 * 9 * (576 * 960 + 576 * 576) == 477_757_440
    # Causal pairs: 9 · 100 + 9 · 10 / 2 = 945.
    assert w["attn_kv"].flops == 30 * 4 * 945 * 576 == 65_318_400
    assert w["attn_kv"].other_bytes == 30 * (2 * 109 * 192 + 2 * 9 * 192 + 2 * 9 * 576) * 4
    assert w["mlp"].weight_bytes == 30 * (3 * 576 * 1536 + 576) * 4
    assert w["mlp"].other_bytes == 30 * 9 * (5 * 576 + 6 * 1536) * 4
    assert w["lm_head"].weight_bytes == (49152 * 576 + 576) * 4 == 113_248_512
    assert w["lm_head"].flops == 2 * 9 * 576 * 49152 == 509_607_936
    assert w["argmax"].flops == 9 * 49152
    assert w["embedding"].bytes == 2 * 9 * 576 * 4
    # Tied embeddings: the LM head is the embedding matrix, streamed once per forward.
    assert SMOLLM2.num_params() == 134_515_008
    assert total(w).weight_bytes == 134_515_008 * 4


def test_accounting_agrees_with_the_gpu_suite_and_the_synthetic_shapes():
    synthetic = pytest.importorskip("specpilot.synthetic")
    for name, cfg in TARGETS.items():
        theirs = synthetic.TARGET_SHAPES.get(name)
        if theirs is None:
            continue
        for field in (*SIZE_FIELDS, "tie_word_embeddings", "attention_bias", "qk_norm"):
            assert getattr(cfg, field) == getattr(theirs, field), (name, field)
        weights = total(forward_work(cfg, 1, 0, 2)).weight_bytes
        assert weights == synthetic.streamed_weight_bytes(theirs, torch.bfloat16)
        kv = forward_work(cfg, 1, 999, 2)["attn_kv"].other_bytes
        per_layer_extra = 2 * cfg.kv_size * 2 + 2 * cfg.q_size * 2  # new K/V, q in, out
        expect = synthetic.kv_bytes_per_token(theirs, torch.bfloat16) * 1000
        assert kv == expect + cfg.num_layers * per_layer_extra


def test_tree_drafters_and_roofline():
    tree = tree_verify(SMOLLM2, nodes=7, context=50, elem_bytes=2, depths=[0, 1, 1, 2, 2, 2, 3])
    assert tree["attn_kv"].flops == 30 * 4 * (7 * 50 + 1 + 2 + 2 + 3 + 3 + 3 + 4) * 576
    dense = tree_verify(SMOLLM2, nodes=7, context=50, elem_bytes=2)
    assert dense["attn_kv"].flops == 30 * 4 * 7 * 57 * 576
    assert tree["mlp"] == chain_verify(SMOLLM2, 6, 50, 2)["mlp"]  # same rows, same GEMMs

    draft = DRAFT_MODELS["llama3.2-1b"]
    dm = draft_model_work(draft, k=4, context=100, elem_bytes=2)
    one = forward_work(draft, 1, 100, 2)
    assert total(dm).weight_bytes == 4 * total(one).weight_bytes  # 4 sequential forwards

    spec = BLOCK_DRAFTERS["dflash-b16"]
    bd = block_drafter_work(LLAMA3_8B, spec, context=100, elem_bytes=2)
    assert bd["mlp"].weight_bytes == 5 * (3 * 4096 * 14336 + 4096) * 2
    assert bd["lm_head"].flops == 2 * 15 * 4096 * 128256  # 15 drafted rows through the head
    fc = 5 * 4096 * 4096 + 4096 + 5 * 2 * 1024 * 4096  # fc, hidden norm, per-layer K/V proj
    assert bd["attn_proj"].weight_bytes == 5 * 41_947_136 * 2 + fc * 2

    c = Ceilings(
        "test", bandwidth_Bps=1e12, matmul_flops=1e15, launch_s=1e-6, dtype="bf16", source="t"
    )
    mem = Work(weight_bytes=2e9, flops=1e12, launches=10)  # 2 ms of bytes vs 1 ms of FLOPs
    assert mem.roofline_s(c) == pytest.approx(2e-3 + 10e-6)
    assert mem.bound(c) == "memory"
    comp = Work(other_bytes=1e6, flops=5e12, launches=0)
    assert comp.roofline_s(c) == pytest.approx(5e-3) and comp.bound(c) == "compute"


def test_gpu_table_and_measured_ceilings():
    for key in ("h100", "h200", "b200", "rtx-pro-6000", "a100", "l40s"):
        g = gpu_spec(key)
        assert g.bandwidth_Bps > 0 and g.bf16_flops > 0 and g.l2_bytes > 0 and g.sm_count > 0
    assert gpu_spec("h200").bandwidth_Bps == 4.8e12 and GPUS["a100"].fp8_flops is None
    with pytest.raises(ValueError, match="Unknown GPU"):
        gpu_spec("tpu")
    with pytest.raises(ValueError, match="no FP8"):
        gpu_spec("a100").ceilings("fp8")
    c = measure_ceilings(torch.device("cpu"), torch.float32, quick=True)
    assert c.bandwidth_Bps > 1e8 and c.matmul_flops > 1e8 and 0 < c.launch_s < 1e-3
    assert c.source.startswith("measured")


# ---------------------------------------------------------------------- acceptance
def test_expected_tokens_equals_tau_of_real_counts():
    stats = AcceptanceStats()
    # (draft length, accepted): n-gram style, some cycles draft fewer tokens or none.
    for d, n in [(4, 4), (4, 1), (2, 2), (0, 0), (3, 0), (4, 3), (1, 1), (0, 0)]:
        stats.record(d, n, n + 1)
    curve = AcceptanceCurve.from_stats(stats)
    assert curve.expected_tokens() == pytest.approx(stats.mean_accepted_len)
    assert curve.k == 4
    probs = curve.draft_len_probs()  # P(d = 0..4)
    assert probs == pytest.approx([2 / 8, 1 / 8, 1 / 8, 1 / 8, 3 / 8])
    assert width_probs(curve) == pytest.approx({1: 0.25, 2: 0.125, 3: 0.125, 4: 0.125, 5: 0.375})

    const = AcceptanceCurve.constant(6.2, 15)
    assert const.expected_tokens() == pytest.approx(6.2, abs=1e-9)
    cond = AcceptanceCurve.from_conditional([0.9, 0.5])
    assert cond.accept == pytest.approx((0.9, 0.45)) and cond.expected_tokens() == pytest.approx(
        2.35
    )
    assert AcceptanceCurve.none().expected_tokens() == 1.0


# ---------------------------------------------------------------------- the algebra
def _cycle(
    verify_ms: dict[int, dict[str, float]], roof_ms: dict[int, dict[str, float]], probs, draft, acc
):
    s = {w: {c: v / 1e3 for c, v in d.items()} for w, d in verify_ms.items()}
    r = {w: {c: v / 1e3 for c, v in d.items()} for w, d in roof_ms.items()}
    return build_cycle(probs, r, s, draft=draft, accept_commit=acc)


def test_speedup_algebra_on_synthetic_timings():
    # AR step: mlp 6 ms + lm_head 2 ms + 1 ms forward overhead, accept 1 ms = 10 ms (roof 5 ms).
    ar = _cycle(
        {1: {"mlp": 6.0, "lm_head": 2.0, "overhead": 1.0}},
        {1: {"mlp": 4.0, "lm_head": 1.0}},
        {1: 1.0},
        draft=(0.0, 0.0),
        acc=(0.0, 1e-3),
    )
    assert ar.measured_s == pytest.approx(10e-3) and ar.roofline_s == pytest.approx(5e-3)
    # Spec: half the cycles verify 1 token (no draft), half verify 3; draft 2 ms, accept 1 ms.
    spec = _cycle(
        {
            1: {"mlp": 6.0, "lm_head": 2.0, "overhead": 1.0},
            3: {"mlp": 8.0, "lm_head": 6.0, "overhead": 1.0},
        },
        {1: {"mlp": 4.0, "lm_head": 1.0}, 3: {"mlp": 4.0, "lm_head": 3.0}},
        {1: 0.5, 3: 0.5},
        draft=(0.5e-3, 2e-3),
        acc=(0.0, 1e-3),
    )
    # E[verify] = 0.5 · 9 + 0.5 · 15 = 12 ms; cycle = 2 + 12 + 1 = 15 ms; roofline 0.5 + 6 = 6.5 ms.
    assert spec.measured_s == pytest.approx(15e-3) and spec.roofline_s == pytest.approx(6.5e-3)
    assert spec.term("mlp").measured_s == pytest.approx(7e-3)  # type: ignore[union-attr]
    curve = AcceptanceCurve(accept=(0.8, 0.5), reach=(0.5, 0.5), source="measured")
    e = curve.expected_tokens()  # 1 + 0.5·0.8 + 0.5·0.5 = 1.65
    assert e == pytest.approx(1.65)
    pred = Prediction("synthetic", curve, ar, spec, measured_speedup=1.0)
    assert pred.predicted_speedup == pytest.approx(1.65 * 10 / 15)
    assert pred.ceiling_speedup == pytest.approx(1.65 * 5 / 6.5)
    assert pred.prediction_error == pytest.approx(1.65 * 10 / 15 - 1.0)
    ts = pred.tok_s()
    assert ts["spec_predicted"] == pytest.approx(1.65 / 15e-3) and ts[
        "ar_ceiling"
    ] == pytest.approx(200)
    gaps = pred.gaps()
    # Lost per token: mlp (7-4)/E, lm_head (4-2)/E, draft 1.5/E, overhead 1/E, accept 1/E.
    assert [g.component for g in gaps] == ["mlp", "lm_head", "draft", "accept_commit", "overhead"]
    assert gaps[0].lost_s_per_token == pytest.approx(3e-3 / 1.65)
    assert sum(g.share for g in gaps) == pytest.approx(1.0)
    assert any(m.name.lower() == "w12" for m in gaps[0].mechanisms)
    d = pred.to_dict()
    assert d["predicted_speedup"] == pytest.approx(1.1) and d["gaps"][0]["component"] == "mlp"
    with pytest.raises(ValueError, match="sum to"):
        build_cycle({1: 0.5}, {1: {}}, None, (0.0, 0.0), (0.0, 0.0))
    assert Term("x", 2.0, 1.0).gap_s == 0.0  # faster than the roofline: no gap, never negative


def test_mechanism_map_names_every_component():
    from specpilot.mechanisms import COMPONENTS, MECHANISMS

    for comp in ("attn_proj", "mlp", "lm_head", "argmax", "draft", "overhead", "accept_commit"):
        assert comp in COMPONENTS
        assert mechanisms_for(comp), comp
    for m in MECHANISMS.values():
        assert any(
            r.name == m.name and r.status == "registered" for r in mechanisms_for(m.component)
        )
    # every planned name that is now registered shows as registered, never as planned
    statuses = {r.name: r.status for c in COMPONENTS for r in mechanisms_for(c)}
    assert statuses["two-level"] == "registered"
    assert statuses["CUDA graphs"] == "engine" and statuses["static shapes"] == "engine"
    assert not any(name in MECHANISMS for name, st in statuses.items() if st == "planned")


# ---------------------------------------------------------------------- on paper
def test_paper_predictions_are_labelled_and_sane():
    h100 = predict_on_paper("h100", "dense-27b", "dflash-b16", tau=6.2)
    rtx = predict_on_paper("rtx-pro-6000", "dense-27b", "dflash-b16", tau=6.2)
    for p in (h100, rtx):
        assert PAPER_LABEL in p.label and p.acceptance.source == "assumed"
        assert p.expected_tokens == pytest.approx(6.2)
        assert p.measured_speedup is None and p.prediction_error is None
        assert 1.0 < p.predicted_speedup < 6.2  # type: ignore[operator]
        assert p.ceiling_speedup < 6.2
        ts = p.tok_s()
        assert ts["spec_predicted"] < ts["spec_ceiling"]  # type: ignore[operator]
    # AR at the ceiling: every component of a one-token step is memory-bound on an H100, so
    # t = bytes / bandwidth + launches · 1.5 us (+ the accept kernels).
    step = total(forward_work(TARGETS["dense-27b"], 1, 1024, 2))
    t_ar = step.bytes / 3.35e12 + (step.launches + 10) * 1.5e-6
    assert h100.tok_s()["ar_ceiling"] == pytest.approx(1 / t_ar, rel=1e-6)
    assert rtx.tok_s()["ar_ceiling"] < h100.tok_s()["ar_ceiling"]  # 1.79 vs 3.35 TB/s
    ngram = predict_on_paper("h200", "llama3-8b", "ngram", tau=3.0, k=8)
    assert ngram.spec.term("draft").roofline_s == 0.0  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="Unknown shape"):
        predict_on_paper("h100", "gpt-5")


# ---------------------------------------------------------------------- measured, on the CPU
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")


def _cache_copy(src):
    from specpilot.models.kv_cache import KVCache

    return KVCache([k.clone() for k in src.k], [v.clone() for v in src.v], src.lengths.clone())


@pytest.mark.parametrize(
    ("arch", "tokens", "context"), [("llama", 3, 20), ("qwen2", 1, 7), ("qwen3", 5, 0)]
)
def test_forward_pieces_compute_the_engine_forward(make_tiny, arch, tokens, context):
    """The whole-forward piece is the engine's verify body: on the same cache it gives the
    stock forward's argmax exactly (fp32), and the components cover the forward."""
    from conftest import tiny_config
    from specpilot.costmodel.components import forward_pieces, random_cache
    from specpilot.models.forward import Forward

    model = make_tiny(tiny_config(arch=arch, layers=2), seed=1)
    cache = random_cache(model, 64, seed=4)
    stock_cache = _cache_copy(cache)
    pieces = forward_pieces(Forward(model), tokens, context, cache=cache, seed=2)
    assert set(pieces.components) == {
        "embedding", "attn_proj", "attn_kv", "mlp", "lm_head", "argmax",
    }  # fmt: skip
    with torch.inference_mode():
        got = pieces.forward().clone()  # [1, T]
        ids = torch.randint(
            model.cfg.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(2)
        )
        stock_cache.commit(0, context)
        want = model.forward_argmax(ids, stock_cache)
        assert torch.equal(got, want)
        end = context + tokens
        for k_got, k_stock in zip(cache.k, stock_cache.k, strict=True):  # the same K/V written
            assert torch.equal(k_got[:, :, :end], k_stock[:, :, :end])
        for fn in pieces.components.values():  # every piece runs at these shapes ...
            fn()
    for k_got, k_stock in zip(cache.k, stock_cache.k, strict=True):  # ... writing past L only
        assert torch.equal(k_got[:, :, :context], k_stock[:, :, :context])


def test_component_timings_cover_the_forward(make_tiny):
    from conftest import tiny_config

    model = make_tiny(tiny_config(layers=2), seed=0)
    ft = measure_forward(model, tokens=3, context=20, rounds=2)
    assert set(ft.components) == {"embedding", "attn_proj", "attn_kv", "mlp", "lm_head", "argmax"}
    assert all(t > 0 for t in ft.components.values()) and ft.forward_s > 0
    assert ft.overhead_s >= 0 and set(ft.as_terms()) == {*ft.components, "overhead"}
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        measure_forward(model, tokens=1, context=4, rounds=1, graphs=True)


def test_an_argmax_head_is_timed_as_the_head():
    """With an LM-head argmax installed, ``lm_head`` times that head (argmax included)."""
    from conftest import tiny_config, tiny_model
    from specpilot.costmodel.components import forward_pieces
    from specpilot.models.forward import Forward

    model = tiny_model(tiny_config(layers=1), seed=0)
    calls = []

    def head(h):  # [B, R, hidden] -> [B, R]
        calls.append(h.shape)
        return (h @ model.lm_head.t()).argmax(dim=-1)

    model.argmax_head = head
    pieces = forward_pieces(Forward(model), 2, 5)
    assert "argmax" not in pieces.components
    with torch.inference_mode():
        pieces.components["lm_head"]()
        pieces.forward()
    assert calls == [(1, 2, model.cfg.hidden_size)] * 2


def test_width_maps_follow_the_engine():
    from types import SimpleNamespace

    from specpilot.costmodel.profile_run import timed_widths, width_maps
    from specpilot.engine.plans import ChainPlan, PackedPlan

    host = SimpleNamespace(graph_safe=False)
    eager = SimpleNamespace(
        k=8, plan=ChainPlan(), runner=SimpleNamespace(use_graphs=False), drafter=host
    )
    run, roof, _ = width_maps(eager, [1, 3, 9], 0.0)  # type: ignore[arg-type]
    assert run == roof == {1: 1, 3: 3, 9: 9}
    assert timed_widths(eager) == list(range(1, 10))  # type: ignore[arg-type]
    graphs = SimpleNamespace(
        k=8, plan=ChainPlan(), runner=SimpleNamespace(use_graphs=True), drafter=host
    )
    run, roof, _ = width_maps(graphs, [1, 3, 5, 9], 0.0)  # type: ignore[arg-type]
    assert run == {1: 1, 3: 4, 5: 8, 9: 9} and roof == {1: 1, 3: 3, 5: 5, 9: 9}
    assert timed_widths(graphs) == [1, 2, 4, 8, 9]  # type: ignore[arg-type]
    device = SimpleNamespace(
        k=8,
        plan=ChainPlan(),
        runner=SimpleNamespace(use_graphs=True),
        drafter=SimpleNamespace(graph_safe=True),
    )
    assert timed_widths(device) == [1, 9]  # type: ignore[arg-type]
    packed = SimpleNamespace(
        k=8, plan=PackedPlan(bucket=4), runner=SimpleNamespace(use_graphs=False), drafter=host
    )
    run, roof, _ = width_maps(packed, [1, 5, 9], 0.0)  # type: ignore[arg-type]
    assert run == {1: 4, 5: 8, 9: 9} and roof == {1: 1, 5: 5, 9: 9}


def _ngram_engines(model, k=4):
    from specpilot.drafters import NgramDrafter
    from specpilot.engine import Engine

    return Engine(model), Engine(model, NgramDrafter(k=k))


def _profile_tiny(make_tiny):
    from conftest import tiny_config
    from specpilot.costmodel.profile_run import profile_engines

    model = make_tiny(tiny_config(layers=2, vocab=50), seed=3)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12] * 4
    ceilings = measure_ceilings(torch.device("cpu"), torch.float32, quick=True)
    ar, spec = _ngram_engines(model)
    result = profile_engines(ar, spec, [prompt, prompt[3:]], 24, (), ceilings, rounds=2)
    assert spec.profile is False  # the phase timers were on for the run only
    return result


@pytest.mark.parametrize("plan_kind", ["packed", "tree"])
def test_profile_of_packed_and_tree_plans(make_tiny, plan_kind):
    """Packed and tree verifies: lossless, and their terms are timed at the rows they ran."""
    from conftest import tiny_config
    from specpilot.costmodel.profile_run import profile_engines
    from specpilot.drafters import NgramDrafter
    from specpilot.drafters.tree import TreeShape
    from specpilot.engine import Engine
    from specpilot.engine.plans import PackedPlan, TreePlan

    model = make_tiny(tiny_config(layers=1, vocab=40), seed=7)
    if plan_kind == "packed":
        plan: PackedPlan | TreePlan = PackedPlan(bucket=4)
    else:
        plan = TreePlan(shape=TreeShape.uniform(depth=3, width=2, max_nodes=6))
    spec = Engine(model, NgramDrafter(k=4 if plan_kind == "packed" else 3), plan=plan)
    prompt = [3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 3, 4]
    ceilings = measure_ceilings(torch.device("cpu"), torch.float32, quick=True)
    result = profile_engines(Engine(model), spec, [prompt], 20, (), ceilings, rounds=1)
    run = result.extra["run"]
    assert run["identical_to_ar"] == 1 and run["spec"]["rows_verified"] > 0
    widths = result.extra["widths"]
    ran = {int(v) for v in widths["run"].values()}
    assert ran <= {int(w) for w in result.extra["forward_times"]}
    if plan_kind == "packed":
        assert ran <= {4, 5}  # 1 + d rounded up to the bucket of 4, capped at k + 1
    else:
        rows = run["spec"]["rows_verified"] / run["spec"]["cycles"]
        assert ran == {max(1, round(rows))} and widths["roofline"] == widths["run"]


def test_process_clock_run(make_tiny):
    from conftest import tiny_config
    from specpilot.costmodel.run import run_engines

    model = make_tiny(tiny_config(layers=1, vocab=50), seed=3)
    prompt = [5, 6, 7, 8, 9] * 4
    ar, spec = _ngram_engines(model, k=3)
    run = run_engines(ar, spec, [prompt], 16, (), clock="process")
    assert run.clock == "process" and run.ar.tokens == run.spec.tokens == 15
    # CPU seconds of the generation minus a prefill-only one: tiny here, clamped at 0.
    assert run.ar.seconds >= 0 and run.spec.seconds >= 0 and run.identical == 1
    assert run.ar.cycles == 15 and 0 < run.spec.cycles <= 15


def test_profile_run_json_and_chart_on_cpu(make_tiny, tmp_path):
    from specpilot.costmodel.report import draw_chart, print_report, write_json

    result = _profile_tiny(make_tiny)
    pred = result.prediction
    assert pred.acceptance.source == "measured" and pred.measured_speedup is not None
    assert pred.predicted_speedup is not None and pred.prediction_error is not None
    checks = result.extra["checks"]
    assert pred.expected_tokens == pytest.approx(checks["tau_measured"])
    assert result.extra["run"]["identical_to_ar"] == 2  # lossless, both prompts
    run = result.extra["run"]
    assert run["ar"]["tokens"] == run["spec"]["tokens"] == 2 * 23  # decode tokens, no prefill's
    assert run["ar"]["cycles"] == 46 and run["spec"]["cycles"] < 46
    # The engine's phase timers split the speculative decode time, and nothing is left out.
    phases = run["spec"]["phases_s"]
    assert phases["verify"] > 0 and phases["draft"] > 0 and phases["accept"] > 0
    assert sum(phases.values()) == pytest.approx(run["spec"]["seconds"])
    # The spec cycle's loop terms are the run's, per cycle; the verify comes from the pieces.
    cyc = run["spec"]["cycles"]
    assert pred.spec.term("draft").measured_s == pytest.approx(phases["draft"] / cyc)  # type: ignore[union-attr]
    assert pred.spec.term("accept_commit").measured_s == pytest.approx(phases["accept"] / cyc)  # type: ignore[union-attr]
    assert checks["ar_step_predicted_s"] >= checks["ar_step_in_run_s"] * (1 - 1e-9)
    print_report(pred)
    out_json, out_png = tmp_path / "p.json", tmp_path / "p.png"
    write_json(out_json, pred, result.extra)
    draw_chart(out_png, pred, "tiny")
    data = json.loads(out_json.read_text())
    assert data["prediction"]["label"] == "measured components, real acceptance"
    assert set(data["prediction"]["spec_cycle"]["terms"]) >= {"draft", "mlp", "overhead"}
    assert "forward_times" in data and "ceilings" in data and data["acceptance"] == "real"
    assert data["runner"] == "eager"
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_profile_of_a_simulated_block_drafter_says_so(make_tiny, monkeypatch, capsys):
    from conftest import tiny_config
    from specpilot.costmodel.profile_run import profile_engines
    from specpilot.costmodel.report import plain_table, print_report
    from specpilot.drafters import BlockDrafter
    from specpilot.drafters.simulated import SIM_LABEL, AcceptanceProfile, SimulatedAcceptance
    from specpilot.engine import Engine

    model = make_tiny(tiny_config(layers=2, vocab=60), seed=5)
    block = BlockDrafter(model, num_layers=1, block=5, num_context_layers=2)
    sim = SimulatedAcceptance(block, AcceptanceProfile.parse("tau=3,block=5"), seed=1)
    ceilings = measure_ceilings(torch.device("cpu"), torch.float32, quick=True)
    prompt = list(range(3, 19))
    result = profile_engines(
        Engine(model), Engine(model, sim), [prompt], 30, (), ceilings, rounds=1
    )
    pred = result.prediction
    assert pred.acceptance.source == "simulated" and SIM_LABEL in pred.label
    assert result.extra["acceptance"] == "simulated" and result.extra["run"]["identical_to_ar"] == 1
    assert pred.spec.term("draft").roofline_s > 0  # type: ignore[union-attr]  # the block's work
    assert set(result.extra["forward_times"]) >= {"1", "5"}
    monkeypatch.setenv("COLUMNS", "240")
    print_report(pred, {"deployment": "tiny"})
    out = capsys.readouterr().out.splitlines()
    assert SIM_LABEL in next(ln for ln in out if "profile ·" in ln)  # the table's title
    notes = ("target components", "draft /", "measured speedup", "every speculative")
    table_rows = ("│", "┃", "┏", "┡", "└")
    figures = [ln for ln in out if any(c.isdigit() for c in ln)]
    for ln in figures:  # every other line with a figure says it
        if not ln.lstrip().startswith(table_rows) and not ln.startswith(notes):
            assert SIM_LABEL in ln, ln
    assert any(SIM_LABEL in ln for ln in out if ln.startswith("every speculative"))
    table = plain_table(pred).splitlines()
    assert SIM_LABEL in table[-3] and SIM_LABEL in table[-1]


def test_trial_bound_formula_and_engine(make_tiny):
    from conftest import tiny_config
    from specpilot.bench.protocol import speedup_bound

    assert cycle_bound(3.0, 2e-3, 1.5e-3, 0.5e-3) == pytest.approx(3.0)
    assert cycle_bound(3.0, 2e-3, 1.5e-3) == speedup_bound(3.0, 2e-3, 1.5e-3)
    with pytest.raises(ValueError, match="at least 1"):
        cycle_bound(0.5, 1e-3, 1e-3)
    with pytest.raises(ValueError, match="times must be"):
        cycle_bound(2.0, 0.0, 1e-3)

    model = make_tiny(tiny_config(layers=1, vocab=40), seed=2)
    _, spec = _ngram_engines(model, k=4)
    with pytest.raises(ValueError, match="no rows open"):
        engine_speedup_bound(spec, 2.0, 1e-3)
    from specpilot.engine import generate

    generate(spec, [[1, 2, 3, 1, 2, 3, 1, 2]], 6)
    timed = []
    real = spec.time_forward
    spec.time_forward = lambda w, iters=20: timed.append(w) or real(w, 2)  # type: ignore[method-assign]
    b = engine_speedup_bound(spec, 2.7, 4e-3, draft_s=1e-4)
    assert sorted(timed) == [1, 5] and b.width in (1, 5)  # the faster of 1 and k + 1
    assert b.bound == pytest.approx(2.7 * 4e-3 / (1e-4 + b.verify_s)) and b.verify_s > 0
    # a width-1 forward slower than the widest (a kernel chosen by row count): the floor is the
    # widest's time, not the one-token forward's (issue 26's fused-GEMV anomaly)
    spec.time_forward = lambda w, iters=20: 12e-3 if w == 1 else 1e-3  # type: ignore[method-assign]
    slow1 = engine_speedup_bound(spec, 6.0, 5e-3)
    assert slow1.width == 5 and slow1.bound == pytest.approx(6.0 * 5e-3 / 1e-3)
    spec.time_forward = real  # type: ignore[method-assign]
    assert engine_speedup_bound(spec, 5.0, 4e-3, width=5).width == 5
    with pytest.raises(ValueError, match="width must lie"):
        engine_speedup_bound(spec, 2.0, 1e-3, width=6)
    assert b.to_dict()["formula"] == FORMULA and "bound" in b.text()


def test_profile_forward_by_kernel_category(make_tiny):
    from conftest import tiny_config
    from specpilot.bench.gpu_profile import profile_forward
    from specpilot.drafters import NgramDrafter
    from specpilot.engine import Engine

    model = make_tiny(tiny_config(layers=1, vocab=40), seed=2)
    engine = Engine(model, NgramDrafter(k=3))
    engine.open(1, 64)
    engine.prefill([0], [[1, 2, 3, 4, 5]], [0], [5], [8])
    out = profile_forward(engine, 4, reps=2)
    assert out["width"] == 4 and out["kernel_s_total"] > 0 and out["kernels_per_forward"] > 0
    with pytest.raises(ValueError, match="width must lie"):
        profile_forward(engine, 6)


def test_profile_cli_paper_and_measured(tmp_path, capsys):
    from specpilot.cli import main
    from test_cli import tiny_dir

    out_json, out_png = tmp_path / "paper.json", tmp_path / "paper.png"
    code = main(
        [
            "profile",
            "--paper",
            "h100",
            "--shape",
            "dense-27b",
            "--json",
            str(out_json),
            "--chart",
            str(out_png),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and "prediction (on paper)" in out and "largest gaps" in out
    assert json.loads(out_json.read_text())["mode"] == "paper" and out_png.stat().st_size > 10_000
    code = main(["profile", "--paper", "tpu"])
    assert code == 2 and "Unknown GPU" in capsys.readouterr().err

    model = tiny_dir(tmp_path / "model")
    js = tmp_path / "m.json"
    code = main(
        ["profile", "--target", str(model), "--device", "cpu", "--prompts", "copy-heavy", "--limit", "1",
         "--max-new-tokens", "8", "-k", "3", "--rounds", "1", "--json", str(js)]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0 and "measured" in out and "simulated" not in out
    data = json.loads(js.read_text())
    assert data["mode"] == "measured" and data["run"]["prompts"] == 1
    assert data["run"]["identical_to_ar"] == 1

    sim = tmp_path / "s.json"
    code = main(
        ["profile", "--target", str(model), "--device", "cpu", "--prompts", "copy-heavy", "--limit", "1",
         "--max-new-tokens", "8", "--drafter", "block", "--simulate-acceptance", "tau=2,block=4",
         "--rounds", "1", "--json", str(sim)]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0 and "simulated acceptance" in out
    data = json.loads(sim.read_text())
    assert (
        data["acceptance"] == "simulated" and "simulated acceptance" in data["prediction"]["label"]
    )
    assert "simulated acceptance" in data["deployment"]["drafter"]
    code = main(["profile", "--target", str(model), "--device", "cpu", "--rounds", "0"])
    assert code == 2 and "at least 1" in capsys.readouterr().err


def test_gpu_profile_script_runs_tiny_on_cpu(tmp_path):
    import importlib.util
    import sys

    path = Path(__file__).resolve().parents[1] / "bench" / "profile_gpu.py"
    spec = importlib.util.spec_from_file_location("profile_gpu", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["profile_gpu"] = mod
    spec.loader.exec_module(mod)
    result = mod.main(["--out", str(tmp_path), "--tiny", "--rounds", "2", "--new-tokens", "24"])
    data = json.loads((tmp_path / "profile_gpu.json").read_text())
    assert data["label"].endswith("simulated acceptance")
    assert data["prediction"]["acceptance"]["source"] == "simulated"
    assert data["run"]["identical_to_ar"] == 1
    assert result["prediction"]["predicted_speedup"] > 0


# ---------------------------------------------------------------------- on CUDA graphs
@needs_cuda
def test_pieces_in_cuda_graphs_compute_the_engine_forward():
    """Pieces captured in a CUDA graph (the engine's mode on CUDA: Triton kernels, bucketed
    attention, the mask built on the device) replay the verify body: the same argmax and K/V as
    the same Forward run eagerly over a copy of the cache."""
    from conftest import tiny_config
    from specpilot.costmodel.components import forward_pieces, random_cache
    from specpilot.costmodel.measure import capture_graph, measure_forwards
    from specpilot.models import Transformer
    from specpilot.models.forward import Forward

    dev = torch.device("cuda")
    model = Transformer(tiny_config(arch="qwen3", layers=2), dtype=torch.float32, device=dev)
    model.init_random(3, std=0.15)
    fwd = Forward(model)
    cache = random_cache(model, 256, seed=1)
    eager_cache = _cache_copy(cache)
    pieces = forward_pieces(fwd, 4, 30, graphs=True, cache=cache, seed=2)
    assert pieces.attn_len == 128
    with torch.inference_mode():
        replay = capture_graph(pieces.forward, dev)
        buf = pieces.forward()  # the persistent argmax buffer  [1, T]
        assert isinstance(buf, torch.Tensor)
        buf.zero_()
        replay()
        got = buf.clone()  # what the replay wrote
        gen = torch.Generator().manual_seed(2)
        ids = torch.randint(model.cfg.vocab_size, (1, 4), generator=gen).to(dev)
        start = torch.tensor([30], device=dev)
        want = fwd.argmax(fwd.dense(ids, eager_cache, start, 128))
    assert torch.equal(got[0], want)
    for k_got, k_eager in zip(cache.k, eager_cache.k, strict=True):
        assert torch.equal(k_got[:, :, :34], k_eager[:, :, :34])
    ft = measure_forwards(fwd, [1, 4], 30, rounds=2, graphs=True)
    assert all(t.forward_s > 0 and all(v > 0 for v in t.components.values()) for t in ft.values())


@needs_cuda
def test_profile_on_cuda_graphs():
    from conftest import tiny_config
    from specpilot.costmodel.profile_run import profile_engines
    from specpilot.drafters import NgramDrafter
    from specpilot.engine import Engine, generate
    from specpilot.models import Transformer

    dev = torch.device("cuda")
    model = Transformer(tiny_config(layers=2, vocab=50), dtype=torch.float32, device=dev)
    model.init_random(3, std=0.15)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12] * 4
    ar, spec = Engine(model), Engine(model, NgramDrafter(k=4))
    assert ar.runner.use_graphs and spec.runner.use_graphs
    ceilings = measure_ceilings(dev, torch.float32, quick=True)
    result = profile_engines(ar, spec, [prompt], 40, (), ceilings, rounds=2)
    assert result.extra["runner"] == "CUDA-graph replays"
    assert result.extra["run"]["identical_to_ar"] == 1
    assert all(int(w) in (1, 2, 4, 5) for w in result.extra["forward_times"])
    b = engine_speedup_bound(spec, 2.0, 1e-3)
    assert b.verify_s > 0
    assert generate(spec, [prompt], 40)[0].tokens == generate(ar, [prompt], 40)[0].tokens
