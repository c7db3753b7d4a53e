"""FP8 pre-filter (batched): FP8 round-trip bounds, continuous batching == single-request AR in fp32
with the pre-filter wrapping the drafter (FP8, random and unrelated cheap models), the cut rule
and that it really cuts, min_batch, the registry and build. The wrapper under every plan and
config: ``tests/test_engine_equivalence.py``; the GPU script: ``tests/test_bench_scripts.py``."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_config, tiny_model
from engine_cases import make_requests, single_ar
from specpilot.drafters import DraftModelDrafter, NgramDrafter
from specpilot.drafters.base import Drafter
from specpilot.drafters.wrapped import DraftFilter, FilteredDrafter
from specpilot.engine import Engine, Request, Scheduler
from specpilot.engine.build import build_engine
from specpilot.engine.config import DeploymentSpec, EngineConfig
from specpilot.errors import SpecPilotError
from specpilot.mechanisms import MECHANISMS
from specpilot.mechanisms.fp8_copy import (
    FP8,
    Fp8ArgmaxHead,
    Fp8Linear,
    dequantize,
    fp8_model,
    quantize,
    use_scaled_mm,
)
from specpilot.mechanisms.fp8_prefilter import Fp8Prefilter
from specpilot.models.transformer import Transformer
from specpilot.tune.space import directions_for


def scheduler(
    target: Transformer,
    drafter: Drafter,
    keep: DraftFilter | None,
    slots: int,
    segment_tokens: int | None = None,
) -> Scheduler:
    """Continuous batching over ``drafter``, wrapped by the draft filter ``keep`` when given."""
    if keep is not None:
        drafter = FilteredDrafter(drafter, keep, "fp8-prefilter")
    return Scheduler(Engine(target, drafter), slots=slots, segment_tokens=segment_tokens)


# ---------------------------------------------------------------- the FP8 copy
@pytest.mark.parametrize("seed", range(3))
def test_round_trip_within_e4m3_error(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    w = 0.02 * torch.randn(37, 53, generator=g)
    w[3] = 0.0  # an all-zero row
    w[5, 7] = 1.5  # an outlier sets its row's scale
    w[9, :5] = 1e-9  # far below the row's subnormal range: rounds to zero
    q = quantize(w)
    assert q.q.dtype == FP8 and q.scale.dtype == torch.float32
    deq = dequantize(q)
    err = (deq - w).abs()
    # 3 mantissa bits: half an ulp is 2^-4 relative (normal codes), 2^-10 * scale (subnormals)
    bound = torch.maximum(2.0**-4 * w.abs(), 2.0**-10 * q.scale[:, None]) * (1 + 1e-6)
    assert bool((err <= bound).all())
    assert float(err[3].max()) == 0.0 and float(q.scale[3]) == 1.0  # zero row: exact, finite
    assert bool(torch.isfinite(deq).all())
    rows = torch.arange(37) != 3
    assert bool((q.q.float().abs().amax(dim=1)[rows] == 448.0).all())  # full range used
    assert float((err / w.abs().clamp(min=1e-3)).mean()) < 2.0**-4  # and not trivially loose
    assert q.nbytes() == 37 * 53 + 4 * 37


def test_quantize_rejects_bad_input() -> None:
    with pytest.raises(SpecPilotError, match="2-D"):
        quantize(torch.zeros(4))
    with pytest.raises(SpecPilotError, match="NaN or Inf"):
        quantize(torch.tensor([[1.0, float("inf")]]))


def test_cpu_linear_is_the_dequantized_product_and_shares_the_target() -> None:
    g = torch.Generator().manual_seed(1)
    w, x, b = torch.randn(24, 48, generator=g), torch.randn(2, 5, 48, generator=g), torch.randn(24)
    lin = Fp8Linear(w, scaled_mm=True)  # asked for the FP8 GEMM, but the CPU has none
    assert not use_scaled_mm(x.reshape(-1, 48), lin.fp8, lin.scaled_mm)
    want = F.linear(x, dequantize(lin.fp8), b)
    assert torch.equal(lin(x, b), want) and lin(x).shape == (2, 5, 24)
    target = tiny_model(tiny_config(vocab=64), 0)
    cheap = fp8_model(target)
    assert cheap.embed is target.embed and cheap.layers[0].w_qkv is target.layers[0].w_qkv
    assert isinstance(cheap.argmax_head, Fp8ArgmaxHead) and not cheap.argmax_head.linear.scaled_mm
    assert len(cheap.layers[0].linear_fns) == 4 and not target.layers[0].linear_fns


def test_scaled_mm_call_layout_when_the_cpu_has_it() -> None:
    """Where this torch runs ``_scaled_mm`` on the CPU, the GEMM path's operands (row-major
    activations, column-major weight, row-wise scales) give the dequantized product up to the
    activations' own FP8 rounding. The GPU picks this path; the CPU never does by itself."""
    from specpilot.mechanisms.fp8_copy import _scaled_mm

    g = torch.Generator().manual_seed(2)
    w, x = 0.05 * torch.randn(48, 64, generator=g), torch.randn(5, 64, generator=g).bfloat16()
    q = quantize(w)
    try:
        y = _scaled_mm(x, q)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"no CPU _scaled_mm here: {e}")
    ref = x.double() @ dequantize(q).double().T  # [5, 48]
    bound = 2.0**-3 * (x.double().abs() @ dequantize(q).double().abs().T) + 1e-3
    assert y.shape == (5, 48) and bool(((y.double() - ref).abs() <= bound).all())


def test_fp8_cheap_model_agrees_with_its_target() -> None:
    cfg = tiny_config(vocab=97)
    target = tiny_model(cfg, 0)
    seq = torch.tensor([[(7 * i + 3) % 97 for i in range(48)]])
    exact = target(seq, target.allocate_cache(1, 64)).logits.argmax(-1)  # [1, T]
    cheap = fp8_model(target)
    got = cheap.forward_argmax(seq, cheap.allocate_cache(1, 64))  # [1, T]
    assert float((got == exact).float().mean()) >= 0.8


# ---------------------------------------------------------------- losslessness in fp32
def _random_cheap(target: Transformer, seed: int) -> Transformer:
    """An FP8 copy whose greedy head answers random tokens."""
    cheap = fp8_model(target)
    gen = torch.Generator().manual_seed(seed)
    vocab = target.cfg.vocab_size
    cheap.argmax_head = lambda x: torch.randint(0, vocab, x.shape[:-1], generator=gen)
    return cheap


@pytest.mark.parametrize("seed", range(3))
def test_scheduler_with_prefilter_equals_ar(seed: int) -> None:
    rng = random.Random(seed)
    cfg = tiny_config(vocab=89, tie=seed == 1, arch=("llama", "qwen2", "qwen3")[seed])
    target = tiny_model(cfg, seed)
    reqs = make_requests(rng, cfg.vocab_size, 7, target)
    want = {r.id: single_ar(target, r) for r in reqs}
    cheaps = {
        "fp8": fp8_model(target),
        "random": _random_cheap(target, seed),
        "unrelated": tiny_model(cfg, seed + 77),
    }
    cases = [  # (cheap, drafter, slots, segment, margin)
        ("fp8", NgramDrafter(k=4, max_n=rng.randint(1, 3)), 4, 9, 1),
        ("fp8", DraftModelDrafter(target, k=6), 3, 16, 0),  # perfect drafter
        ("fp8", DraftModelDrafter(tiny_model(cfg, seed + 5), k=3), 5, 7, 2),
        ("random", NgramDrafter(k=8), 3, 11, 1),
        ("random", DraftModelDrafter(target, k=5), 4, 6, 0),
        ("unrelated", NgramDrafter(k=1), 2, 64, 1),
    ]
    scored = 0
    for name, drafter, slots, segment, margin in cases:
        catch_up = rng.choice((6, 64))  # small: long prompts reach the cheap cache in chunks
        pre = Fp8Prefilter(cheaps[name], margin=margin, min_batch=1, catch_up=catch_up)
        order = list(reqs)
        rng.shuffle(order)
        sched = scheduler(target, drafter, pre, slots, segment)
        got = {r.id: r.tokens for r in sched.run(order)}
        label = f"{name} {drafter.name} k={drafter.k} slots={slots} margin={margin}"
        assert got == want, label
        assert pre.stats.applied > 0, label
        scored += pre.stats.rows
        if name == "random" and margin == 0:  # a perfect drafter drafts every step
            assert pre.stats.cut > 0, label
    assert scored > 0


# ---------------------------------------------------------------- the cut rule
def _continuation(target: Transformer, prompt: list[int], n: int) -> list[int]:
    return single_ar(target, Request("x", tuple(prompt), n))


@pytest.mark.parametrize("margin", (0, 1, 3))
def test_block_is_cut_to_agreed_plus_margin(margin: int) -> None:
    """The target as its own cheap model: drafts equal to its continuation up to a planted wrong
    token at position j are kept to exactly j + margin (capped at the block)."""
    cfg = tiny_config(vocab=61)
    target = tiny_model(cfg, 4)
    rng = random.Random(margin)
    contexts: list[Sequence[int] | None] = []
    drafts: list[list[int]] = []
    wrong_at = [0, 2, 5, 6, 3]
    for j in wrong_at:
        prompt = [rng.randrange(61) for _ in range(rng.randint(3, 9))]
        d = _continuation(target, prompt, 6)
        if j < 6:
            d[j] = (d[j] + 1) % 61
        contexts.append(prompt)
        drafts.append(d)
    contexts.append(None)  # a slot in prefill: no drafts, nothing to cut
    drafts.append([])
    pre = Fp8Prefilter(target, margin=margin, min_batch=2)
    keep = pre(contexts, drafts)
    assert keep == [*(min(6, j + margin) for j in wrong_at), 0]
    assert pre.stats.agreed == sum(wrong_at) and pre.stats.rows == 5
    assert pre.stats.cut == sum(6 - k for k in keep[:5])
    # a second step after a partial commit: the cheap cache rolls back and still agrees
    contexts2 = [
        [*c, *d[:2]] if c is not None else None for c, d in zip(contexts, drafts, strict=True)
    ]
    drafts2 = [_continuation(target, list(c), 4) if c is not None else [] for c in contexts2]
    assert pre(contexts2, drafts2) == [4, 4, 4, 4, 4, 0]


def test_prefilter_cuts_the_exact_verify_when_the_cheap_model_disagrees() -> None:
    """A perfect drafter and a cheap model answering random tokens: with margin 0 almost every
    draft is cut, so the exact verify sees far fewer drafts per step, and the output is AR's."""
    rng = random.Random(5)
    cfg = tiny_config(vocab=97)
    target = tiny_model(cfg, 5)
    reqs = [Request(f"r{i}", tuple(rng.randrange(97) for _ in range(8)), 24) for i in range(4)]
    want = {r.id: single_ar(target, r) for r in reqs}
    runs = {}
    for label, pre in (
        ("off", None),
        ("on", Fp8Prefilter(_random_cheap(target, 0), margin=0, min_batch=1)),
    ):
        sched = scheduler(target, DraftModelDrafter(target, k=6), pre, slots=4)
        for r in reqs:
            sched.submit(r)
        drafted = steps = 0
        got = {}
        while sched.has_work:
            rep = sched.step()
            drafted += rep.drafted
            steps += rep.rows_decoding > 0
            got.update({res.id: res.tokens for res in rep.finished})
        assert got == want, label
        runs[label] = (drafted, steps, pre)
    (d_off, s_off, _), (d_on, s_on, pre) = runs["off"], runs["on"]
    assert pre is not None and pre.stats.cut > 0
    assert pre.stats.agreed / pre.stats.drafted < 0.2  # random tokens rarely agree
    assert d_on < 0.5 * d_off  # the exact verify saw far fewer drafts...
    assert s_on > s_off  # ...so it took more steps to commit the same tokens


# ---------------------------------------------------------------- min_batch
class _Counting(Fp8Prefilter):
    def __init__(self, cheap: Transformer, min_batch: int) -> None:
        super().__init__(cheap, margin=0, min_batch=min_batch)
        self.rows_seen: list[int] = []

    def __call__(self, contexts, drafts):  # type: ignore[no-untyped-def]
        self.rows_seen.append(
            sum(1 for c, d in zip(contexts, drafts, strict=True) if c is not None and d)
        )
        return super().__call__(contexts, drafts)


def test_min_batch_is_respected() -> None:
    rng = random.Random(6)
    cfg = tiny_config(vocab=71)
    target = tiny_model(cfg, 6)
    reqs = [
        Request(f"r{i}", tuple(rng.randrange(71) for _ in range(6)), rng.randint(6, 30))
        for i in range(5)
    ]
    want = {r.id: single_ar(target, r) for r in reqs}
    for min_batch in (1, 3, 6):
        pre = _Counting(_random_cheap(target, 1), min_batch)
        sched = scheduler(target, DraftModelDrafter(target, k=4), pre, slots=5)
        got = {r.id: r.tokens for r in sched.run(reqs)}
        assert got == want
        seen = pre.rows_seen
        assert pre.stats.steps == sum(1 for n in seen if n > 0)
        assert pre.stats.applied == sum(1 for n in seen if n >= min_batch)
        if min_batch == 6:  # never 6 drafted rows among 5 slots: no cheap forward, no cut
            assert pre.stats.applied == 0 and pre.stats.cut == 0 and pre.scorer.rows == 0
        else:
            assert pre.stats.applied > 0 and pre.stats.cut > 0
    assert min(seen) < 3 <= max(seen)  # the run had steps on both sides of min_batch 3


def test_bad_prefilter_settings_and_answers() -> None:
    target = tiny_model(tiny_config(vocab=31), 0)
    for kw in ({"margin": -1}, {"min_batch": 0}, {"catch_up": 0}):
        with pytest.raises(ValueError):
            Fp8Prefilter(target, **kw)  # type: ignore[arg-type]
    sched = scheduler(target, NgramDrafter(k=3), lambda c, d: [1], slots=2)
    sched.submit(Request("a", (1, 2, 1, 2, 1, 2), 8))
    with pytest.raises(ValueError, match="draft filter gave 1 rows, expected 2"):
        sched.step()  # the prompt goes in and the row decodes in the same step


def test_scheduler_clamps_whatever_the_prefilter_says() -> None:
    """A pre-filter asking for more drafts than drafted, or fewer than none, gets a prefix."""
    rng = random.Random(7)
    cfg = tiny_config(vocab=53)
    target = tiny_model(cfg, 7)
    reqs = make_requests(rng, cfg.vocab_size, 4, target)
    want = {r.id: single_ar(target, r) for r in reqs}
    for answer in (-3, 0, 2, 99):
        sched = scheduler(target, NgramDrafter(k=5), lambda c, d, a=answer: [a] * len(d), 3)
        assert {r.id: r.tokens for r in sched.run(reqs)} == want, answer


# ---------------------------------------------------------------- registry and build
def _config(tmp_path: Path, mode: str = "batched") -> EngineConfig:
    from test_cli import tiny_dir

    dep = DeploymentSpec(target=str(tiny_dir(tmp_path / "m")), drafter="ngram", mode=mode)
    return EngineConfig(dep, k=4, drafter_knobs={"max_n": 3, "min_n": 1})


def test_registered_for_the_batched_scheduler_on_cuda(tmp_path: Path) -> None:
    mech = MECHANISMS["fp8-prefilter"]
    assert mech.resolve_knobs({}) == {"margin": 1, "min_batch": 8}
    assert mech.component == "verify" and mech.plug_point == "drafter_schedule"
    assert mech.applies.allows("cuda", "bf16", "ngram", "batched", "llama")
    assert not mech.applies.allows("cuda", "bf16", "ngram", "single", "llama")
    assert not mech.applies.allows("cpu", "fp32", "ngram", "batched", "llama")
    with pytest.raises(ValueError):
        mech.resolve_knobs({"margin": 9})
    build = build_engine(_config(tmp_path), 256)
    mech.apply(build, mech.resolve_knobs({"margin": 2, "min_batch": 3}))
    wrapped = build.drafter
    assert isinstance(wrapped, FilteredDrafter) and wrapped.inner.name == "ngram"
    pre = wrapped.keep
    assert isinstance(pre, Fp8Prefilter) and (pre.margin, pre.min_batch) == (2, 3)
    assert build.scheduler(2).engine.drafter is wrapped
    build.drafter = None
    with pytest.raises(SpecPilotError, match="needs a drafter"):
        mech.apply(build, mech.resolve_knobs({}))


def test_tuner_offers_it_only_where_it_applies(tmp_path: Path) -> None:
    base = _config(tmp_path)
    names = {d.name for d in directions_for(base, "cuda", "llama", num_layers=2)}
    assert "mechanism:fp8-prefilter" in names and "mechanism:adaptive-block" in names
    single = dataclasses.replace(
        base, deployment=dataclasses.replace(base.deployment, mode="single")
    )
    assert "mechanism:fp8-prefilter" not in {
        d.name for d in directions_for(single, "cuda", "llama")
    }
    assert "mechanism:fp8-prefilter" not in {d.name for d in directions_for(base, "cpu", "llama")}
