"""HF transformers ``generate`` (greedy, eager) on the same checkpoint: the external baseline."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from specpilot.bench.records import RunRecord, make_record
from specpilot.loading import resolve_model


class HFBaseline:
    """Loads the target through transformers (its own GGUF or safetensors reader)."""

    def __init__(self, spec: str, dtype: torch.dtype, device: torch.device) -> None:
        from transformers import AutoModelForCausalLM

        path = resolve_model(spec)
        kwargs: dict[str, Any] = {"dtype": dtype}
        self.model: Any
        if path.is_file():
            with _gguf_parsed_once():
                self.model = AutoModelForCausalLM.from_pretrained(
                    str(path.parent), gguf_file=path.name, **kwargs
                )
        else:
            self.model = AutoModelForCausalLM.from_pretrained(
                str(path), local_files_only=True, **kwargs
            )
        self.model.eval()
        self.model.to(device)
        self.device = device

    @torch.inference_mode()
    def generate(
        self, prompt_ids: Sequence[int], max_new_tokens: int, eos_ids: Sequence[int]
    ) -> list[int]:
        ids = torch.tensor([list(prompt_ids)], device=self.device)
        out = self.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=list(eos_ids) or None,
            pad_token_id=eos_ids[0] if eos_ids else 0,
        )
        return [int(t) for t in out[0, ids.shape[1] :].tolist()]

    def record(
        self,
        prompt_id: str,
        prompt_ids: list[int],
        max_new_tokens: int,
        eos_ids: Sequence[int],
        meta: dict[str, str],
    ) -> RunRecord:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        tokens = self.generate(prompt_ids, max_new_tokens, eos_ids)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - t0
        stop = "eos" if tokens and tokens[-1] in set(eos_ids) else "length"
        return make_record(prompt_id, "hf", meta, prompt_ids, tokens, stop, seconds)


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """transformers' GGUF load, without its repeated work: it parses the file's metadata twice
    (the config, then the weights; the 49k-token vocabulary of SmolLM2 costs ~5 s each time) and
    rebuilds gguf's tensor-name table once per module of the model (~400 times, ~6 s). Both are
    read-only and pure in their arguments, so one instance each serves every call of this load;
    the modules are restored after."""
    import gguf  # transformers imports both names from it at each call

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.lru_cache(maxsize=2)(reader)  # type: ignore[misc,assignment]
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map  # type: ignore[misc]
