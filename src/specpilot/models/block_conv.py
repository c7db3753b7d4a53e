"""DFlash2's grouped dynamic convolution over the rows of each draft block.

Every DFlash2 drafter layer wraps its attention and its MLP in one of these (``attention_conv``,
``mlp_conv``). Row t of a block becomes, per channel group g (``H / group_size`` groups)::

    y_t = Σ_{o < K} (base[o] + dyn_t[o, g]) ⊙ x_{t-o}        (x_{t-o} = 0 before the block)

with ``dyn = kernel_projection(x_in)`` computed from the normed sublayer input. ``prepare``
applies taps set 0 (``base[0]``, ``dyn[0]``) to the sublayer's input and hands back ``dyn[1]``;
``finish`` applies set 1 to the sublayer's output. The taps never cross blocks: rows are grouped
into blocks of ``block`` consecutive rows (one draft block at inference, every anchor's block in
training). A fresh conv (base[·][0] = 1, base[·][1:] = 0, zero projection) is the identity.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class BlockConv(nn.Module):
    """``base_kernel [2, K, H]`` and ``kernel_projection.weight [2*K*H/group_size, H]``."""

    def __init__(
        self,
        hidden: int,
        kernel_size: int,
        group_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        if kernel_size < 1 or group_size < 1 or hidden % group_size:
            raise ValueError(
                f"conv kernel {kernel_size} / group size {group_size} do not fit hidden {hidden}"
            )
        self.kernel_size = kernel_size
        self.group_size = group_size
        self.groups = hidden // group_size
        self.base_kernel = nn.Parameter(
            torch.empty(2, kernel_size, hidden, dtype=dtype, device=device), requires_grad=False
        )
        self.kernel_projection = nn.Parameter(
            torch.empty(2 * kernel_size * self.groups, hidden, dtype=dtype, device=device),
            requires_grad=False,
        )

    def init_identity(self) -> None:
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.zero_()

    def _mix(self, x: Tensor, dyn: Tensor, base: Tensor, block: int) -> Tensor:
        """``x [M, H]``, ``dyn [M, K, groups]``, ``base [K, H]`` → ``[M, H]``."""
        m, h = x.shape
        g, gs, kk = self.groups, self.group_size, self.kernel_size
        xb = x.view(m // block, block, g, gs)  # [N, L, g, gs]
        db = dyn.reshape(m // block, block, kk, g, 1)  # [N, L, K, g, 1]
        out = torch.zeros_like(xb)
        for o in range(kk):
            if o == 0:
                shifted = xb
            elif o < block:  # rows shifted down by o inside each block, zeros on top
                shifted = F.pad(xb[:, :-o], (0, 0, 0, 0, o, 0))
            else:
                shifted = torch.zeros_like(xb)
            out = out + base[o].view(g, gs).to(x.dtype) * shifted
            out = torch.addcmul(out, db[:, :, o], shifted)
        return out.view(m, h)

    def prepare(self, x: Tensor, block: int) -> tuple[Tensor, Tensor]:
        """Normed sublayer input ``x [M, H]`` → (mixed input ``[M, H]``, ``dyn[1] [M, K, g]``)."""
        dyn = F.linear(x, self.kernel_projection).view(-1, 2, self.kernel_size, self.groups)
        return self._mix(x, dyn[:, 0], self.base_kernel[0], block), dyn[:, 1]

    def finish(self, y: Tensor, dyn: Tensor, block: int) -> Tensor:
        """Sublayer output ``y [M, H]`` mixed with taps set 1."""
        return self._mix(y, dyn, self.base_kernel[1], block)
