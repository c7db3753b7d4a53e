"""Two-level verification: INT8 round-trip bounds, the INT8 kernel under TRITON_INTERPRET=1, the
cheap scorer's cache rollback, spec == AR in fp32 with the cheap level on (good, perfect and
broken cheap levels), the cost model and the registry (the wrapper under every plan and config:
``tests/test_engine_equivalence.py``; the GPU script's --tiny mode: ``tests/test_bench_scripts.py``).

Interpreter checks run in a subprocess (``python tests/test_two_level.py <group>``) because the
interpreter must be switched on before triton is imported.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from conftest import run_interpreted, tiny_config, tiny_model
from engine_cases import CONFIGS, repetitive_prompt
from specpilot.bench.two_level import agreement, survival
from specpilot.drafters import DraftModelDrafter, NgramDrafter
from specpilot.engine import AcceptanceStats, Engine, generate
from specpilot.engine.verify import greedy_verify
from specpilot.errors import SpecPilotError
from specpilot.mechanisms import MECHANISMS
from specpilot.mechanisms.cheap_scorer import CheapScorer
from specpilot.mechanisms.int8_copy import cheap_model, dequantize, quantize
from specpilot.mechanisms.two_level import TwoLevelDrafter, wrap
from specpilot.mechanisms.two_level_cost import committed_two_level, predict
from specpilot.models.transformer import Transformer

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- quantization
@pytest.mark.parametrize("seed", range(3))
def test_round_trip_within_half_a_step(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    w = 0.02 * torch.randn(37, 53, generator=g)
    w[3] = 0.0  # an all-zero row
    w[5, 7] = 1.5  # an outlier sets its row's scale
    q = quantize(w)
    assert q.q.dtype == torch.int8 and int(q.q.abs().max()) <= 127
    err = (dequantize(q) - w).abs()
    assert bool((err <= q.scale[:, None] / 2 * (1 + 1e-6)).all())
    assert float(err[3].max()) == 0.0 and float(q.scale[3]) == 1.0
    assert bool((q.q.abs().amax(dim=1)[torch.arange(37) != 3] == 127).all())  # full range used
    assert q.nbytes() == 37 * 53 + 4 * 37


def test_quantize_rejects_bad_input() -> None:
    with pytest.raises(SpecPilotError, match="2-D"):
        quantize(torch.zeros(4))
    with pytest.raises(SpecPilotError, match="NaN or Inf"):
        quantize(torch.tensor([[1.0, float("nan")]]))


def test_reference_matmul_is_the_dequantized_product() -> None:
    from specpilot.kernels.int8_gemm import int8_matmul_reference

    g = torch.Generator().manual_seed(1)
    w, x, b = torch.randn(24, 40, generator=g), torch.randn(5, 40, generator=g), torch.randn(24)
    q = quantize(w)
    y = int8_matmul_reference(x, q.q, q.scale, b)
    want = x.double() @ dequantize(q).double().T + b.double()
    assert torch.allclose(y.double(), want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- cheap scorer
def test_scorer_rolls_back_and_matches_a_fresh_forward() -> None:
    cfg = tiny_config(vocab=83)
    model = tiny_model(cfg, 3)
    rng = random.Random(0)
    base = [rng.randrange(83) for _ in range(20)]
    scorer = CheapScorer(model)
    scorer.start(1)
    seqs = [base[:12], [*base[:15], 1, 2, 3], [*base[:14], 9], base[:20], base[:18] + [5] * 300]
    for seq in seqs:  # shrinking, diverging and growing past the cache's slack
        first = max(1, len(seq) - 4)
        got = scorer.greedy_after([seq], [first])[0]
        cache = model.allocate_cache(1, len(seq) + 1)
        logits = model(torch.tensor([seq]), cache).logits[0]  # [T, V]
        assert got == logits[first - 1 :].argmax(-1).tolist()


# ---------------------------------------------------------------- losslessness in fp32
def _ar(target: Transformer, prompts, max_new, eos):
    return [r.tokens for r in generate(Engine(target), prompts, max_new, eos)]


def _spec(target: Transformer, drafter, prompts, max_new, eos=()):
    return generate(Engine(target, drafter), prompts, max_new, eos)


@pytest.mark.parametrize(
    "cfg_kw", CONFIGS, ids=[f"{c['arch']}-h{c['heads']}kv{c['kv_heads']}" for c in CONFIGS]
)
@pytest.mark.parametrize("seed", range(2))
def test_two_level_equals_ar(cfg_kw, seed):
    rng = random.Random(seed)
    cfg = tiny_config(**cfg_kw)
    target = tiny_model(cfg, seed)
    draft = tiny_model(cfg, seed + 1000)
    cheap = cheap_model(target)
    prompts = [repetitive_prompt(rng, cfg.vocab_size, rng.randint(1, 40)) for _ in range(3)]
    max_new = rng.randint(16, 32)
    eos = [rng.randrange(cfg.vocab_size)]
    want = _ar(target, prompts, max_new, eos)
    for k, ext in ((1, 0), (4, 3)):
        for inner in (NgramDrafter(k=k, max_n=rng.randint(1, 3)), DraftModelDrafter(draft, k=k)):
            drafter = TwoLevelDrafter(inner, cheap, ext)
            res = _spec(target, drafter, prompts, max_new, eos)
            assert [r.tokens for r in res] == want, f"{inner.name} k={k} ext={ext} batched"
            assert drafter.stats.rows > 0
    drafter = TwoLevelDrafter(NgramDrafter(k=3), cheap, 2)  # rows alone (batch-1 fast path)
    runs = [_spec(target, drafter, [p], max_new, eos)[0] for p in prompts]
    assert [r.tokens for r in runs] == want
    cycles = sum(r.stats.cycles for r in runs)  # one block forward + up to 2 extension steps each
    assert cycles <= drafter.stats.forwards <= 3 * cycles


@pytest.mark.parametrize("seed", range(3))
def test_broken_cheap_level_changes_no_token(seed):
    """A cheap level answering random tokens: the exact verify still commits AR's tokens."""
    rng = random.Random(seed)
    cfg = tiny_config(vocab=89, tie=seed % 2 == 0)
    target = tiny_model(cfg, seed)
    broken = cheap_model(target)
    gen = torch.Generator().manual_seed(seed)

    def random_tokens(x: torch.Tensor) -> torch.Tensor:
        return torch.randint(0, cfg.vocab_size, x.shape[:-1], generator=gen)

    broken.argmax_head = random_tokens
    unrelated = tiny_model(cfg, seed + 77)  # a full model that is simply a different network
    prompts = [repetitive_prompt(rng, cfg.vocab_size, rng.randint(2, 30)) for _ in range(2)]
    want = _ar(target, prompts, 24, [])
    for cheap, ext in ((broken, 3), (unrelated, 0)):
        drafter = TwoLevelDrafter(NgramDrafter(k=4), cheap, ext)
        got = [r.tokens for r in _spec(target, drafter, prompts, 24)]
        assert got == want
        assert drafter.stats.appended > 0


@pytest.mark.parametrize("seed", range(3))
def test_perfect_cheap_level_makes_every_block_accepted(seed):
    """With the target as its own cheap level, every corrected block is accepted in full, and an
    unrelated drafter's misses are all repaired (τ = block + 1 per cycle)."""
    rng = random.Random(seed)
    cfg = tiny_config(vocab=71)
    target = tiny_model(cfg, seed)
    prompts = [repetitive_prompt(rng, cfg.vocab_size, rng.randint(2, 30)) for _ in range(2)]
    want = _ar(target, prompts, 30, [])
    for ext in (0, 2):
        inner = DraftModelDrafter(tiny_model(cfg, seed + 5), k=3)
        drafter = TwoLevelDrafter(inner, target, ext)
        res = _spec(target, drafter, prompts, 30)
        assert [r.tokens for r in res] == want
        for r in res:
            assert r.stats.accepted == r.stats.drafted  # every drafted position accepted


def test_int8_cheap_level_agrees_with_its_target():
    """Teacher-forced on the target's own greedy text, the INT8 copy of a tiny fp32 model picks
    the target's token at almost every position."""
    cfg = tiny_config(vocab=97)
    target = tiny_model(cfg, 0)
    prompt = [(7 * i + 3) % 97 for i in range(12)]
    seq = torch.tensor([prompt + _ar(target, [prompt], 40, [])[0]])
    exact = target(seq, target.allocate_cache(1, 64)).logits.argmax(-1)  # [1, T]
    cheap = cheap_model(target)
    got = cheap.forward_argmax(seq, cheap.allocate_cache(1, 64))  # [1, T]
    assert float((got == exact).float().mean()) >= 0.9


# ---------------------------------------------------------------- bench measurements
def test_agreement_counts_the_continuation_positions() -> None:
    """Chunked teacher forcing equals one full forward of each model, over the positions that
    predict a token after the prefix; a model agrees with itself everywhere."""
    cfg = tiny_config(vocab=61)
    target, other = tiny_model(cfg, 0), tiny_model(cfg, 9)
    rng = random.Random(1)
    seq = [rng.randrange(61) for _ in range(30)]
    full = [
        m(torch.tensor([seq]), m.allocate_cache(1, 31)).logits[0].argmax(-1)
        for m in (target, other)
    ]  # [T] each
    for prefix, chunk in ((0, 4), (11, 5), (29, 3)):
        first = max(prefix - 1, 0)
        same = (full[0][first : len(seq) - 1] == full[1][first : len(seq) - 1]).float().mean()
        assert agreement(target, other, seq, chunk, prefix) == pytest.approx(float(same))
        assert agreement(target, target, seq, chunk, prefix) == 1.0


def test_survival_from_the_acceptance_histogram() -> None:
    stats = AcceptanceStats()
    for drafted, accepted in ((4, 0), (4, 2), (3, 3), (0, 0), (4, 4)):
        stats.record(drafted, accepted, accepted + 1)
    surv = survival(stats)
    assert surv == pytest.approx([3 / 5, 3 / 5, 2 / 5, 1 / 5])
    assert 1 + sum(surv) == pytest.approx(stats.mean_accepted_len)
    assert survival(AcceptanceStats()) == []


# ---------------------------------------------------------------- cost model
def _walk(m: int, j: int, k: int, ext: int) -> int:
    """Committed tokens when the drafter is right for m of k and the cheap level first differs
    from the exact target at position j, by running the real block rule and greedy_verify."""
    exact = list(range(100, 100 + k + ext + 3))  # the exact target's greedy continuation
    drafts = [*exact[:m], *[1] * (k - m)]  # wrong from position m + 1 on

    def cheap_after(prefix: list[int]) -> int:  # right at position i < j on the exact path only
        i = len(prefix) + 1
        return exact[i - 1] if prefix == exact[: i - 1] and i < j else 2

    n = 0
    while n < k and drafts[n] == cheap_after(drafts[:n]):
        n += 1
    block = [*drafts[:n], cheap_after(drafts[:n])]
    for _ in range(ext):
        block.append(cheap_after(block))
    out = greedy_verify(
        torch.tensor([block]), torch.tensor([len(block)]), torch.tensor([exact[: len(block) + 1]])
    )
    return int(out.accepted_len) + 1


def test_cost_model_matches_the_block_rule():
    for k in (1, 3, 5):
        for ext in (0, 2):
            for m in range(k + 1):
                for j in range(1, k + ext + 5):
                    assert _walk(m, j, k, ext) == min(j, m + 2 + ext), (k, ext, m, j)
    surv = [0.6, 0.3, 0.1]
    assert committed_two_level(surv, 1.0, 0) == pytest.approx(2.0 + sum(surv))
    assert committed_two_level(surv, 0.0, 3) == pytest.approx(1.0)
    assert committed_two_level(surv, 1.0, 3) == pytest.approx(5.0 + sum(surv))
    p = predict(surv, 0.99, 0, 0.0, 1.0, 1.0, 0.5, 0.5)
    assert p.tau_two > p.tau_one and p.speedup < 1.0  # τ 2.0: +1 token does not pay 1.5× time
    low = predict([0.2], 0.99, 0, 0.0, 1.0, 1.0, 0.5, 0.5)
    assert low.speedup > 1.0  # τ 1.2: it does


# ---------------------------------------------------------------- registry
def test_registered_where_it_can_pay():
    mech = MECHANISMS["two-level"]
    assert mech.resolve_knobs({}) == {"bits": 8, "variant": "correct", "max_extension": 4}
    assert mech.applies.allows("cuda", "bf16", "ngram", "single", "llama")
    assert not mech.applies.allows("cpu", "fp32", "ngram", "single", "llama")
    assert not mech.applies.allows("cuda", "bf16", "none", "single", "llama")
    with pytest.raises(ValueError):
        mech.resolve_knobs({"bits": 6})
    target = tiny_model(tiny_config(), 0)
    assert wrap(NgramDrafter(k=3), target, "correct", 4).k == 4
    assert wrap(NgramDrafter(k=3), target, "correct-extend", 4).k == 8


# ---------------------------------------------------------------- interpreter (subprocess)
def test_kernel_matches_reference_in_interpreter() -> None:
    assert "kernel ok" in run_interpreted([str(Path(__file__).resolve()), "kernel"])


# ---------------------------------------------------------------- groups run in the subprocess
def _group_kernel() -> None:
    from specpilot.kernels.gemm_common import GemmConfig
    from specpilot.kernels.int8_gemm import counter_buffer, int8_matmul, int8_matmul_reference
    from specpilot.mechanisms.int8_copy import Int8Linear

    cases = [  # (N, K, M, config): FMA GEMV, dot, split-K with ragged N and K, default config
        (48, 64, 1, GemmConfig(block_n=16, block_k=32, use_dot=False)),
        (48, 64, 3, GemmConfig(block_n=16, block_k=32)),
        (40, 96, 17, GemmConfig(block_n=32, block_k=32, split_k=2)),
        (32, 64, 5, None),
    ]
    g = torch.Generator().manual_seed(0)
    for n, k, m, cfg in cases:
        w = 0.02 * torch.randn(n, k, generator=g)
        x = torch.randn(m, k, generator=g).bfloat16()
        for bias in (None, torch.randn(n, generator=g).bfloat16()):
            q = quantize(w)
            counters = counter_buffer(n, x.device)
            y = int8_matmul(x, q.q, q.scale, counters, bias, cfg)
            ref = int8_matmul_reference(x, q.q, q.scale, bias)
            exact = x.double() @ dequantize(q).double().T + (0 if bias is None else bias.double())
            ulp = 2.0**-7 * exact.abs() + 1e-6  # one bf16 rounding each side
            assert bool(((y.double() - exact).abs() <= ulp).all()), (n, k, m)
            assert bool(((ref.double() - exact).abs() <= ulp).all()), (n, k, m)
            assert int(counters.abs().sum()) == 0  # split-K counters reset
    lin = Int8Linear(torch.randn(32, 64, generator=g).bfloat16(), max_m=4)
    assert lin.use_triton
    x3 = torch.randn(2, 3, 64, generator=g).bfloat16()[:, :, :]
    assert lin(x3).shape == (2, 3, 32)
    print("kernel ok")


if __name__ == "__main__":
    torch.set_num_threads(1)
    {"kernel": _group_kernel}[sys.argv[1]]()
