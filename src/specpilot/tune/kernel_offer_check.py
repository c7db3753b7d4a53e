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

import hashlib
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
    offers: Sequence[OfferRef],
    store: Any,
    weight: Tensor,  # [N, K] bf16: the shape's first matrix
    widths: Sequence[int],
    device: torch.device,
    seconds_left: Callable[[], float],
    notes: list[str],
    folder: Path,
) -> dict[str, Callable[..., Tensor]]:
    """Source hash -> entry function of each offer (an ``OfferRef``: a memory row) that
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


def weight_digest(weight: Tensor) -> str:
    """16 hex digits of the SHA-256 of a weight's bytes: which real weight a re-check ran on."""
    data = weight.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(data).hexdigest()[:16]


class OfferCandidates:
    """The search's agent candidates: per weight shape the offers that passed their re-check
    (each re-checked once per shape, on the shape's first cell that needs it), and the cells
    they won. An offer is keyed by ``(source hash, memory row)``."""

    def __init__(
        self, offers: Sequence[OfferRef], store: Any, device: torch.device,
        widths: Sequence[int], notes: list[str],
    ) -> None:  # fmt: skip
        self.offers, self.store, self.device, self.widths = list(offers), store, device, widths
        self.notes = notes
        self.refs = {o.source_hash: OfferRef(o.slot, o.device, o.source_hash, o.entry, o.row) for o in self.offers}  # fmt: skip
        self.won: dict[tuple[int, int, int], OfferRef] = {}
        self._fns: dict[tuple[int, int], dict[tuple[str, int], Callable[..., Tensor] | None]] = {}
        self._digests: dict[tuple[int, int], str] = {}
        base = store.path.parent if store is not None else Path(tempfile.gettempdir())
        self.folder = base / "kernels"  # load_offer names the modules by source hash

    @classmethod
    def make(
        cls, offers: Sequence[OfferRef] | None, store: Any, device_key: str, device: torch.device,
        widths: Sequence[int], notes: list[str],
    ) -> OfferCandidates:  # fmt: skip
        """``offers``, or (None) those ``store`` holds as accepted for this GPU."""
        from specpilot.tune.kernel_agent import offers as stored

        if offers is None or store is None:  # an offer's source is the memory's
            offers = stored(store, SLOT, device_key) if store is not None else []
        return cls(offers, store, device, widths, notes)

    def _recheck(
        self, weight: Tensor, offers: Sequence[OfferRef], seconds_left: Callable[[], float]
    ) -> dict[tuple[str, int], Callable[..., Tensor] | None]:
        """This shape's verdicts, ``offers`` not yet judged here re-checked in the sandbox."""
        done = self._fns.setdefault(_shape(weight), {})
        todo = [o for o in offers if (o.source_hash, o.row) not in done]
        if todo:
            got = recheck_offers(todo, self.store, weight, self.widths, self.device,
                                 seconds_left, self.notes, self.folder)  # fmt: skip
            done.update({(o.source_hash, o.row): got.get(o.source_hash) for o in todo})
        return done

    def for_shape(
        self, weight: Tensor, seconds_left: Callable[[], float]
    ) -> dict[str, Callable[..., Tensor]]:
        """Source hash -> entry of the offers that passed at this weight's shape."""
        done = self._recheck(weight, self.offers, seconds_left)
        return {h: fn for (h, _), fn in done.items() if fn is not None}

    def stored(
        self, weight: Tensor, ref: OfferRef, record: Any, seconds_left: Callable[[], float]
    ) -> Callable[..., Tensor] | None:
        """The entry of the offer a cell of this shape stored as its winner, or None (a note
        says why). Re-checked in the sandbox at this shape and every width, unless ``record``
        (the memory's :meth:`check_record` of the search that chose it) says it passed that
        very check, at these widths on this very weight: the sandbox's verdict is a function
        of the source, the shapes and the weights, so the stored one stands (the source is
        still loaded only if the memory holds it as accepted, its hash checked again)."""
        from specpilot.kernels.offers import load_offer

        key, done = (ref.source_hash, ref.row), self._fns.setdefault(_shape(weight), {})
        self.refs.setdefault(ref.source_hash, ref)
        if key not in done and record == self.check_record(weight, ref.source_hash):
            n, k = _shape(weight)
            try:
                done[key] = load_offer(self.store, ref, self.folder)
                self.notes.append(f"offer {ref.source_hash}: passed its re-check at {n}x{k} (widths {', '.join(map(str, sorted(set(self.widths))))}, this weight) in an earlier search; not run again")  # fmt: skip
            except ValueError as e:
                self.notes.append(f"offer {ref.source_hash}: {e}")
                done[key] = None
        return self._recheck(weight, [ref], seconds_left)[key]

    def check_record(self, weight: Tensor, source_hash: str) -> dict[str, Any]:
        """What an offer's pass at this shape was checked on: the source, the widths and the
        real weight (stored beside a cell it wins)."""
        shape = _shape(weight)
        if shape not in self._digests:
            self._digests[shape] = weight_digest(weight)
        widths = sorted(set(self.widths))
        return {"source_hash": source_hash, "widths": widths, "weight": self._digests[shape]}

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


def _shape(weight: Tensor) -> tuple[int, int]:
    return int(weight.shape[0]), int(weight.shape[1])


__all__ = [
    "MAX_OFFERS",
    "SANDBOX_PRIOR_S",
    "SLOT",
    "OfferCandidates",
    "recheck_offers",
    "weight_digest",
]
