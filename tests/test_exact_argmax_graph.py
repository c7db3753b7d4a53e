"""The graph-safe exact-argmax head (fixed shapes, an abstain flag) and the engine's abstain protocol.

The certificate: whenever the head says ok its ids are ``logits.argmax`` of the stock head, over
random and peaked hidden rows and near-ties built on purpose (which must abstain or answer right,
never wrong); its call never syncs with the host. The protocol: AR, chain, packed and tree verify
with the head equal plain AR, also when a wrapper makes the head abstain (with wrong ids) on
chosen calls, also replayed like CUDA graphs. The INT8 fp32-output GEMM, the bound pass through it
and the Triton refine run under ``TRITON_INTERPRET=1`` against their references.
"""

from __future__ import annotations

import random
import sys
import types
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from conftest import run_interpreted, tiny_config, tiny_model, torch_small_ops
from engine_cases import CASES, repetitive_prompt, tokens
from specpilot.engine import Engine, generate
from specpilot.mechanisms import MECHANISMS
from specpilot.mechanisms.exact_argmax import ExactArgmaxHead
from specpilot.mechanisms.exact_argmax_graph import GraphArgmaxHead
from specpilot.models.transformer import Transformer
from test_exact_argmax import head_model, stock_ids
from test_graphs import emulated_graphs, guarded, no_host_sync  # noqa: F401 (fixtures)


def check_call(head: GraphArgmaxHead, model: Transformer, x: torch.Tensor) -> bool:
    """One call: ids equal the stock argmax whenever ok; the plain call always does. Returns ok."""
    ids = head.abstaining(x)
    ok = int(head.abstain_flag[0]) == 0
    want = stock_ids(model, x)
    if ok:
        assert torch.equal(ids, want)
    assert torch.equal(head(x), want)
    return ok


def peaked(model: Transformer, rows: int, gen: torch.Generator, gain: float = 6.0) -> torch.Tensor:
    """Hidden rows close to a vocabulary row's direction (a confident LM): ``[1, rows, H]``."""
    w = model.lm_head.float()
    pick = torch.randint(0, w.shape[0], (rows,), generator=gen)
    x = gain * w[pick] / w[pick].norm(dim=1, keepdim=True) + 0.3 * torch.randn(
        rows, w.shape[1], generator=gen
    )
    return (x * w.shape[1] ** 0.5 / gain).to(model.dtype)[None]


@pytest.mark.parametrize("fmt", ["int8", "fp16"])
def test_ids_equal_the_stock_argmax_whenever_ok(fmt: str) -> None:
    rng = random.Random(1)
    oks = {"random": [0, 0], "peaked": [0, 0]}
    for case in range(24):
        vocab, hidden = rng.randint(2, 3000), rng.choice([8, 33, 64, 128])
        dtype = torch.bfloat16 if case % 4 == 3 else torch.float32
        model = head_model(vocab, hidden, case, dtype=dtype, gemv=case % 2 == 0)
        head = GraphArgmaxHead(
            model, fmt=fmt, block=rng.choice([32, 64]), candidates=rng.choice([1, 2, 4, 8])
        )
        gen = torch.Generator().manual_seed(case)
        for r in (1, 5, 16):
            x = torch.randn(1, r, hidden, generator=gen) * 10.0 ** rng.uniform(-1, 1.5)
            for kind, xs in (("random", x.to(dtype)), ("peaked", peaked(model, r, gen))):
                oks[kind][0] += check_call(head, model, xs)
                oks[kind][1] += 1
    assert oks["peaked"][0] > 0.9 * oks["peaked"][1], oks  # the cheap path really answers
    assert oks["random"][0] > 0, oks


def _tie_model(vocab: int, hidden: int) -> tuple[Transformer, torch.Tensor]:
    """Rows 3 and ``vocab - 5`` (distant blocks) equal; rows 7 and 8 one fp32 ulp apart."""
    model = head_model(vocab, hidden, 5)
    w = model.lm_head
    with torch.no_grad():
        w[vocab - 5] = w[3]
        w[8] = w[7]
        w[8, 0] = torch.nextafter(w[7, 0], torch.tensor(1.0))
    x = torch.stack([w[3], w[7], w[8], w[3] + w[7]]) * 40  # [4, H]: exact tie, near-ties
    return model, x[None]


@pytest.mark.parametrize("candidates", [1, 2, 16])
def test_near_ties_abstain_or_answer_right(candidates: int) -> None:
    model, x = _tie_model(1000, 64)
    head = GraphArgmaxHead(model, fmt="int8", block=64, candidates=candidates)
    for r in range(x.shape[1]):
        row = x[:, r : r + 1]
        ok = check_call(head, model, row)
        if r == 0:  # an exact tie between two blocks cannot be separated by intervals
            assert not ok
    assert not check_call(head, model, x)  # one row that abstains makes the call abstain


def test_non_finite_and_huge_rows_abstain() -> None:
    model = head_model(300, 32, 2)
    head = GraphArgmaxHead(model, candidates=4)
    x = torch.randn(1, 3, 32)
    for bad in (float("nan"), float("inf"), -float("inf")):
        y = x.clone()
        y[0, 1, 4] = bad
        head.abstaining(y)
        assert int(head.abstain_flag[0]) == 1
        assert torch.equal(head(y), stock_ids(model, y))
    check_call(head, model, x * 1e37)  # huge but finite logits: ok or not, never wrong
    head.model.lm_head.data[5] *= 1e30  # some logit within a factor 4 of overflow: abstain
    head = GraphArgmaxHead(model, candidates=4)
    assert not check_call(head, model, x * 1e9)
    assert check_call(head, model, x)


def test_the_certificate_never_syncs_with_the_host() -> None:
    model = head_model(700, 64, 3)
    head = GraphArgmaxHead(model, candidates=4)
    x = peaked(model, 4, torch.Generator().manual_seed(0))
    with torch.inference_mode(), no_host_sync("head"):
        ids = head.abstaining(x)
    assert int(head.abstain_flag[0]) == 0 and torch.equal(ids, stock_ids(model, x))
    assert head.stats() == {"calls": 1, "abstained_calls": 0, "rows": 4, "spared_calls": 0}


# ---------------------------------------------------------------------- the engine
class ForcedAbstain:
    """The graph head, made to abstain (and return wrong ids) on chosen ``abstaining`` calls; the
    choice is made on the device (a call counter), so it also holds in replayed CUDA graphs."""

    def __init__(self, inner: GraphArgmaxHead, calls: set[int]) -> None:
        dev = inner.abstain_flag.device
        self.inner = inner
        self.calls = torch.tensor(sorted(calls) or [-1], dtype=torch.int64, device=dev)
        self.tick = torch.zeros(1, dtype=torch.int64, device=dev)
        self.hits = torch.zeros(1, dtype=torch.int64, device=dev)
        self.abstain_flag = inner.abstain_flag

    def abstaining(self, x: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        ids = self.inner.abstaining(x, valid)
        self.tick += 1
        hit = (self.calls == self.tick).any().to(torch.int64).view(1)  # [1]
        self.abstain_flag.bitwise_or_(hit)
        self.hits += hit
        return (ids + hit) % self.inner.head.vocab

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)

    @property
    def forced(self) -> int:
        return int(self.hits[0])


ENGINE_CASES = [
    "ar",
    "ar-window",
    "ngram/chain",
    "ngram/packed+tiered",
    "ngram/tree-trie",
    "draft/fixed-tree",
    "sim/chain",
    "dflash/fixed-tree",
]


def _target(cfg: object, seed: int, device: str) -> Transformer:
    if device == "cpu":
        return tiny_model(cfg, seed)  # type: ignore[arg-type]
    model = Transformer(cfg, dtype=torch.float32, device=device)  # type: ignore[arg-type]
    model.init_random(seed, std=0.15)  # the weights tiny_model gives on the CPU
    return model


def _engine(case: str, target: Transformer, rng: random.Random, graphs: bool | None) -> Engine:
    if case in ("ar", "ar-window"):
        return Engine(target, graphs=graphs, sync_every=16 if case == "ar-window" else None)
    built = CASES[case](target, _target(target.cfg, 77, target.device.type), rng)
    return Engine(target, built.drafter, plan=built.plan, graphs=graphs)


def _check_engine(
    case: str,
    seed: int,
    forced: set[int],
    hook: Callable[[Engine], None] | None = None,
    fused: bool = False,
    device: str = "cpu",
    graphs: bool | None = None,
    prompts_new: tuple[int, int] = (3, 30),
) -> Engine:
    """The case with the graph head (forced to abstain on the ``forced`` calls) equals eager AR
    without it; every forced abstain was redone."""
    rng = random.Random(f"exact-graph/{case}/{seed}")
    cfg = tiny_config(arch="qwen3", vocab=211, tie=True)
    target = _target(cfg, seed, device)
    n_prompts, new = prompts_new
    prompts = [repetitive_prompt(rng, cfg.vocab_size, rng.randint(2, 30)) for _ in range(n_prompts)]
    small = torch_small_ops if fused and device == "cpu" else (lambda e: e)  # interpreted
    want = tokens(generate(small(Engine(target, graphs=False)), prompts, new))
    head = ForcedAbstain(GraphArgmaxHead(target, candidates=2, use_triton=fused), forced)
    target.argmax_head = head
    engine = small(_engine(case, target, rng, graphs))
    if hook is not None:
        hook(engine)
    assert tokens(generate(engine, prompts, new)) == want, case
    if forced:  # a forced abstain the accept saw was redone (one per AR window: later steps
        # halt; a graph's warm-up call may take a forced call that no accept sees)
        assert head.forced > 0 and engine.abstains > 0
        if case != "ar-window" and hook is None and not graphs:
            assert engine.abstains >= head.forced
    return engine


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("case", ENGINE_CASES)
def test_engine_with_the_graph_head_equals_ar(case: str, seed: int) -> None:
    _check_engine(case, seed, set())


@pytest.mark.parametrize("case", ENGINE_CASES)
def test_forced_abstains_lose_and_duplicate_nothing(case: str) -> None:
    """Wrong ids with the flag set, on the 1st, 4th, 5th and 9th verify: tokens still equal AR
    (nothing committed twice or lost), and the host redid each of those verifies."""
    _check_engine(case, 0, {1, 4, 5, 9})


@pytest.mark.parametrize("case", ["ar-window", "ngram/chain", "draft/fixed-tree"])
def test_abstains_replayed_like_graphs(
    case: str,
    emulated_graphs: Callable[[Engine], None],  # noqa: F811 (the fixture of test_graphs)
    guarded: set[str],  # noqa: F811
) -> None:
    """Steps recorded once per key and replayed, under the host-sync guard: the head's verify is
    graph-safe, and the stock redo runs under keys of its own."""
    engine = _check_engine(case, 1, {2, 3, 7}, emulated_graphs)
    redo_keys = [k for k in engine.runner._graphs if isinstance(k, tuple) and k[-1] == "stock-head"]
    verify = "tree_verify" if "tree" in case else "verify"
    assert redo_keys and {verify, "accept" if "tree" not in case else "tree_accept"} <= guarded


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("graphs", [False, True], ids=["cuda-eager", "cuda-graphs"])
@pytest.mark.parametrize("case", ["ar", "ar-window", "ngram/chain", "ngram/packed+tiered",
                                  "draft/fixed-tree", "dflash/fixed-tree"])  # fmt: skip
def test_cuda_graph_head_equals_ar(case: str, graphs: bool) -> None:
    """fp32 on CUDA, the fused head (INT8 GEMM, Triton kernels), eagerly and from CUDA graphs,
    with and without forced abstains: tokens equal eager AR without the head."""
    for forced in (set(), {2, 5, 9}):
        engine = _check_engine(case, 0, forced, fused=True, device="cuda", graphs=graphs)
        assert engine.runner.captures > 0 or not graphs
        head = engine.target.argmax_head
        assert isinstance(head, ForcedAbstain) and head.inner.fused


def test_the_mechanism_installs_the_graph_path_on_request() -> None:
    mech = MECHANISMS["exact-argmax"]
    model = tiny_model(tiny_config(vocab=97), 0)
    build = types.SimpleNamespace(target=types.SimpleNamespace(model=model))
    mech.apply(build, mech.resolve_knobs({"path": "graph", "candidates": 3}))  # type: ignore[arg-type]
    assert isinstance(model.argmax_head, GraphArgmaxHead) and model.argmax_head.candidates == 3
    mech.apply(build, mech.resolve_knobs({}))  # type: ignore[arg-type]
    assert isinstance(model.argmax_head, ExactArgmaxHead)  # auto: the host path on the CPU
    with pytest.raises(ValueError, match="candidate"):
        GraphArgmaxHead(model, candidates=0)


def test_the_prediction_counts_what_the_head_reads() -> None:
    from specpilot.mechanisms.exact_argmax_cost import predict

    p = predict(128256, 4096, rows=1, candidates=8, kernels=0, epilogue_passes=0)
    assert p.cheap_s == pytest.approx(p.stock_s / 2, rel=0.01)  # int8: half the bf16 bytes
    wide = predict(128256, 4096, rows=16, candidates=8, kernels=0, epilogue_passes=0)
    assert wide.refine_s == pytest.approx(16 * p.refine_s)
    redo = predict(
        128256, 4096, 1, 8, abstain_rate=0.1, verify_s=1e-3, readback_s=0.0, kernels=0,
        epilogue_passes=0,
    )  # fmt: skip
    assert redo.saved_s == pytest.approx(p.saved_s - 1e-4)


def test_the_gpu_script_runs_tiny_on_the_cpu(tmp_path: Path) -> None:
    """``bench/exact_head_gpu.py --tiny`` (torch path: no interpreter here) end to end."""
    import importlib.util as iu
    import json

    root = Path(__file__).resolve().parents[1]
    spec = iu.spec_from_file_location("exact_head_gpu", root / "bench" / "exact_head_gpu.py")
    assert spec is not None and spec.loader is not None
    mod = iu.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(["--tiny", "--out", str(tmp_path), "--trials", "2", "--new-tokens", "8"])
    saved = json.loads((tmp_path / "exact_head_gpu.json").read_text())["sections"]
    assert not [n for n, sec in saved.items() if isinstance(sec, dict) and "error" in sec]
    assert saved["correct"]["all_correct"]
    assert all(isinstance(row, dict) for row in saved["micro"].values())
    assert saved["e2e"]["tokens_equal"] and set(saved["e2e"]["arms"]) == {
        "ar", "ar+head", "chain", "chain+head",
    }  # fmt: skip
    idle = saved["e2e"]["idle_slots"]
    assert set(idle) == {"chain", "packed"} and all(a["tokens_equal"] for a in idle.values())
    assert 0 <= saved["e2e"]["spared_rate"] <= 1 and 0 <= saved["e2e"]["abstain_rate"] <= 1


# ---------------------------------------------------------------------- interpreter (subprocess)
def test_kernels_match_their_references_in_interpreter() -> None:
    assert "exact graph kernels ok" in run_interpreted([str(Path(__file__).resolve()), "kernels"])


@pytest.mark.slow
def test_fused_head_in_the_engine_in_interpreter() -> None:
    """AR windows and chain verify with the fused head, forced abstains included (~40 s)."""
    assert "fused engine ok" in run_interpreted([str(Path(__file__).resolve()), "engine"], 600)


def _group_kernels() -> None:
    from specpilot.kernels.argmax_bound import block_bounds_ref
    from specpilot.kernels.argmax_certify import (
        int8_block_bounds,
        refine_logits,
        refine_logits_ref,
    )
    from specpilot.kernels.cheap_head import prepare_cheap_head, row_terms
    from specpilot.kernels.gemm_common import GemmConfig
    from specpilot.kernels.int8_gemm import counter_buffer, int8_matmul, int8_matmul_reference
    from specpilot.mechanisms.exact_argmax_cert import kc_coefficient, stock_rounding

    g = torch.Generator().manual_seed(0)
    cases = [  # FMA GEMV, GEMV split-K, dot with split-K and ragged N/K, default config
        (48, 64, 1, GemmConfig(block_n=16, block_k=32, use_dot=False)),
        (40, 96, 1, GemmConfig(block_n=16, block_k=32, use_dot=False, split_k=3)),
        (40, 96, 5, GemmConfig(block_n=32, block_k=32, split_k=2)),
        (37, 64, 3, None),
    ]
    for n, k, m, cfg in cases:
        q = torch.randint(-127, 128, (n, k), generator=g).to(torch.int8)
        sc = torch.rand(n, generator=g) * 0.01
        x = torch.randn(m, k, generator=g).bfloat16()
        counters = counter_buffer(n, x.device)
        y = int8_matmul(x, q, sc, counters, cfg=cfg, out_dtype=torch.float32)
        ref = int8_matmul_reference(x, q, sc, out_dtype=torch.float32)
        exact = (x.double() @ q.double().T) * sc.double()
        bound = 2 * k * 2.0**-24 * (x.double().abs() @ q.double().abs().T) * sc.double()
        assert y.dtype == torch.float32 and bool(((y.double() - exact).abs() <= bound).all())
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
        assert int(counters.abs().sum()) == 0
    w = 0.02 * torch.randn(300, 64, generator=g)
    head = prepare_cheap_head(w, "int8", 64)
    stock = stock_rounding(torch.float32, torch.device("cpu"), 64)
    xs = torch.randn(3, 64, generator=g) * 5
    terms = row_terms(xs, head, stock.eps, stock.tau, stock.max_logit)
    kc = kc_coefficient(head, stock)
    got = int8_block_bounds(head, terms, kc, counter_buffer(300, xs.device))
    for a, b in zip(got, block_bounds_ref(head, terms, kc), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    blocks = torch.tensor([[0, 4], [2, 1], [4, 4]])
    for lm in (w, w.bfloat16()):
        torch.testing.assert_close(
            refine_logits(xs.to(lm.dtype), lm, blocks, 64),
            refine_logits_ref(xs.to(lm.dtype), lm, blocks, 64),
            rtol=1e-12,
            atol=1e-12,
        )
    _fused_group(g)
    print("exact graph kernels ok")


def _fused_group(g: torch.Generator) -> None:
    """The fused kernels against the torch form; the fused head alone and in the engine."""
    from specpilot.kernels.argmax_fused import row_terms_fused
    from specpilot.kernels.cheap_head import row_terms
    from specpilot.mechanisms.exact_argmax_cert import stock_rounding

    for dtype in (torch.float32, torch.bfloat16):
        model = head_model(300, 64, 9, dtype=dtype)
        ref = GraphArgmaxHead(model, candidates=2, use_triton=False)
        fused = GraphArgmaxHead(model, candidates=2, use_triton=True)
        assert fused.fused and not ref.fused
        stock = stock_rounding(dtype, torch.device("cpu"), 64)
        x = (torch.randn(5, 64, generator=g) * 3).to(dtype)
        x[1, 3] = float("nan")
        x[2, 5] = 1e-40 if dtype == torch.float32 else 1e-38  # subnormal; tiny after scaling
        want = row_terms(x, ref.head, stock.eps, stock.tau, stock.max_logit, 1 + 2 * stock.u_out)
        got = row_terms_fused(x, ref.head, fused.constants(stock))
        assert got.ok.tolist() == [True, False, False, True, True] and bool(want.ok[2])
        keep = got.ok
        assert torch.equal(got.xq[keep], want.xq[keep])
        assert torch.equal(got.x_scale[keep], want.x_scale[keep])
        for name in ("a", "b", "tau"):  # rounded up from float64 either way
            torch.testing.assert_close(getattr(got, name)[keep], getattr(want, name)[keep])
        torch.testing.assert_close(got.x_norm[keep], want.x_norm[keep], rtol=1e-14, atol=0)
        agree = 0
        for r in (1, 6):
            for xs in (peaked(model, r, g), torch.randn(1, r, 64, generator=g).to(dtype)):
                ok = check_call(fused, model, xs)
                agree += ok == check_call(ref, model, xs)
        assert agree >= 3
    tie_model, ties = _tie_model(1000, 64)
    tie_head = GraphArgmaxHead(tie_model, candidates=2, use_triton=True)
    assert not check_call(tie_head, tie_model, ties[:, :1])  # an exact tie abstains
    for r in range(1, ties.shape[1]):
        check_call(tie_head, tie_model, ties[:, r : r + 1])


def _group_engine() -> None:
    for case in ("ar-window", "ngram/chain"):
        _check_engine(case, 0, {2, 5}, fused=True, prompts_new=(2, 12))  # interpreted: slow
    print("fused engine ok")


if __name__ == "__main__":
    torch.set_num_threads(1)
    {"kernels": _group_kernels, "engine": _group_engine}[sys.argv[1]]()
