"""Incremental detokenization: the text of a growing token list, in time per step that does not
grow with the list.

Decoding the whole list again at every step costs O(n) per step and O(n²) per request, on the
engine thread that every request shares. As HF's ``TextStreamer`` and vLLM's incremental
detokenizer do, only a short window of trailing tokens is decoded: with ``ids[prefix:read]``
already shown, the new text is ``decode(ids[prefix:])`` minus ``decode(ids[prefix:read])``. The
shown tokens stay in the window as context because a decoder treats the first token it sees
differently (SentencePiece drops its leading space) and cleanup rules look at the character before.

A byte-level tokenizer splits an emoji or a CJK character into byte tokens, so the window's text
can end in U+FFFD, the replacement for an incomplete UTF-8 sequence. Everything before that
trailing run is final (UTF-8 decodes left to right, and a complete character settles every byte
before it), so it is shown at once; the run itself is held until a later token completes it or
``flush`` ends the text. The window moves on when its text ends on a complete character (there
the decoder's state is clean, so what follows decodes the same alone as after everything before),
so it spans a step's tokens plus the previous step's. A text that keeps ending in undecodable
bytes (a random model's output) would make it grow; past ``MAX_WINDOW`` tokens it restarts at a
token boundary the decoder has settled: one with at least 4 tokens after it (a UTF-8 character
has at most 4 bytes, so whatever was pending there is resolved) where decoding the two sides
apart gives the window's text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

REPLACEMENT = "\ufffd"
"""What a UTF-8 decoder puts for bytes that are not (yet) a complete character."""
MAX_WINDOW = 32
"""Tokens decoded per step at most (held text aside): past it the window restarts."""
SETTLE_AFTER = 4
"""Tokens after a boundary for it to count as settled (a UTF-8 character has at most 4 bytes)."""
SETTLE_TRIES = 8
"""Boundaries tried, latest first, when the window restarts."""


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...


@dataclass(slots=True)
class IncrementalDetokenizer:
    """``push`` tokens, get the text they add; ``flush`` at the end returns what was held back.

    The concatenation of everything returned equals ``decode(ids, skip_special_tokens)``
    of all the tokens for byte-level BPE and byte-fallback SentencePiece tokenizers
    (``tests/test_serve_detok.py`` checks it on emoji and CJK split across tokens)."""

    tokenizer: Decoder
    skip_special_tokens: bool = True
    ids: list[int] = field(default_factory=list)
    prefix: int = 0
    """Window start: ``ids[prefix:read]`` were shown and are decoded again as context."""
    read: int = 0
    """``ids[:read]`` are shown in full."""
    extra: int = 0
    """Characters of the window shown beyond ``decode(ids[prefix:read])`` (the final part of a
    text that ended in a held-back run)."""
    _shown: str | None = None
    """``decode(ids[prefix:read])``, cached while the window holds."""

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(
            self.ids[start:end], skip_special_tokens=self.skip_special_tokens
        )

    def push(self, new_ids: Sequence[int]) -> str:
        """Append ``new_ids``; the text that is now final."""
        self.ids.extend(new_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """Everything not returned yet, a held-back incomplete character included."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        n = len(self.ids)
        if self.read == n:
            return ""
        if self._shown is None:
            self._shown = self._decode(self.prefix, self.read)
        shown = self._shown
        text = self._decode(self.prefix, n)
        done = len(shown) + self.extra
        if final or not (text.endswith(REPLACEMENT) or len(text) <= len(shown)):
            self.prefix, self.read, self.extra, self._shown = self.read, n, 0, None
            return text[done:]
        # held: an incomplete character at the end, or no new text yet (special tokens, or a
        # decoder that needs the next token); all before the trailing run of U+FFFD is final
        end = len(text.rstrip(REPLACEMENT))
        anchor = self._settled(text) if n - self.prefix > MAX_WINDOW else None
        if anchor is not None:
            end = max(end, anchor[1])
        out = text[done:end] if end > done else ""
        done = max(done, end)
        if anchor is None:
            self.extra = done - len(shown)
        else:  # the window restarts at the settled boundary, with no context
            self.prefix = self.read = anchor[0]
            self.extra, self._shown = done - anchor[1], ""
        return out

    def _settled(self, text: str) -> tuple[int, int] | None:
        """A token boundary ``i`` the decoder has settled and ``len(decode(ids[prefix:i]))``."""
        n = len(self.ids)
        for i in range(n - SETTLE_AFTER, max(self.prefix, n - SETTLE_AFTER - SETTLE_TRIES), -1):
            head = self._decode(self.prefix, i)
            if text.startswith(head) and head + self._decode(i, n) == text:
                return i, len(head)
        return None
