"""The peaked random target: a trained model's clear top-1 margins at the same shapes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specpilot.forcing import force_tokens
from specpilot.models.transformer import Transformer
from specpilot.synthetic import TARGET_SHAPES, build_target, init_random_on_device, make_peaked


def _target(dtype: torch.dtype) -> Transformer:
    cfg = dataclasses.replace(
        TARGET_SHAPES["llama3-8b"], num_layers=3, hidden_size=256, intermediate_size=512,
        num_heads=4, num_kv_heads=2, head_dim=64, vocab_size=2048,
    )  # fmt: skip
    model = Transformer(cfg, dtype=dtype, device="cpu", max_positions=256)
    init_random_on_device(model, 0)
    return model


def test_peaked_target_counts_up_with_wide_margins() -> None:
    model = make_peaked(_target(torch.bfloat16))
    prompt = [5, 900, 17, 1200]
    cache = model.allocate_cache(1, 64)
    ids = list(prompt)
    for _ in range(12):  # plain greedy decoding, one token at a time, no cache reuse tricks
        cache.lengths.zero_()
        nxt = int(model(torch.tensor([ids]), cache).logits[0, -1].argmax())
        ids.append(nxt)
    assert ids[len(prompt) :] == [(prompt[-1] + 1 + i) % 2048 for i in range(12)]
    report = force_tokens(model, [("0", prompt, ids[len(prompt) :])])
    assert report.ok and report.near_ties == 0


def test_peaked_target_refuses_tied_embeddings() -> None:
    with pytest.raises(ValueError, match="untied"):
        make_peaked(build_target("smollm2-135m", "cpu", torch.float32, max_positions=16))
