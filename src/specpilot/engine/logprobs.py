"""Log-probabilities of committed tokens, from the target's own verify forward.

The engine keeps the last layer's output at every position of the latest verify block
(``Engine.final_hidden``; after a prefill, at the prompt's last token). Committed token j of a
cycle is the target's argmax over block position j, so the final norm and the LM head over that
same column give the distribution it was chosen from: its log-softmax is exact for the committed
tokens (the forward that committed them, not a second one), whatever the drafter proposed.
A window of several AR steps keeps only its last step's column, so a row that asks for logprobs
runs one-step windows (``Scheduler``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from specpilot.models.forward import Forward

MAX_TOP_LOGPROBS = 20
"""Most alternatives per position a request may ask for (OpenAI's limit)."""


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A committed token, its log-probability under the target, and the ``top`` most likely
    tokens at its position (token id, log-probability), most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def committed_logprobs(
    fwd: Forward,
    hidden: Tensor,  # [n, hidden]: last-layer output at the positions that chose ``tokens``
    tokens: list[int],
    top: int,
) -> list[TokenLogprob]:
    """Log-softmax of the target's logits at each position, read at the committed token."""
    if not tokens:
        return []
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top logprobs must be within 0..{MAX_TOP_LOGPROBS}, got {top}")
    lp = torch.log_softmax(fwd.logits(hidden[: len(tokens)]).float(), dim=-1)  # [n, V]
    ids = torch.tensor(tokens, dtype=torch.int64, device=lp.device)
    chosen = lp.gather(1, ids[:, None])[:, 0].tolist()
    if top > 0:
        vals, idx = lp.topk(top, dim=-1)  # [n, top]
        tops = [
            tuple(zip(i, v, strict=True)) for i, v in zip(idx.tolist(), vals.tolist(), strict=True)
        ]
    else:
        tops = [() for _ in tokens]
    return [TokenLogprob(t, c, tp) for t, c, tp in zip(tokens, chosen, tops, strict=True)]


__all__ = ["MAX_TOP_LOGPROBS", "TokenLogprob", "committed_logprobs"]
