"""Target and drafter networks in plain PyTorch, and the static KV cache."""

from specpilot.models.kv_cache import KVCache
from specpilot.models.transformer import ForwardOutput, Transformer

__all__ = ["ForwardOutput", "KVCache", "Transformer"]
