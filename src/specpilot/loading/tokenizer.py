"""Text in, token ids out: a thin wrapper over a transformers tokenizer from a HF dir or a GGUF.

The wrapper pins down the few choices that decide which token ids the engine sees, so that every
command (generate, bench, serve) feeds the target the same prompt:

* ``encode`` adds exactly the special tokens the tokenizer's own config asks for (a BOS for
  Llama-3, none for SmolLM2 or Qwen);
* ``apply_chat_template`` renders the template to text and encodes it *without* adding special
  tokens, because templates already write their BOS where they want it;
* ``eos_token_ids`` includes the chat turn end (``<|im_end|>``, ``<|eot_id|>``, ...) whenever the
  template uses it, since chat models end their answer with it rather than with the base EOS.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specpilot.errors import CheckpointError
from specpilot.loading.fetch import cache_dir
from specpilot.progress import QUIET, Progress

CHAT_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")
"""Turn-end markers of common chat templates; one counts as EOS when the template writes it."""


class TextTokenizer:
    """A loaded tokenizer with SpecPilot's conventions; build it with ``load_tokenizer``."""

    def __init__(self, tokenizer: Any, name: str, extra_eos_ids: Sequence[int] = ()) -> None:
        self._tok = tokenizer
        self._name = name
        self._eos = self._find_eos_ids(extra_eos_ids)

    def _find_eos_ids(self, extra: Sequence[int]) -> tuple[int, ...]:
        ids: list[int] = []
        if self._tok.eos_token_id is not None:
            ids.append(int(self._tok.eos_token_id))
        ids += [int(i) for i in extra]
        template = self._tok.chat_template if isinstance(self._tok.chat_template, str) else ""
        vocab = self._tok.get_vocab()
        ids += [vocab[t] for t in CHAT_END_TOKENS if t in template and t in vocab]
        return tuple(dict.fromkeys(ids))

    @property
    def name(self) -> str:
        """The model directory's or GGUF file's name, for reports."""
        return self._name

    @property
    def vocab_size(self) -> int:
        """Tokens the tokenizer can emit, added tokens included (may be below the model's vocab)."""
        return len(self._tok)

    def vocab(self) -> dict[str, int]:
        """Token string → id, added tokens included (to compare a drafter's tokenizer with a target's)."""
        return dict(self._tok.get_vocab())

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end generation: the tokenizer's EOS, generation_config's, and the chat turn end."""
        return self._eos

    @property
    def has_chat_template(self) -> bool:
        return bool(self._tok.chat_template)

    def encode(self, text: str) -> list[int]:
        """Token ids of raw text, with the special tokens the tokenizer's config adds (e.g. BOS)."""
        return list(self._tok.encode(text, add_special_tokens=True))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; special tokens are kept by default so nothing is silently dropped."""
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def pieces(self, ids: Sequence[int]) -> list[str]:
        """The vocabulary entry of each id (byte-level, e.g. ``Ġthe``), for forcing reports."""
        return [str(p) for p in self._tok.convert_ids_to_tokens(list(ids))]

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """The chat template applied to ``messages``, ending with the assistant turn's header."""
        if not self.has_chat_template:
            raise CheckpointError(
                f"Tokenizer {self._name} has no chat template; pass raw text instead."
            )
        text = self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return str(text)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of ``messages`` in the chat template, ready for the assistant to answer."""
        # The rendered text already holds every special token the template wants (BOS included).
        return list(self._tok.encode(self.render_chat(messages), add_special_tokens=False))

    def __repr__(self) -> str:
        return f"TextTokenizer({self._name!r}, vocab={self.vocab_size}, eos={self._eos})"


def _generation_eos(root: Path) -> list[int]:
    """EOS ids from a HF dir's generation_config.json, which chat models use to add turn ends."""
    path = root / "generation_config.json"
    if not path.is_file():
        return []
    try:
        eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    except (OSError, json.JSONDecodeError, AttributeError):
        return []
    if isinstance(eos, int):
        return [eos]
    return [int(e) for e in eos] if isinstance(eos, list) else []


def _gguf_tokenizer(path: Path, progress: Progress) -> Any:
    """The tokenizer embedded in a GGUF, converted once and then read from the cache.

    transformers rebuilds a GGUF's tokenizer from its vocabulary and merges (seconds for a 49k
    vocabulary); the converted files are keyed by the GGUF's name, size and mtime, written to a
    temporary folder and renamed into place. A saved copy that no longer loads is rebuilt.
    """
    from transformers import AutoTokenizer

    stat = path.stat()
    saved = cache_dir() / "tokenizers" / f"{path.stem}-{stat.st_size}-{int(stat.st_mtime)}"
    if (saved / "tokenizer.json").is_file():
        progress.phase(f"loading the tokenizer of {path.name}")
        try:
            return AutoTokenizer.from_pretrained(str(saved), local_files_only=True)
        except Exception as e:  # a damaged copy: OSError, ValueError, JSON errors from tokenizers
            progress.note(
                f"the converted tokenizer in {saved} does not load ({_first_line(e)}); "
                "rebuilding it."
            )
            shutil.rmtree(saved, ignore_errors=True)
    progress.phase(f"converting the tokenizer of {path.name}")
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tmp = saved.with_name(saved.name + f".part{os.getpid()}")
    try:
        tok.save_pretrained(str(tmp))
        tmp.replace(saved)
    except OSError:
        pass  # a read-only cache (or another process that saved it first) costs nothing
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return tok


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def load_tokenizer(path: str | Path, progress: Progress = QUIET) -> TextTokenizer:
    """Load the tokenizer of a HF model directory or of a ``.gguf`` file (which embeds one)."""
    from transformers import AutoTokenizer

    path = Path(path).expanduser()
    try:
        if path.is_file() and path.suffix.lower() == ".gguf":
            return TextTokenizer(_gguf_tokenizer(path, progress), path.stem)
        if path.is_dir():
            progress.phase(f"loading the tokenizer of {path.name}")
            tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
            return TextTokenizer(tok, path.name, _generation_eos(path))
    except CheckpointError:
        raise
    except Exception as e:  # transformers raises OSError/ValueError/KeyError on bad tokenizer files
        raise CheckpointError(
            f"Could not load a tokenizer from {path} ({_first_line(e)})."
        ) from None
    raise CheckpointError(
        f"{path} is neither a model directory nor a .gguf file, so it has no tokenizer."
    )
