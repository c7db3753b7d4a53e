"""The speculation gate (``engine/gate.py``): its rule, and that it never changes a token."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from conftest import tiny_config, tiny_model
from engine_cases import ar_tokens, block_drafter, repetitive_prompt, simulated, tokens
from specpilot.drafters import DraftModelDrafter, NgramDrafter
from specpilot.drafters.base import gateable
from specpilot.drafters.early_exit import early_exit_model
from specpilot.engine import Engine, generate
from specpilot.engine.config import DeploymentSpec, EngineConfig
from specpilot.engine.gate import GateSettings, SpecGate
from specpilot.errors import SpecPilotError


def _gate(**kw: object) -> SpecGate:
    g = SpecGate(GateSettings(**kw))  # type: ignore[arg-type]
    g.reset(1)
    return g


def test_turns_off_when_drafts_do_not_pay_then_probes_with_a_doubling_period() -> None:
    g = _gate(warmup_cycles=2, probe_cycles=2, off_tokens=4, max_off_tokens=8, margin=0.0)
    g.observe_ar(0.010, 1, [0])  # an AR step costs 10 ms
    for _ in range(2):  # a cycle costs 20 ms and commits 1.5 tokens: 1.5 * 10 < 20
        g.observe_cycle(0.020, [(0, 1 if _ else 2)])
    assert g.all_off([True]) and g.turned_off == 1
    assert g.off_window([True]) == 4
    assert g.observe_ar(0.010, 4, [0]) == [0]  # the off period is over: a probe starts
    assert not g.all_off([True])
    for _ in range(2):  # the probe loses too: off again, for twice as long
        g.observe_cycle(0.020, [(0, 1)])
    assert g.all_off([True]) and g.off_window([True]) == 8
    g.observe_ar(0.010, 8, [0])
    for _ in range(2):  # a probe that pays (3 tokens per 20 ms > 1 per 10 ms) keeps it on
        g.observe_cycle(0.020, [(0, 3)])
    assert not g.all_off([True])
    for _ in range(5):
        g.observe_cycle(0.020, [(0, 3)])
    assert not g.all_off([True]) and g.turned_off == 2


def test_waits_for_an_ar_time_and_keeps_paying_rows_on() -> None:
    g = _gate(warmup_cycles=3)
    for _ in range(3):
        g.observe_cycle(0.020, [(0, 1)])
    assert not g.all_off([True])  # no AR step timed yet: no verdict, ...
    assert g.wants_ar_time()  # ... so the engine runs two AR steps to time one
    g.observe_ar(0.010, 2, [0])
    g.observe_cycle(0.020, [(0, 1)])
    assert g.all_off([True])
    g2 = _gate(warmup_cycles=1)
    g2.observe_ar(0.010, 1, [0])
    for _ in range(10):
        g2.observe_cycle(0.020, [(0, 5)])  # 5 tokens per 20 ms beats 1 per 10 ms
    assert not g2.all_off([True]) and g2.turned_off == 0


def test_a_new_request_starts_from_what_earlier_ones_measured() -> None:
    g = _gate(warmup_cycles=2, off_tokens=8)
    g.observe_ar(0.010, 1, [0])
    assert not g.all_off([True])  # nothing measured yet: a new row drafts
    for _ in range(2):
        g.observe_cycle(0.020, [(0, 1)])  # drafting loses
    g.reset_row(0)  # the next request starts off, and probes after its first period
    assert g.all_off([True]) and g.off_window([True]) == 8
    assert g.observe_ar(0.010, 8, [0]) == [0]
    g2 = _gate(warmup_cycles=2)
    g2.observe_ar(0.010, 1, [0])
    for _ in range(3):
        g2.observe_cycle(0.020, [(0, 4)])  # drafting pays: new requests draft from the start
    g2.reset_row(0)
    assert not g2.all_off([True])


def test_reset_row_forgets_a_row_and_settings_are_checked() -> None:
    g = _gate(warmup_cycles=1)
    g.observe_ar(0.010, 1, [0])
    g.observe_cycle(0.050, [(0, 1)])
    assert g.all_off([True])
    g.tau_prior = 0.0  # the deployment's prior forgotten too: a reset row drafts again
    g.reset_row(0)
    assert not g.all_off([True])
    with pytest.raises(ValueError):
        GateSettings(off_tokens=0)
    with pytest.raises(ValueError):
        GateSettings.from_dict({"bogus": 1})
    dep = DeploymentSpec(target="x")
    assert EngineConfig(dep).gate_settings().enabled
    assert not EngineConfig(dep, gate={"enabled": False}).gate_settings().enabled
    with pytest.raises(SpecPilotError, match="gate"):
        EngineConfig(dep, gate={"margin": -1})
    assert "gate" not in EngineConfig(dep).to_json()  # unset: config hashes stay as they were
    same = EngineConfig.from_dict(json.loads(EngineConfig(dep, gate={}).to_json()))
    assert same.gate == {}


def test_which_drafters_can_be_gated() -> None:
    target = tiny_model(tiny_config(), 0)
    assert gateable(NgramDrafter(k=4))
    assert gateable(DraftModelDrafter(early_exit_model(target, 1), k=3))
    assert not gateable(block_drafter(target))  # needs the target's features of every position
    assert not gateable(simulated(target, random.Random(0)))  # wraps a block drafter


def _gated(target, drafter, margin: float) -> Engine:  # type: ignore[no-untyped-def]
    settings = GateSettings(margin=margin, warmup_cycles=2, probe_cycles=2, off_tokens=3)
    return Engine(target, drafter, gate=SpecGate(settings))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("margin", [0.0, 1000.0])  # 1000: every verdict turns drafting off
def test_gated_output_equals_ar(seed: int, margin: float) -> None:
    rng = random.Random(seed)
    cfg = tiny_config(vocab=97)
    target, other = tiny_model(cfg, seed), tiny_model(cfg, seed + 100)
    prompts = [repetitive_prompt(rng, 97, rng.randint(4, 40)) for _ in range(3)]
    want = ar_tokens(target, prompts, 30)
    drafters = [
        NgramDrafter(k=rng.choice((2, 5, 8)), max_n=3),
        DraftModelDrafter(other, k=rng.choice((2, 4))),
        DraftModelDrafter(early_exit_model(target, 1), k=3),
    ]
    for drafter in drafters:
        for batch in ([p] for p in prompts):  # one request at a time
            engine = _gated(target, drafter, margin)
            assert tokens(generate(engine, batch, 30)) == [want[prompts.index(batch[0])]]
        engine = _gated(target, drafter, margin)  # and all of them batched
        assert tokens(generate(engine, prompts, 30)) == want
        if margin > 1:
            assert engine.gate is not None and engine.gate.turned_off > 0
            assert engine.gate.ar_steps > 0


@pytest.mark.parametrize("seed", range(3))
def test_a_draft_model_catches_up_after_ar_steps(seed: int) -> None:
    """A draft model equal to the target proposes the target's own tokens: after every off
    period its catch-up must leave its cache exactly in step, or drafts after a probe would be
    rejected."""
    rng = random.Random(seed)
    cfg = tiny_config(vocab=89, layers=2)
    target = tiny_model(cfg, seed)
    twin = tiny_model(cfg, seed)
    prompt = repetitive_prompt(rng, 89, 17)
    engine = _gated(target, DraftModelDrafter(twin, k=4), margin=1000.0)
    res = generate(engine, [prompt], 80)[0]
    assert res.tokens == ar_tokens(target, [prompt], 80)[0]
    gate = engine.gate
    assert gate is not None and gate.turned_off >= 3 and gate.ar_steps > 0
    stats = res.stats
    assert sum(stats.drafted) > 0
    for i, n in enumerate(stats.drafted):
        assert stats.accepted[i] == n, f"draft position {i}: {stats.accepted[i]}/{n} accepted"


def test_the_build_gates_the_stock_engine_by_default(model_dir: Path) -> None:
    from specpilot.engine.build import build_engine

    dep = DeploymentSpec(target=str(model_dir), drafter="ngram", device="cpu")
    on = build_engine(EngineConfig(dep, k=4))
    assert on.engine().gate is not None
    off = EngineConfig(dep, k=4, gate={"enabled": False})
    assert build_engine(off, target=on.target).engine().gate is None
    assert on.stock_engine().gate is None


def test_the_tuner_searches_the_gate_where_it_can_pause_the_drafter() -> None:
    from specpilot.tune.space import describe, directions_for

    def names(drafter: str, sim: str | None = None) -> dict[str, object]:
        dep = DeploymentSpec(target="x", drafter=drafter, simulate_acceptance=sim)
        k = 15 if drafter == "block" else 4
        return {d.name: d for d in directions_for(EngineConfig(dep, k=k), "cpu", "llama", 4)}

    ngram = names("ngram")
    assert "spec-gate" in ngram and "spec-gate" in names("draft-model")
    assert "spec-gate" not in names("block")
    assert "spec-gate" not in names("ngram", "tau=3,block=5")
    d = ngram["spec-gate"]
    base = EngineConfig(DeploymentSpec(target="x"), k=4)
    off = d.derive(base, {"enabled": False, "margin": 0.1, "off_tokens": 8})  # type: ignore[attr-defined]
    assert not off.gate_settings().enabled and "gate=off" in describe(off)
    on = d.derive(base, {"enabled": True, "margin": 0.1, "off_tokens": 32})  # type: ignore[attr-defined]
    assert on.gate_settings().off_tokens == 32 and on.gate_settings().enabled


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda_graphs"])
@pytest.mark.parametrize("kind", ["ngram", "draft-model"])
def test_scheduled_gated_rows_equal_ar(kind: str, graphs: bool) -> None:
    """Continuous batching (eager on the CPU, CUDA graphs on a GPU, fp32): AR windows and
    speculative cycles interleave per the gate (forced off at every verdict), rows are refilled;
    every request equals its AR output, and a twin draft model accepts every draft."""
    from specpilot.engine import Scheduler
    from specpilot.synthetic import build_target

    if graphs and not torch.cuda.is_available():
        pytest.skip("CUDA graphs need a GPU")
    dev = "cuda" if graphs else "cpu"
    rng = random.Random(5)
    model = build_target("tiny-llama", dev, torch.float32, seed=2, max_positions=1024)
    twin = build_target("tiny-llama", dev, torch.float32, seed=2, max_positions=1024)
    drafter = NgramDrafter(k=6) if kind == "ngram" else DraftModelDrafter(twin, k=4)
    gate = SpecGate(GateSettings(margin=1000.0, warmup_cycles=2, probe_cycles=2, off_tokens=3))
    engine = Engine(model, drafter, graphs=graphs, attn_bucket=32, sync_every=4, gate=gate)
    vocab = model.cfg.vocab_size
    prompts = [tuple(repetitive_prompt(rng, vocab, rng.randint(4, 40))) for _ in range(6)]
    from specpilot.engine import Request

    reqs = [Request(f"r{i}", p, 40, frozenset()) for i, p in enumerate(prompts)]
    res = Scheduler(engine, slots=3, segment_tokens=16, max_context=100).run(reqs)
    want = [ar_tokens(model, [list(p)], 40)[0] for p in prompts]
    assert [r.tokens for r in res] == want
    assert gate.turned_off > 0 and gate.ar_steps > 0
    assert engine.runner.captures > 0 or not graphs
    if kind == "draft-model":  # the twin catches up: every drafted token is accepted
        for r in res:
            assert r.stats.accepted == r.stats.drafted
