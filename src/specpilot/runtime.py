"""Turn what a user names (model spec, dtype, device, drafter) into ready objects."""

from __future__ import annotations

import gc
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from specpilot.config import ModelConfig
from specpilot.drafters import CHECKPOINT_DRAFTERS, DRAFTERS, Drafter, make_drafter
from specpilot.errors import CheckpointError, IncompatibleDrafterError, SpecPilotError
from specpilot.loading import (
    TextTokenizer,
    load_checkpoint,
    load_gguf,
    load_tokenizer,
    resolve_model,
)
from specpilot.loading.converted import load_with_converted_copy
from specpilot.models.transformer import Transformer
from specpilot.progress import QUIET, Progress

DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}
DEFAULT_MAX_CONTEXT = 8192
"""RoPE table and context cap unless the user asks for more (the model's own limit still applies)."""


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise SpecPilotError(f"Unknown dtype '{name}'; choose fp32, bf16 or fp16.") from None


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def parse_device(name: str) -> torch.device:
    """``cpu``, ``cuda``, ``cuda:N`` or ``auto`` as a device this machine has; one sentence if not."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        raise SpecPilotError(
            f"Unknown device '{name}'; choose cpu, cuda, cuda:N or auto."
        ) from None
    if dev.type not in ("cpu", "cuda"):
        raise SpecPilotError(
            f"SpecPilot runs on the CPU or a CUDA GPU, not on '{name}'; choose cpu, cuda, cuda:N "
            "or auto."
        )
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise SpecPilotError(
                "--device cuda was asked for but no CUDA GPU is visible; use --device cpu."
            )
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise SpecPilotError(
                f"--device {name} names GPU {dev.index}, but this machine shows {count} "
                f"(cuda:0 to cuda:{count - 1})."
            )
    return dev


def free_device_memory(device: torch.device) -> None:
    """Give back what dropped objects held: collect their reference cycles (engines, runners,
    CUDA graphs), then return the cached blocks to the device."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def check_dtype_on_device(dtype: torch.dtype, device: torch.device) -> None:
    """Refuse a dtype the device cannot compute in (bf16 on a GPU older than Ampere)."""
    if dtype == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise SpecPilotError(
            f"{torch.cuda.get_device_name(device)} does not compute in bf16; use --dtype fp16 or "
            "fp32."
        )


@dataclass(slots=True)
class LoadedModel:
    spec: str
    model: Transformer
    tokenizer: TextTokenizer | None


def load_model(
    spec: str,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    max_context: int = DEFAULT_MAX_CONTEXT,
    with_tokenizer: bool = True,
    progress: Progress = QUIET,
) -> LoadedModel:
    """Load a known model name, a HF directory or a GGUF file into a :class:`Transformer`.

    A GGUF is read and dequantized once: its network's float32 weights are kept in the cache
    (``loading/converted.py``) and later loads map them (fp32 on the CPU: without a copy)."""
    path = resolve_model(spec, progress)
    cpu = torch.device(device).type == "cpu"
    if path.is_file():

        def convert(source: Path, progress: Progress) -> tuple[ModelConfig, dict[str, Tensor]]:
            return _gguf_network_weights(source, progress, gemv=cpu)

        # A copy made for the CPU holds its [in, out] copies too, and serves a GPU as well.
        cfg, weights = load_with_converted_copy(
            path,
            convert,
            progress,
            NETWORK_LAYOUT_CPU if cpu else NETWORK_LAYOUT,
            _check_network_weights,
            also_accept=() if cpu else (NETWORK_LAYOUT_CPU,),
        )
    else:
        cfg, tensors = load_checkpoint(path, progress)
    progress.phase(f"placing the weights ({dtype_name(dtype)}, {device})")
    model = Transformer(
        cfg, dtype=dtype, device=device, max_positions=min(cfg.max_position_embeddings, max_context)
    )
    if path.is_file():
        model.adopt_weights(weights)
        del weights
    else:
        model.load_hf_state_dict(tensors)
        del tensors
    if cpu and not model.has_gemv_copies:
        model.add_gemv_copies()
    tokenizer = load_tokenizer(path, progress) if with_tokenizer else None
    return LoadedModel(spec=spec, model=model, tokenizer=tokenizer)


NETWORK_LAYOUT = "transformer-weights-1"
"""What a converted copy holds: ``Transformer.weights`` (change it when their names change)."""
NETWORK_LAYOUT_CPU = NETWORK_LAYOUT + "+gemv"
"""The same with the CPU's ``[in, out]`` copies of its one-row products."""


def _gguf_network_weights(
    path: Path, progress: Progress, gemv: bool
) -> tuple[ModelConfig, dict[str, Tensor]]:
    """A GGUF's network weights in float32 on the CPU, as ``Transformer.weights`` names them
    (``gemv``: with the CPU's ``[in, out]`` copies, for a load on the CPU)."""
    cfg, tensors = load_gguf(path, progress)
    progress.phase(f"fusing the weights of {path.name}")
    net = Transformer(cfg, dtype=torch.float32, device="cpu", max_positions=1)
    net.load_hf_state_dict(tensors)
    del tensors
    if gemv:
        net.add_gemv_copies()
    return cfg, net.weights()


def _check_network_weights(cfg: ModelConfig, weights: Mapping[str, Tensor], where: str) -> None:
    got = {name: tuple(t.shape) for name, t in weights.items()}
    if got not in (Transformer.weight_shapes(cfg), Transformer.weight_shapes(cfg, gemv=True)):
        raise CheckpointError(f"{where} holds weights of another shape than its config implies.")


BLOCK_KNOBS = ("layers", "context_layers", "seed")
"""Knobs of the block drafter: its decoder layers, the target layers it reads, its weights' seed."""


def build_drafter(
    name: str | None,
    target: LoadedModel,
    k: int,
    draft_model: LoadedModel | None = None,
    knobs: dict[str, Any] | None = None,
    draft_path: str | None = None,
) -> Drafter | None:
    """The drafter named ``name`` for ``target`` (None or "none": plain AR decoding);
    ``draft_path``: the checkpoint directory of a drafter that loads its own (DFlash)."""
    if name in (None, "none") or k == 0:
        return None
    if name not in DRAFTERS:
        raise SpecPilotError(
            f"Unknown drafter '{name}'; choose one of none, {', '.join(sorted(DRAFTERS))}."
        )
    knobs = dict(knobs or {})
    vocab = target.model.cfg.vocab_size
    if name in CHECKPOINT_DRAFTERS:
        if draft_path is None:  # the drafter that ships for this target, if one does
            from specpilot.drafters.shipped import shipped_drafter

            found = shipped_drafter(target.spec, name)
            draft_path = None if found is None else str(found)
        if draft_path is None:
            raise SpecPilotError(
                f"The {name} drafter needs --draft-model DIR, a {name} checkpoint directory "
                "(config.json + safetensors)"
                + ("" if name == "eagle3" else "; train one with specpilot train-drafter")
                + "."
            )
        if knobs:
            raise SpecPilotError(f"The {name} drafter has no knob(s) {sorted(knobs)}.")
        try:
            return make_drafter(name, target=target.model, path=draft_path, k=k)
        except ValueError as e:
            raise SpecPilotError(f"The {name} drafter: {e}.") from None
    if name == "draft-model" and draft_model is None and "exit_layers" in knobs:
        # No separate draft model: the target's first ``exit_layers`` layers draft (early exit).
        from specpilot.drafters.early_exit import early_exit_model

        try:
            early = early_exit_model(target.model, int(knobs["exit_layers"]))
        except ValueError as e:
            raise SpecPilotError(f"{e}.") from None
        return make_drafter(name, model=early, k=k, target_vocab_size=vocab)
    if name == "draft-model":
        if draft_model is None:
            raise SpecPilotError(
                "The draft-model drafter needs --draft-model (a smaller model with the same tokenizer)."
            )
        check_same_vocabulary(target, draft_model)
        return make_drafter(name, model=draft_model.model, k=k, target_vocab_size=vocab)
    if name == "block":
        unknown = set(knobs) - set(BLOCK_KNOBS)
        if unknown:
            raise SpecPilotError(f"The block drafter has no knob(s) {sorted(unknown)}.")
        from specpilot.drafters.block_drafter import BlockDrafter

        drafter = BlockDrafter(
            target.model,
            num_layers=int(knobs.get("layers", 5)),
            block=k + 1,
            num_context_layers=int(knobs.get("context_layers", 5)),
        )
        # Random weights of the published shape (no checkpoint format is loaded yet): for timing
        # under --simulate-acceptance; real acceptance of random weights is near zero.
        drafter.weights.init_random(int(knobs.get("seed", 0)))
        return drafter
    try:
        return make_drafter(name, k=k, **knobs)
    except (TypeError, ValueError) as e:
        raise SpecPilotError(f"The {name} drafter: {e}.") from None


def check_same_vocabulary(target: LoadedModel, drafter: LoadedModel) -> None:
    """Refuse a drafter whose tokenizer maps text to other ids than the target's."""
    tv, dv = target.model.cfg.vocab_size, drafter.model.cfg.vocab_size
    if tv != dv:
        raise IncompatibleDrafterError(
            f"The drafter {drafter.spec} has a vocabulary of {dv} tokens and the target {target.spec} "
            f"one of {tv}; a draft model must share the target's tokenizer."
        )
    tt, dt = target.tokenizer, drafter.tokenizer
    if tt is not None and dt is not None and tt.vocab() != dt.vocab():
        raise IncompatibleDrafterError(
            f"The drafter {drafter.spec} and the target {target.spec} have vocabularies of the same "
            "size but different tokens; a draft model must share the target's tokenizer."
        )
