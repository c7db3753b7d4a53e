"""Kernel offers the engine runs: accepted agent kernels a kernel search chose for some cells.

The kernel sub-agent (``tune/kernel_agent.py``) stores every source its sandbox judged in the
memory's ``kernels`` table; the kernel search (``tune/kernel_search.py``) re-checks the accepted
ones of a slot at the deployment's own shapes, times them beside its tilings, and where one wins
a cell (weight shape ``[N, K]`` and M bucket) names it by source hash. ``KernelOffers`` is that
choice as the engine config carries it (``EngineConfig.kernels["w12_offers"]``): the memory file
and, per cell, the offer. At build the W12 mechanism imports each named offer with
:func:`load_offer`, which reads the source from the memory and imports it only if the memory
holds that very source (its hash checked again) as accepted; a cell whose offer cannot be loaded
runs the searched tiling instead. No triton import here.
"""

from __future__ import annotations

import hashlib
import importlib.util
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


def source_hash(source: str) -> str:
    """The key a kernel source is stored and named under (16 hex digits of its SHA-256)."""
    return hashlib.sha256(source.encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class OfferRef:
    """Which stored kernel: the memory's row, its slot, device key, source hash and entry (the
    one definition of these fields: ``tune/kernel_agent.KernelOffer`` extends it)."""

    slot: str
    device: str
    source_hash: str
    entry: str
    row: int


@dataclass(frozen=True, slots=True)
class KernelOffers:
    """Per ``(N, K, M bucket)`` the offer that won the kernel search's cell, and the memory
    holding its source."""

    memory: str
    cells: dict[tuple[int, int, int], OfferRef] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "memory": self.memory,
            "cells": [[n, k, m, asdict(r)] for (n, k, m), r in sorted(self.cells.items())],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> KernelOffers:
        cells = {(int(n), int(k), int(m)): OfferRef(**r) for n, k, m, r in data["cells"]}
        return cls(memory=str(data["memory"]), cells=cells)

    def load(
        self, folder: Path | None = None
    ) -> tuple[dict[tuple[int, int, int], Callable[..., Any]], list[str]]:
        """Each cell's entry function, imported by :func:`load_offer` from the memory, and one
        note per cell that could not be (it keeps its tiling)."""
        from specpilot.memory.store import MemoryStore

        fns: dict[tuple[int, int, int], Callable[..., Any]] = {}
        notes: list[str] = []
        path = Path(self.memory)
        if not self.cells:
            return fns, notes
        if not path.is_file():
            return fns, [f"kernel offers: no memory at {path}; the searched tilings run"]
        folder = folder or path.parent / "kernels"
        loaded: dict[str, Callable[..., Any]] = {}
        with MemoryStore(path) as store:
            for cell, ref in self.cells.items():
                try:
                    if ref.source_hash not in loaded:
                        loaded[ref.source_hash] = load_offer(store, ref, folder)
                    fns[cell] = loaded[ref.source_hash]
                except Exception as e:  # not accepted, gone, or does not import: the tiling runs
                    notes.append(f"kernel offer {ref.source_hash} for {cell}: {e}; its tiling runs")
        return fns, notes


def load_offer(store: Any, offer: OfferRef, folder: Path) -> Callable[..., Any]:
    """The offer's entry function, imported from the source ``store`` (a ``MemoryStore``) holds
    as accepted (its hash checked again); ``folder`` keeps the module file (Triton reads a
    kernel's source)."""
    rows = [
        r
        for r in store.kernels(slot=offer.slot, device=offer.device, accepted=True)
        if r.id == offer.row
    ]
    if not rows or source_hash(rows[0].source) != offer.source_hash:
        raise ValueError(
            f"kernel {offer.source_hash} of {offer.slot} is not accepted in the memory"
        )
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"kernel_{offer.slot.replace('-', '_')}_{offer.source_hash}.py"
    path.write_text(rows[0].source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn: Callable[..., Any] = getattr(module, offer.entry)
    return fn


__all__ = ["KernelOffers", "OfferRef", "load_offer", "source_hash"]
