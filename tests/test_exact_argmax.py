"""The certified exact-argmax head returns torch.argmax of the stock logits, always.

Random cases by the thousand, adversarial ones (ties across and inside blocks, near-ties of one ulp,
duplicated vocabulary rows, a 152k vocabulary, hidden states of extreme norm, non-finite inputs),
the Triton kernel under TRITON_INTERPRET=1 against its torch reference, and the engine end to end.
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
from specpilot.drafters import NgramDrafter
from specpilot.drafters.tree import TreeShape
from specpilot.engine import Engine, generate
from specpilot.engine.plans import PackedPlan, TreePlan
from specpilot.kernels.argmax_bound import block_bounds_ref, block_bounds_triton
from specpilot.kernels.cheap_head import prepare_cheap_head, row_terms
from specpilot.mechanisms import MECHANISMS
from specpilot.mechanisms.exact_argmax import ExactArgmaxHead
from specpilot.mechanisms.exact_argmax_cert import kc_coefficient, stock_rounding
from specpilot.models.transformer import Transformer


def head_model(vocab: int, hidden: int, seed: int, dtype=torch.float32, gemv=False) -> Transformer:
    """A one-layer model used only for its LM head (untied)."""
    model = Transformer(tiny_config(vocab=vocab, hidden=hidden, layers=1), dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.lm_head.copy_(0.02 * torch.randn(vocab, hidden, generator=gen))
    if gemv:
        model.lm_head_in_out = model.lm_head.t().contiguous()
    return model


def stock_ids(model: Transformer, x: torch.Tensor) -> torch.Tensor:
    """The stock LM head's argmax of final-normed ``x [B, R, H]`` (what ``Transformer.forward``
    computes: the ``[in, out]`` copy for one row when the model keeps one)."""
    b, r, h = x.shape
    return model.stock_forward().logits_normed(x.reshape(b * r, h)).argmax(dim=-1).view(b, r)


@pytest.mark.parametrize("fmt", ["fp16", "int8"])
def test_thousands_of_random_rows_match_the_stock_argmax(fmt):
    rng = random.Random(0)
    rows = certified = 0
    for case in range(36):
        vocab, hidden = rng.randint(2, 3000), rng.choice([8, 33, 64, 128])
        model = head_model(vocab, hidden, case, gemv=case % 2 == 0)
        head = ExactArgmaxHead(model, fmt=fmt, block=rng.choice([32, 64, 128]))
        for r in (1, 7, 64):
            x = torch.randn(1, r, hidden, generator=torch.Generator().manual_seed(case * 7 + r))
            x = x * 10.0 ** rng.uniform(-2, 2)
            assert torch.equal(head(x), stock_ids(model, x)), (case, r)
        rows += head.stats.rows
        certified += head.stats.certified_rows
    assert rows > 2500
    assert certified > 0.8 * rows  # the cheap path really answers (not just the fallback)


def test_vocab_152k_certifies_and_matches():
    model = head_model(151936, 64, 1)
    head = ExactArgmaxHead(model, fmt="fp16", block=128)
    x = torch.randn(1, 16, 64, generator=torch.Generator().manual_seed(3)) * 4
    assert torch.equal(head(x), stock_ids(model, x))
    assert head.stats.certified_rows == 16
    # one row whose two best logits sit in distant blocks, one fp32 ulp apart
    w = model.lm_head
    with torch.no_grad():
        w[150001] = w[7]
        w[150001, 0] = torch.nextafter(w[7, 0], torch.tensor(1.0))
    x1 = (w[7] * 200.0).view(1, 1, 64)
    head = ExactArgmaxHead(model, fmt="fp16", block=128)
    assert torch.equal(head(x1), stock_ids(model, x1))


@pytest.mark.parametrize("fmt", ["fp16", "int8"])
def test_exact_ties_go_to_the_lowest_id(fmt):
    model = head_model(500, 32, 2)
    with torch.no_grad():
        model.lm_head[400] = model.lm_head[9]  # another block, same row
        model.lm_head[10] = model.lm_head[9]  # same block
    head = ExactArgmaxHead(model, fmt=fmt, block=32)
    x = (model.lm_head[9] * 50).view(1, 1, 32)
    assert head(x).item() == 9 == stock_ids(model, x).item()
    assert head.stats.stock_calls == 1  # ties cannot be certified: the stock head answered
    zero = torch.zeros(1, 2, 32)  # every logit 0: argmax is id 0
    assert head(zero).tolist() == [[0, 0]] == stock_ids(model, zero).tolist()


@pytest.mark.parametrize("fmt", ["fp16", "int8"])
def test_near_ties_of_a_few_ulps_match(fmt):
    model = head_model(700, 48, 4)
    w = model.lm_head
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for j, other in enumerate((650, 11, 333)):
            w[other] = w[10]
            idx = torch.randint(0, 48, (j + 1,), generator=gen)
            w[other, idx] = torch.nextafter(
                w[10, idx], torch.full((j + 1,), float(1 - 2 * (j % 2)))
            )
    head = ExactArgmaxHead(model, fmt=fmt, block=64)
    for scale in (1e-3, 1.0, 37.0, 1e4):
        x = (w[10] * scale + 1e-6 * torch.randn(48, generator=gen)).view(1, 1, 48)
        assert torch.equal(head(x), stock_ids(model, x)), scale


@pytest.mark.parametrize("fmt", ["fp16", "int8"])
def test_extreme_norms_and_non_finite_hidden_states(fmt):
    model = head_model(300, 40, 6)
    head = ExactArgmaxHead(model, fmt=fmt, block=32)
    base = torch.randn(1, 1, 40, generator=torch.Generator().manual_seed(7))
    for scale in (1e-38, 1e-30, 1e-12, 1e12, 1e30, 1e37, 3e38):
        x = base * scale
        assert torch.equal(head(x), stock_ids(model, x)), scale
    tiny = torch.zeros(1, 1, 40)
    tiny[0, 0, 3] = 1e-45  # a subnormal
    assert torch.equal(head(tiny), stock_ids(model, tiny))
    for bad in (float("inf"), float("-inf"), float("nan")):
        x = base.clone()
        x[0, 0, 5] = bad
        assert torch.equal(head(x), stock_ids(model, x)), bad
    spiky = base.clone()
    spiky[0, 0, 0] = 1e6  # one massive activation
    assert torch.equal(head(spiky), stock_ids(model, spiky))


@pytest.mark.parametrize("fmt", ["fp16", "int8"])
def test_bf16_model_matches_its_stock_head(fmt):
    model = head_model(1000, 64, 8, dtype=torch.bfloat16)
    head = ExactArgmaxHead(model, fmt=fmt, block=64)
    for seed in range(10):
        x = torch.randn(1, 9, 64, generator=torch.Generator().manual_seed(seed)).bfloat16() * 3
        assert torch.equal(head(x), stock_ids(model, x))
    assert head.stats.certified_rows > 0


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_triton_kernel_matches_the_torch_reference() -> None:
    """In a subprocess: the interpreter must be on before triton (or any kernel module) is
    imported, which an earlier test in this process may already have done."""
    assert "triton kernel ok" in run_interpreted([str(Path(__file__).resolve()), "kernel"], 120)


def _group_kernel() -> None:
    torch.manual_seed(0)
    w = 0.02 * torch.randn(200, 64)
    head = prepare_cheap_head(w, "int8", 64)
    stock = stock_rounding(torch.float32, torch.device("cpu"), 64)
    x = torch.randn(3, 64) * 5
    terms = row_terms(x, head, stock.eps, stock.tau, stock.max_logit)
    ref = block_bounds_ref(head, terms, kc_coefficient(head, stock))
    tri = block_bounds_triton(head, terms, kc_coefficient(head, stock))
    for a, b in zip(ref, tri, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    model = head_model(200, 64, 9)
    eh = ExactArgmaxHead(model, fmt="int8", block=64, use_triton=True)
    assert os.environ["TRITON_INTERPRET"] == "1"
    xs = torch.randn(1, 5, 64) * 3
    assert torch.equal(eh(xs), stock_ids(model, xs))
    assert eh.stats.certified_rows == 5
    print("triton kernel ok")


@pytest.mark.parametrize("seed", range(2))
def test_engine_with_the_exact_head_equals_ar(seed):
    """The head answers every argmax of the engine's forward (prefill, AR steps, chain, packed and
    tree verify): tokens equal the stock head's, and the cheap path certified most rows."""
    cfg = tiny_config(arch="qwen3", vocab=211, tie=True)
    target = tiny_model(cfg, seed)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6] * 3, [7, 7, 1]]
    want = [r.tokens for r in generate(Engine(target), prompts, 24)]
    head = ExactArgmaxHead(target)
    target.argmax_head = head
    assert [r.tokens for r in generate(Engine(target), prompts, 24)] == want
    for plan in (None, PackedPlan(None, 4), TreePlan(shape=TreeShape.uniform(4, 2, 6))):
        got = generate(Engine(target, NgramDrafter(k=5), plan=plan), prompts, 24)
        assert [r.tokens for r in got] == want, plan
    assert head.stats.certified_rows > 0.8 * head.stats.rows


def test_registered_mechanism_installs_the_head():
    mech = MECHANISMS["exact-argmax"]
    assert mech.plug_point == "lm_head_argmax" and mech.component == "lm_head"
    knobs = mech.resolve_knobs({"format": "fp16"})
    model = tiny_model(tiny_config(vocab=97), 0)
    build = types.SimpleNamespace(target=types.SimpleNamespace(model=model))
    mech.apply(build, knobs)  # type: ignore[arg-type]
    assert isinstance(model.argmax_head, ExactArgmaxHead)
    with pytest.raises(ValueError, match="format"):
        mech.resolve_knobs({"format": "int4"})


if __name__ == "__main__":
    {"kernel": _group_kernel}[sys.argv[1]]()
