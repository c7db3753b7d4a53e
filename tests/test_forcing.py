"""Token forcing catches a faulty engine, and its tolerance behaves as documented."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_config, tiny_model
from specpilot.drafters import DraftModelDrafter
from specpilot.engine import SpecEngine, VerifyOutcome, greedy_verify
from specpilot.forcing import force_tokens, near_tie_tolerance


class AcceptsOneWrongToken:
    """A broken verifier: once, it accepts the first rejected draft token as if it matched."""

    def __init__(self) -> None:
        self.fired = False

    def __call__(
        self, draft: torch.Tensor, lens: torch.Tensor, argmax: torch.Tensor
    ) -> VerifyOutcome:
        out = greedy_verify(draft, lens, argmax)
        n = int(out.accepted_len[0])
        if not self.fired and n < int(lens[0]):
            self.fired = True
            n += 1  # d_{n+1} != a_n, accepted anyway
            return VerifyOutcome(accepted_len=torch.tensor([n]), bonus=argmax[:, n])
        return out


@pytest.mark.parametrize("seed", range(5))
def test_fault_injected_engine_is_caught(seed):
    cfg = tiny_config(vocab=67)
    target, draft = tiny_model(cfg, seed), tiny_model(cfg, seed + 50)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    faulty = AcceptsOneWrongToken()
    bad = SpecEngine(target, DraftModelDrafter(draft, k=4), verify_fn=faulty).generate(
        [prompt], 40
    )[0]
    assert faulty.fired
    good = SpecEngine(target).generate([prompt], 40)[0]
    assert bad.tokens != good.tokens
    report = force_tokens(target, [("bad", prompt, bad.tokens), ("good", prompt, good.tokens)])
    assert not report.ok and report.mismatches >= 1
    seq_id, first = report.first_mismatch()
    assert seq_id == "bad"
    # the first mismatch is exactly where the faulty verifier let a wrong token through
    diverge = next(
        i for i, (a, b) in enumerate(zip(bad.tokens, good.tokens, strict=False)) if a != b
    )
    assert first.position == diverge and first.token == bad.tokens[diverge]
    assert first.top5[0][0] == good.tokens[diverge]
    assert len(first.top5) == 5 and first.top5[0][1] >= first.top5[-1][1]
    assert (
        first.context_ids
        == (prompt + bad.tokens)[max(0, len(prompt) + diverge - 24) : len(prompt) + diverge]
    )
    assert report.sequences[1].ok


def test_near_tie_is_counted_not_failed():
    cfg = tiny_config(vocab=41, tie=False)
    target = tiny_model(cfg, 3)
    prompt = [4, 5, 6]
    a = SpecEngine(target).generate([prompt], 6)[0].tokens[2]  # argmax at position 2
    r = cfg.vocab_size - 1 if a != cfg.vocab_size - 1 else cfg.vocab_size - 2
    with (
        torch.no_grad()
    ):  # an exact logit tie between a and r everywhere; argmax keeps the lower id
        target.lm_head[r] = target.lm_head[a]
    tokens = SpecEngine(target).generate([prompt], 6)[0].tokens
    assert tokens[2] == min(a, r)
    tied = [*tokens[:2], max(a, r)]  # later tokens would follow another prefix
    report = force_tokens(target, [("tie", prompt, tied)])
    assert report.near_ties == 1 and report.mismatches == 0 and report.ok
    assert report.sequences[0].max_near_tie_gap == 0.0
    # a token with a real gap is a mismatch
    worst = int(
        target(torch.tensor([prompt + tokens[:2]]), target.allocate_cache(1, 8))
        .logits[0, -1]
        .argmin()
    )
    report = force_tokens(target, [("gap", prompt, [*tokens[:2], worst])])
    assert report.mismatches == 1 and not report.ok


def test_tolerance_scales_with_dtype_and_logit():
    assert near_tie_tolerance(torch.bfloat16, 20.0) == pytest.approx(16 * 2**-9 * 20)
    assert near_tie_tolerance(torch.float16, -20.0) == pytest.approx(16 * 2**-11 * 20)
    assert near_tie_tolerance(torch.float32, 0.1) == pytest.approx(16 * 2**-24)  # floor at |l| = 1
    assert near_tie_tolerance(torch.float32, 20.0) < 2e-5


def test_ties_resolve_to_the_lowest_id_like_the_stock_path():
    logits = torch.tensor([0.0, 2.0, 2.0, 1.0])
    assert int(logits.argmax()) == 1
