"""The ``int8-drafter`` mechanism: the drafter's matrices and drafting head read an INT8 copy,
the target's forward never does (fp32 spec == AR for it: tests/engine_cases.py)."""

from __future__ import annotations

import random

import pytest

from conftest import tiny_config, tiny_model
from engine_cases import (
    ar_tokens,
    block_drafter,
    int8_drafter,
    repetitive_prompt,
)
from specpilot.drafters import DraftModelDrafter, NgramDrafter
from specpilot.drafters.early_exit import early_exit_model
from specpilot.engine import Engine, generate
from specpilot.engine.config import DeploymentSpec, EngineConfig
from specpilot.errors import SpecPilotError
from specpilot.mechanisms.int8_copy import Int8Linear
from specpilot.tune.space import directions_for


def test_the_drafter_runs_its_int8_copy_and_the_target_runs_its_own_weights(monkeypatch):
    cfg = tiny_config(arch="llama", heads=4, kv_heads=2, vocab=101)
    target = tiny_model(cfg, 0)
    drafter = int8_drafter(target, block_drafter(target, 5))
    assert all(not layer.linear_fns for layer in target.layers)
    assert getattr(target, "lm_head_fn", None) is None
    assert set(drafter.fwd.layers[0].linear_fns) == {"w_qkv", "w_o", "w_gate_up", "w_down"}
    assert drafter.fwd.head_fn is not None
    with pytest.raises(SpecPilotError, match="already have a kernel"):
        int8_drafter(target, drafter)  # twice: refused, nothing replaced

    calls: list[tuple[int, int]] = []  # (rows, out features) of every INT8 call
    real = Int8Linear.__call__

    def counted(self, x, bias=None):
        calls.append((x.reshape(-1, x.shape[-1]).shape[0], self.int8.shape[0]))
        return real(self, x, bias)

    monkeypatch.setattr(Int8Linear, "__call__", counted)
    rng = random.Random(5)
    prompts = [repetitive_prompt(rng, cfg.vocab_size, 20) for _ in range(2)]
    want = ar_tokens(target, prompts, 24)
    engine = Engine(target, drafter)
    got = generate(engine, prompts, 24, [])
    assert [r.tokens for r in got] == want
    assert any(n == cfg.vocab_size for _, n in calls), "the drafting head ran from the copy"
    assert any(n == 2 * cfg.intermediate_size for _, n in calls), "gate_up ran from the copy"


def test_drafters_without_their_own_layers_are_refused():
    cfg = tiny_config(arch="llama", heads=4, kv_heads=2, vocab=101)
    target = tiny_model(cfg, 0)
    with pytest.raises(SpecPilotError, match="target's own layers"):
        int8_drafter(target, DraftModelDrafter(early_exit_model(target, 1), k=3))
    assert all(not layer.linear_fns for layer in target.layers)  # refused before any change
    with pytest.raises(SpecPilotError, match="no layers of its own"):
        int8_drafter(target, NgramDrafter(k=4))


def test_the_tuner_offers_it_where_a_learned_drafter_runs_on_cuda_in_bf16_only():
    def names(drafter: str, device: str, dtype: str) -> set[str]:
        dep = DeploymentSpec(target="t", drafter=drafter, device=device, dtype=dtype)
        base = EngineConfig(deployment=dep, k=7)
        return {d.name for d in directions_for(base, device, "llama")}

    assert "mechanism:int8-drafter" in names("block", "cuda", "bf16")
    assert "mechanism:int8-drafter" not in names("ngram", "cuda", "bf16")
    assert "mechanism:int8-drafter" not in names("block", "cpu", "fp32")
