"""Load a GGUF file (llama.cpp's format) into a config and float32 tensors under HF names.

Two things differ from a HF checkpoint and are undone here:

* Quantized tensors (Q4_1, Q8_0, ...) are dequantized to float32 with ``gguf.quants.dequantize``;
  the engine then sees ordinary dense weights, and its stock path is the reference for losslessness.
* llama.cpp's converter permutes the rows of ``attn_q`` and ``attn_k`` for arch ``llama`` so that
  RoPE can rotate adjacent pairs (GPT-J style) instead of HF's halves (``rotate_half``). We invert
  that permutation, so the tensors match the HF checkpoint the GGUF was made from. Qwen2/Qwen3
  GGUFs are not permuted by the converter.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specpilot.config import SUPPORTED_ARCHS, ModelConfig
from specpilot.errors import CheckpointError
from specpilot.loading.names import check_tensors
from specpilot.progress import QUIET, Progress

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def gguf_to_hf_name(name: str) -> str | None:
    """HF name of a GGUF tensor name, or None if it is not one SpecPilot knows."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _BLOCK_RE.match(name)
    if m is None or m.group(2) not in _BLOCK_NAMES:
        return None
    return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"


def permute_for_gguf(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's Q/K row permutation (``LlamaModel.permute`` in convert_hf_to_gguf.py).

    w: [n_head * head_dim, ...]. Within a head, HF row ``h * head_dim/2 + i`` (half h, pair i)
    moves to row ``2 * i + h``: the two rotated halves become interleaved pairs.
    """
    d = w.shape[0] // n_head
    return w.reshape(n_head, 2, d // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def unpermute_from_gguf(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of ``permute_for_gguf``: interleaved pairs back to HF's two halves per head.

    w: [n_head * head_dim, ...] (a weight [rows, hidden] or a bias [rows]).
    """
    d = w.shape[0] // n_head
    return w.reshape(n_head, d // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class _Meta:
    """Typed access to a GGUF reader's key/value fields, with errors that name the file."""

    def __init__(self, reader: Any, path: Path) -> None:
        self.fields = reader.fields
        self.path = path

    def get(self, key: str, default: Any = None) -> Any:
        field = self.fields.get(key)
        if field is None or not field.data:
            return default
        from gguf import GGUFValueType

        def one(idx: int, vtype: Any) -> Any:
            part = field.parts[idx]
            if vtype == GGUFValueType.STRING:
                return bytes(part).decode("utf-8", "replace")
            return part.tolist()[0]

        if field.types[0] == GGUFValueType.ARRAY:
            return [one(i, field.types[-1]) for i in field.data]
        return one(field.data[0], field.types[0])

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise CheckpointError(f"{self.path} lacks the GGUF metadata key {key}.")
        return value

    def count(self, key: str) -> int:
        """Number of elements of an array field (0 if absent), without decoding them."""
        field = self.fields.get(key)
        return 0 if field is None else len(field.data)


def _why(e: BaseException) -> str:
    """An exception as one short line, for the parenthesis of a one-sentence error."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:200]}" if text else type(e).__name__


def _open_reader(path: Path) -> Any:
    from gguf import GGUFReader

    if not path.is_file():
        raise CheckpointError(f"GGUF file {path} does not exist.")
    try:
        return GGUFReader(str(path), "r")
    except Exception as e:  # the reader raises ValueError/KeyError/IndexError on damaged files
        raise CheckpointError(f"{path} is truncated or not a GGUF file ({_why(e)}).") from None


def _f32(x: float) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.9999997e-06)."""
    return float(str(np.float32(x)))


def _config_from_meta(meta: _Meta, has: set[str]) -> ModelConfig:
    arch = str(meta.require("general.architecture"))
    if arch not in SUPPORTED_ARCHS:
        raise CheckpointError(
            f"{meta.path} is a '{arch}' GGUF; SpecPilot loads {', '.join(SUPPORTED_ARCHS)} GGUFs."
        )
    rope_type = meta.get(f"{arch}.rope.scaling.type", "none")
    if rope_type not in ("none", None) or "rope_freqs.weight" in has:
        raise CheckpointError(
            f"{meta.path} uses RoPE scaling, which the GGUF loader does not rebuild yet; "
            "load the model's Hugging Face directory instead."
        )
    hidden = int(meta.require(f"{arch}.embedding_length"))
    heads = int(meta.require(f"{arch}.attention.head_count"))
    eos = [meta.get(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    bos = meta.get("tokenizer.ggml.bos_token_id")
    vocab = meta.count("tokenizer.ggml.tokens") or int(meta.get(f"{arch}.vocab_size", 0))
    return ModelConfig(
        arch=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(meta.require(f"{arch}.feed_forward_length")),
        num_layers=int(meta.require(f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(meta.get(f"{arch}.attention.key_length", hidden // heads)),
        rms_norm_eps=_f32(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=_f32(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(meta.get(f"{arch}.context_length", 4096)),
        tie_word_embeddings="output.weight" not in has,
        attention_bias="blk.0.attn_q.bias" in has,
        qk_norm=arch == "qwen3",
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
    )


def load_gguf(
    path: str | Path, progress: Progress = QUIET
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a GGUF into a config and float32 tensors under HF names, Q/K unpermuted for llama.

    Takes a few seconds and 0.6 GB for SmolLM2-135M on a CPU: the reader parses 49k tokens and
    48k merges of metadata, and every tensor is dequantized up front (``loading/converted.py``
    keeps the result, so that only the first start pays this).
    """
    from gguf.quants import dequantize

    path = Path(path).expanduser()
    progress.phase(f"reading {path.name}")
    reader = _open_reader(path)
    meta = _Meta(reader, path)
    cfg = _config_from_meta(meta, {t.name for t in reader.tensors})
    tensors: dict[str, torch.Tensor] = {}
    progress.phase(f"dequantizing {path.name}")
    for i, t in enumerate(reader.tensors):
        progress.detail(f"tensor {i + 1}/{len(reader.tensors)}")
        hf_name = gguf_to_hf_name(t.name)
        if hf_name is None:
            raise CheckpointError(
                f"{path} has tensor {t.name}, which SpecPilot does not know how to load."
            )
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # GGUF lists dims innermost first
        try:
            arr = dequantize(t.data, t.tensor_type)
            # np.array copies: F32 data is a read-only view into the memory-mapped file.
            w = torch.from_numpy(np.array(arr, dtype=np.float32)).reshape(shape)
        except Exception as e:  # truncated data, unknown quant type
            raise CheckpointError(
                f"{path}: tensor {t.name} could not be read ({_why(e)})."
            ) from None
        if cfg.arch == "llama" and (".attn_q." in t.name or ".attn_k." in t.name):
            n_head = cfg.num_heads if ".attn_q." in t.name else cfg.num_kv_heads
            w = unpermute_from_gguf(w, n_head)
        tensors[hf_name] = w
    embed = tensors.get("model.embed_tokens.weight")
    if embed is not None and embed.shape[0] != cfg.vocab_size:
        raise CheckpointError(
            f"{path} lists {cfg.vocab_size} tokens but its embedding has {embed.shape[0]} rows."
        )
    check_tensors(cfg, tensors, str(path))
    return cfg, tensors
