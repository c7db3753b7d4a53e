"""Shared fixtures: tiny random models built from a seed, in fp32."""

from __future__ import annotations

import os

import pytest
import torch

from specpilot.config import ModelConfig
from specpilot.models import Transformer

# Two cores in CI: keep torch from oversubscribing them when pytest runs alongside other work.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def tiny_config(
    arch: str = "llama",
    vocab: int = 97,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    layers: int = 2,
    tie: bool = False,
    **kw: object,
) -> ModelConfig:
    return ModelConfig(
        arch=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden + 16,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
        attention_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
        **kw,  # type: ignore[arg-type]
    )


def tiny_model(cfg: ModelConfig, seed: int, std: float = 0.15) -> Transformer:
    model = Transformer(cfg, dtype=torch.float32, device="cpu")
    model.init_random(seed, std=std)
    return model


@pytest.fixture
def make_tiny():
    return tiny_model
