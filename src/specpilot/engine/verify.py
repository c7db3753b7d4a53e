"""Greedy verification of drafted tokens against the target's argmax.

Terminology (after Leviathan et al., 2023, "Fast Inference from Transformers via Speculative
Decoding", specialised to greedy decoding):

* **drafted** tokens ``d_1..d_K`` are the drafter's proposal for the next K positions;
* the target runs once on ``[pending, d_1..d_K]`` and its argmax ``a_0..a_K`` at each row is
  the token the target itself would emit after that prefix;
* **accepted** tokens are the longest prefix ``d_1..d_n`` with ``d_i == a_{i-1}`` for all i ≤ n;
* the **bonus** token is ``a_n``: the target's own choice after the accepted prefix (a
  correction when ``n < K``, a free extra token when ``n == K``);
* **committed** tokens are ``d_1..d_n, a_n``: always ``n + 1`` of them, every one the target's
  argmax given the committed prefix, which is why the scheme is lossless.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(slots=True)
class VerifyOutcome:
    accepted_len: Tensor  # [B] int64: n, accepted draft tokens per row
    bonus: Tensor  # [B] int64: a_n, the target's token after the accepted prefix


def greedy_verify(
    draft_tokens: Tensor,  # [B, K] int64 (padded past each row's draft length)
    draft_lens: Tensor,  # [B] int64: valid drafted tokens per row (0..K)
    target_argmax: Tensor,  # [B, K + 1] int64: a_0..a_K
) -> VerifyOutcome:
    """Longest matching prefix per row and its bonus token; stays on the tensors' device."""
    k = draft_tokens.shape[1]
    valid = torch.arange(k, device=draft_tokens.device)[None, :] < draft_lens[:, None]
    match = (draft_tokens == target_argmax[:, :k]) & valid  # [B, K]
    accepted_len = match.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [B]
    bonus = target_argmax.gather(1, accepted_len[:, None]).squeeze(1)  # [B]
    return VerifyOutcome(accepted_len=accepted_len, bonus=bonus)


def cut_at_stop(
    committed: Sequence[int], room: int, stop_ids: Container[int]
) -> tuple[list[int], bool]:
    """What a row keeps of a cycle's committed tokens: at most ``room`` of them, up to and
    including the first stop token. Returns ``(kept, stopped_at_a_stop_token)``."""
    keep = list(committed[: max(room, 0)])
    for i, tok in enumerate(keep):
        if tok in stop_ids:
            return keep[: i + 1], True
    return keep, False
