"""Token forcing catches a faulty engine, and its tolerance behaves as documented."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_config, tiny_model
from specpilot.drafters import DraftModelDrafter
from specpilot.engine import Engine, VerifyOutcome, generate, greedy_verify
from specpilot.engine import accept as accept_mod
from specpilot.engine.plans import ChainPlan
from specpilot.forcing import force_tokens, near_tie_tolerance


def ar(target: torch.nn.Module, prompt: list[int], max_new: int) -> list[int]:
    return generate(Engine(target), [prompt], max_new)[0].tokens  # type: ignore[arg-type]


class AcceptsOneWrongToken:
    """A broken verifier: once, it accepts the first rejected draft token as if it matched
    (installed where the engine's accept step calls ``greedy_verify``)."""

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
def test_fault_injected_engine_is_caught(seed, monkeypatch):
    cfg = tiny_config(vocab=67)
    target, draft = tiny_model(cfg, seed), tiny_model(cfg, seed + 50)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    faulty = AcceptsOneWrongToken()
    monkeypatch.setattr(accept_mod, "greedy_verify", faulty)
    bad = generate(Engine(target, DraftModelDrafter(draft, k=4)), [prompt], 40)[0]
    assert faulty.fired
    monkeypatch.undo()
    good = generate(Engine(target), [prompt], 40)[0]
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


class CommitsOneWrongBonus(ChainPlan):
    """A broken plan: in one cycle it replaces row 0's bonus token by another token, on the
    device as well (the engine then decodes on from the wrong prefix, as a real bug would)."""

    def __init__(self, at_cycle: int) -> None:
        super().__init__()
        self.at_cycle = at_cycle
        self.cycles = 0
        self.wrong: int | None = None

    def cycle(self, engine):  # type: ignore[no-untyped-def]
        w, drafted = super().cycle(engine)
        self.cycles += 1
        if self.cycles == self.at_cycle:
            st = engine.state
            n, end = int(st.accepted[0]), int(st.committed_len[0])
            self.wrong = (int(st.verify_argmax[0, n]) + 1) % engine.target.cfg.vocab_size
            st.verify_argmax[0, n] = self.wrong
            st.tokens[0, end - 1] = self.wrong
            st.pending[0] = self.wrong
        return w, drafted


@pytest.mark.parametrize("seed", range(3))
def test_plan_committing_a_wrong_token_is_caught_where_it_did(seed):
    cfg = tiny_config(vocab=67, arch="qwen3")
    target = tiny_model(cfg, seed)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    plan = CommitsOneWrongBonus(at_cycle=3)
    bad = generate(Engine(target, DraftModelDrafter(target, k=3), plan=plan), [prompt], 30)[0]
    assert plan.wrong is not None
    report = force_tokens(target, [("bad", prompt, bad.tokens)])
    assert not report.ok and report.mismatches == 1 and report.near_ties == 0
    _, first = report.first_mismatch()
    assert first.token == plan.wrong == bad.tokens[first.position]
    good = ar(target, prompt, 30)
    assert bad.tokens[: first.position] == good[: first.position]


def test_near_tie_is_counted_not_failed():
    cfg = tiny_config(vocab=41, tie=False)
    target = tiny_model(cfg, 3)
    prompt = [4, 5, 6]
    a = ar(target, prompt, 6)[2]  # argmax at position 2
    r = cfg.vocab_size - 1 if a != cfg.vocab_size - 1 else cfg.vocab_size - 2
    with torch.no_grad():  # a and r tie everywhere, up to the GEMM's rounding of each column
        target.lm_head[r] = target.lm_head[a]
    tokens = ar(target, prompt, 6)
    assert tokens[2] in (a, r)  # exactly equal logits would give min(a, r)
    tied = [*tokens[:2], a + r - tokens[2]]  # the other one; later tokens follow another prefix
    report = force_tokens(target, [("tie", prompt, tied)])
    assert report.near_ties == 1 and report.mismatches == 0 and report.ok
    assert report.sequences[0].max_near_tie_gap <= 1e-5  # fp32 rounding, not a real gap
    # a token with a real gap is a mismatch
    worst = int(
        target(torch.tensor([prompt + tokens[:2]]), target.allocate_cache(1, 8))
        .logits[0, -1]
        .argmin()
    )
    report = force_tokens(target, [("gap", prompt, [*tokens[:2], worst])])
    assert report.mismatches == 1 and not report.ok


def test_tolerance_is_the_first_order_rounding_bound():
    # 2 · u · (sqrt(L + 1) · ‖h‖ · ‖w_a − w_t‖ + |l_a| + |l_t|)
    assert near_tie_tolerance(torch.bfloat16, 3, 10.0, 2.0, 5.0, -4.0) == pytest.approx(
        2 * 2**-9 * (2 * 20 + 9)
    )
    assert near_tie_tolerance(torch.float32, 30, 50.0, 3.0, 20.0, 19.0) < 2e-4  # SmolLM2-like scale
    # it grows with depth, with the hidden norm and with the distance between the two LM-head rows
    base = near_tie_tolerance(torch.float16, 8, 4.0, 1.0, 1.0, 1.0)
    assert near_tie_tolerance(torch.float16, 32, 4.0, 1.0, 1.0, 1.0) > base
    assert near_tie_tolerance(torch.float16, 8, 8.0, 1.0, 1.0, 1.0) > base
    assert near_tie_tolerance(torch.float16, 8, 4.0, 2.0, 1.0, 1.0) > base
    with pytest.raises(ValueError):
        near_tie_tolerance(torch.int8, 1, 1.0, 1.0, 1.0, 1.0)


def test_mismatch_reports_its_tolerance():
    cfg = tiny_config(vocab=41)
    target = tiny_model(cfg, 5)
    prompt = [1, 2, 3]
    tokens = ar(target, prompt, 4)
    with torch.inference_mode():
        worst = int(
            target(torch.tensor([prompt]), target.allocate_cache(1, 8)).logits[0, -1].argmin()
        )
    report = force_tokens(target, [("s", prompt, [worst])])
    first = report.first_mismatch()
    assert first is not None and 0 < first[1].tolerance < 1e-4  # fp32: a tiny bound
    assert report.to_dict()["sequences"][0]["first_mismatch"]["tolerance"] == first[1].tolerance
    assert tokens  # the stock path itself ran


def test_ties_resolve_to_the_lowest_id_like_the_stock_path():
    logits = torch.tensor([0.0, 2.0, 2.0, 1.0])
    assert int(logits.argmax()) == 1
