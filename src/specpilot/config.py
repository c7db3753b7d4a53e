"""Model architecture description shared by the networks, the loaders and the cost model."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from specpilot.errors import CheckpointError

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")


SIZE_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
    "head_dim",
)  # fmt: skip
"""The sizes of a :class:`ModelConfig` (each must be positive)."""


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama-3 style frequency-dependent RoPE scaling (``rope_type: llama3``)."""

    factor: float
    """Context extension factor applied to the low frequencies."""
    low_freq_factor: float
    """Wavelengths above original_max/low_freq_factor are fully scaled."""
    high_freq_factor: float
    """Wavelengths below original_max/high_freq_factor are left alone."""
    original_max_position_embeddings: int
    """Context length the model was pretrained with."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """A dense decoder-only transformer of the Llama / Qwen2 / Qwen3 families."""

    arch: str
    """One of ``SUPPORTED_ARCHS``: llama (also SmolLM2), qwen2 (qkv bias), qwen3 (q/k RMSNorm)."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    """Grouped-query attention: ``num_heads`` must be a multiple of it."""
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    """Bias on the q, k and v projections (Qwen2)."""
    qk_norm: bool = False
    """RMSNorm over head_dim on q and k before RoPE (Qwen3)."""
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHS:
            raise CheckpointError(
                f"Architecture '{self.arch}' is not supported; SpecPilot runs {', '.join(SUPPORTED_ARCHS)}."
            )
        for name in SIZE_FIELDS:
            if getattr(self, name) <= 0:
                raise CheckpointError(
                    f"Model config field {name} must be positive, got {getattr(self, name)}."
                )
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})."
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def matrix_params(self, in_width: int | None = None) -> int:
        """Weights of one layer's matrices: q/k/v (reading ``in_width`` columns; None: the hidden
        size), o, and the MLP's gate, up and down."""
        h, qkv = self.hidden_size, self.q_size + 2 * self.kv_size
        return (in_width or h) * qkv + self.q_size * h + 3 * h * self.intermediate_size

    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        h, v = self.hidden_size, self.vocab_size
        attn_bias = self.q_size + 2 * self.kv_size if self.attention_bias else 0
        per_layer = (
            self.matrix_params() + attn_bias + 2 * h + (2 * self.head_dim if self.qk_norm else 0)
        )
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_layers * per_layer + h + head

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        return cls(**d)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], where: str = "config.json") -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dictionary; a missing or bad field is named
        in the error (``where``: the file, for the message)."""
        model_type = str(cfg.get("model_type", "")).lower()
        if model_type not in SUPPORTED_ARCHS:
            raise CheckpointError(
                f"{where} has model_type '{model_type}'; SpecPilot runs {', '.join(SUPPORTED_ARCHS)}."
            )
        fields = _HFFields(cfg, where, model_type)
        hidden = fields.integer("hidden_size")
        heads = fields.integer("num_attention_heads")
        rs = cfg.get("rope_scaling") or (cfg.get("rope_parameters") or None)
        scaling = None
        if rs is not None and not isinstance(rs, dict):
            raise CheckpointError(f"{where} field rope_scaling should be an object, got {rs!r}.")
        if rs and str(rs.get("rope_type", rs.get("type", ""))) == "llama3":
            sub = _HFFields(rs, where, model_type, parent="rope_scaling")
            scaling = RopeScaling(
                factor=sub.number("factor"),
                low_freq_factor=sub.number("low_freq_factor"),
                high_freq_factor=sub.number("high_freq_factor"),
                original_max_position_embeddings=sub.integer("original_max_position_embeddings"),
            )
        theta: Any = cfg.get("rope_theta")
        if theta is None and isinstance(cfg.get("rope_parameters"), dict):
            theta = cfg["rope_parameters"].get("rope_theta")
        eos = cfg.get("eos_token_id")
        if isinstance(eos, list):
            eos_ids = tuple(fields.integer("eos_token_id", v) for v in eos)
        else:
            eos_ids = () if eos is None else (fields.integer("eos_token_id"),)
        bos = cfg.get("bos_token_id")
        return cls(
            arch=model_type,
            vocab_size=fields.integer("vocab_size"),
            hidden_size=hidden,
            intermediate_size=fields.integer("intermediate_size"),
            num_layers=fields.integer("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=fields.integer(
                "num_key_value_heads", cfg.get("num_key_value_heads") or heads
            ),
            head_dim=fields.integer("head_dim", cfg.get("head_dim") or hidden // max(heads, 1)),
            rms_norm_eps=fields.number("rms_norm_eps", cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=fields.number("rope_theta", 10000.0 if theta is None else theta),
            rope_scaling=scaling,
            max_position_embeddings=fields.integer(
                "max_position_embeddings", cfg.get("max_position_embeddings", 4096)
            ),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type == "qwen3",
            bos_token_id=None if bos is None else fields.integer("bos_token_id"),
            eos_token_ids=eos_ids,
        )


_MISSING = object()


class _HFFields:
    """Typed reads of one config.json object; errors name the field and say what is wrong."""

    def __init__(self, d: dict[str, Any], where: str, arch: str, parent: str = "") -> None:
        self.d, self.where, self.arch, self.parent = d, where, arch, parent

    def _raw(self, key: str, value: Any) -> Any:
        name = f"{self.parent}.{key}" if self.parent else key
        if value is _MISSING:
            value = self.d.get(key, _MISSING)
        if value is _MISSING or value is None:
            raise CheckpointError(
                f"{self.where} is missing the field {name}, which a {self.arch} model needs."
            )
        return name, value

    def integer(self, key: str, value: Any = _MISSING) -> int:
        name, value = self._raw(key, value)
        if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
            raise CheckpointError(f"{self.where} field {name} should be an integer, got {value!r}.")
        return int(value)

    def number(self, key: str, value: Any = _MISSING) -> float:
        name, value = self._raw(key, value)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise CheckpointError(f"{self.where} field {name} should be a number, got {value!r}.")
        return float(value)
