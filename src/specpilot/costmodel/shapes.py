"""Model and drafter shapes for predictions on paper (no weights needed, only a ModelConfig).

Targets are the public configs, plus ``dense-27b``, the reference system's Qwen3.8-27B-class
target. We assume 64 layers, hidden 5120, 40 query heads and 8 KV heads of head_dim 128, vocab
151936 (Qwen tokenizer), untied LM head, Qwen3 q/k-norm, and SwiGLU intermediate **21504**: with
that skeleton the MLP width sets the size, and 21504 gives 26.7B parameters (17408 would give
22.7B, not 27B-class). This is the same shape as ``specpilot.synthetic``'s ``dense-27b`` (a test
keeps the two tables in agreement), so on-paper and measured figures describe one model.

Drafters: ``dflash-b16`` is a DFlash2-like block drafter — 5 decoder layers at the target's own
width (same heads and MLP), conditioned on 5 target layers, drafting a block of 16 (15 drafted
tokens) in one forward through the target's LM head; draft models are plain ModelConfigs.
"""

from __future__ import annotations

from dataclasses import dataclass

from specpilot.config import ModelConfig

TARGETS: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(
        arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, tie_word_embeddings=True,
    ),
    "llama3-8b": ModelConfig(
        arch="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
    ),
    "qwen3-8b": ModelConfig(
        arch="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
        num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, qk_norm=True,
    ),
    "dense-27b": ModelConfig(
        arch="qwen3", vocab_size=151936, hidden_size=5120, intermediate_size=21504,
        num_layers=64, num_heads=40, num_kv_heads=8, head_dim=128, qk_norm=True,
    ),
}  # fmt: skip
"""Name → target shape (``specpilot profile --paper GPU --shape NAME``)."""

DRAFT_MODELS: dict[str, ModelConfig] = {
    "llama3.2-1b": ModelConfig(
        arch="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64, tie_word_embeddings=True,
    ),
    "qwen3-0.6b": ModelConfig(
        arch="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
        num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128, qk_norm=True,
        tie_word_embeddings=True,
    ),
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class BlockDrafterSpec:
    """A DFlash-like block drafter: ``num_layers`` layers at the target's width."""

    num_layers: int
    block: int
    """Tokens per block, the bonus slot included: ``block - 1`` drafted per forward."""
    num_context_layers: int
    """Target layers whose hidden states are concatenated and projected to the context."""

    @property
    def k(self) -> int:
        return self.block - 1


BLOCK_DRAFTERS: dict[str, BlockDrafterSpec] = {
    "dflash-b16": BlockDrafterSpec(num_layers=5, block=16, num_context_layers=5),
    "dflash-b9": BlockDrafterSpec(num_layers=5, block=9, num_context_layers=5),
}


def target_shape(name: str) -> ModelConfig:
    try:
        return TARGETS[name]
    except KeyError:
        raise ValueError(f"Unknown shape '{name}'; choose one of {', '.join(TARGETS)}.") from None
