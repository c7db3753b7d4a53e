"""The kernel search's agent candidates: accepted offers of the ``w12-gemm`` slot, re-checked at
the deployment's own shapes before anything of theirs runs in the tune process.

The kernel sub-agent's sandbox accepted an offer at the slot's shapes (``kernels/slots.py``) on
seeded weights; the search needs it at the target's shapes and on its weights. So, per weight
shape ``[N, K]`` and offer, :func:`recheck_offers` runs the sandbox again
(``tune/kernel_sandbox.py``: a separate process with a time limit, the outputs checked in this
process) at every width the search will time, with that shape's first matrix as the real weight
(the bit-exact decode probes and the product within the fp32 reduction bound, on seeded
weight-like weights with every kind of escape and on the real one). Only an offer that passes
is imported here (:func:`kernels.offers.load_offer`: the source the memory holds as accepted,
its hash checked again) and handed to the search as a candidate beside its tilings, where the
in-process check every tiling passes runs on it too before it is timed.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from specpilot.kernels.offers import KernelOffers, OfferRef

SLOT = "w12-gemm"
SANDBOX_PRIOR_S = 30.0
"""Seconds one re-check is assumed to take (process start, the cases on the CPU, compile)."""
MAX_OFFERS = 4
"""Offers taken per search (the memory's latest accepted ones)."""


def recheck_offers(
    offers: Sequence[Any],
    store: Any,
    weight: Tensor,  # [N, K] bf16: the shape's first matrix
    widths: Sequence[int],
    device: torch.device,
    seconds_left: Callable[[], float],
    notes: list[str],
    folder: Path,
) -> dict[str, Callable[..., Tensor]]:
    """Source hash -> entry function of each offer (``tune/kernel_agent.KernelOffer``) that
    passed the sandbox at ``[N, K]`` and every width; one note per offer that did not or was
    not tried (the budget)."""
    from specpilot.kernels.offers import load_offer
    from specpilot.tune.kernel_sandbox import run_sandbox

    n, k = (int(d) for d in weight.shape)
    shapes = [{"m": int(m), "n": n, "k": k} for m in sorted(set(widths))]
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    fns: dict[str, Callable[..., Tensor]] = {}
    with tempfile.TemporaryDirectory(prefix="specpilot-offer-") as tmp:
        from safetensors.torch import save_file

        real = Path(tmp) / "weight.safetensors"
        save_file({"w": weight.detach().to("cpu").contiguous()}, str(real))
        for offer in offers[-MAX_OFFERS:]:
            if seconds_left() < SANDBOX_PRIOR_S:
                notes.append(f"offer {offer.source_hash}: not re-checked at {n}x{k}, "
                             f"{max(seconds_left(), 0):.0f}s of the kernel budget left")  # fmt: skip
                continue
            rows = [r for r in store.kernels(slot=offer.slot, device=offer.device, accepted=True)
                    if r.id == offer.row]  # fmt: skip
            if not rows:
                notes.append(f"offer {offer.source_hash}: no longer accepted in the memory")
                continue
            t0 = time.perf_counter()
            verdict = run_sandbox(
                rows[0].source, offer.entry, SLOT, shapes, str(device),
                min(300.0, max(seconds_left(), 1.0)), real=(str(real), "w"),
                rounds=1, reps=1, interpret=interpret,
            )  # fmt: skip
            took = time.perf_counter() - t0
            if not verdict.accepted:
                notes.append(f"offer {offer.source_hash}: failed its re-check at {n}x{k} "
                             f"({verdict.stage}: {verdict.reason}; {took:.1f}s); not timed")  # fmt: skip
                continue
            fns[offer.source_hash] = load_offer(store, offer, folder)
            notes.append(f"offer {offer.source_hash}: re-checked at {n}x{k}, widths "
                         f"{', '.join(str(s['m']) for s in shapes)} ({took:.1f}s)")  # fmt: skip
    return fns


class OfferCandidates:
    """The search's agent candidates: per weight shape the offers that passed their re-check
    (re-checked once, on the shape's first searched cell), and the cells they won."""

    def __init__(
        self, offers: Sequence[Any], store: Any, device: torch.device, widths: Sequence[int],
        notes: list[str],
    ) -> None:  # fmt: skip
        self.offers, self.store, self.device, self.widths = list(offers), store, device, widths
        self.notes = notes
        self.refs = {o.source_hash: OfferRef(o.slot, o.device, o.source_hash, o.entry, o.row) for o in self.offers}  # fmt: skip
        self.won: dict[tuple[int, int, int], OfferRef] = {}
        self._fns: dict[tuple[int, int], dict[str, Callable[..., Tensor]]] = {}
        base = store.path.parent if store is not None else Path(tempfile.gettempdir())
        self.folder = base / "kernels"  # load_offer names the modules by source hash

    @classmethod
    def make(
        cls, offers: Sequence[Any] | None, store: Any, device_key: str, device: torch.device,
        widths: Sequence[int], notes: list[str],
    ) -> OfferCandidates:  # fmt: skip
        """``offers``, or (None) those ``store`` holds as accepted for this GPU."""
        from specpilot.tune.kernel_agent import offers as stored

        if offers is None or store is None:  # an offer's source is the memory's
            offers = stored(store, SLOT, device_key) if store is not None else []
        return cls(offers, store, device, widths, notes)

    def for_shape(
        self, weight: Tensor, seconds_left: Callable[[], float]
    ) -> dict[str, Callable[..., Tensor]]:
        """Source hash -> entry of the offers that passed at this weight's shape."""
        shape = (int(weight.shape[0]), int(weight.shape[1]))
        if shape not in self._fns:
            self._fns[shape] = (
                recheck_offers(self.offers, self.store, weight, self.widths, self.device,
                               seconds_left, self.notes, self.folder)
                if self.offers else {}
            )  # fmt: skip
        return self._fns[shape]

    def ref_json(self, source_hash: str | None) -> dict[str, Any] | None:
        return asdict(self.refs[source_hash]) if source_hash else None

    def chosen(self, cell: tuple[int, int, int], source_hash: str | None) -> None:
        if source_hash is not None:
            self.won[cell] = self.refs[source_hash]

    def result(self) -> KernelOffers | None:
        """The cells an offer won, for the engine config (None: none)."""
        if not self.won:
            return None
        return KernelOffers(str(self.store.path) if self.store is not None else "", dict(self.won))


__all__ = ["MAX_OFFERS", "SANDBOX_PRIOR_S", "SLOT", "OfferCandidates", "recheck_offers"]
