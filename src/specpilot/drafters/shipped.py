"""Learned drafters that ship with SpecPilot's source tree (``drafters/<dir>/``), by target name.

``--drafter dflash`` on a target named here needs no ``--draft-model``, and ``specpilot tune``
searches the shipped drafter as a direction of an n-gram deployment (``tune/space.py``). Each one
was trained by ``specpilot train-drafter`` (docs/DRAFTERS.md records how, and its measured τ).
"""

from __future__ import annotations

from pathlib import Path

SHIPPED: dict[str, tuple[str, str]] = {"smollm2-135m": ("dflash", "smollm2-135m-dflash")}
"""target name -> (drafter kind, directory under ``drafters/``)."""


def shipped_drafter(target: str, kind: str | None = None) -> Path | None:
    """The shipped drafter's directory for ``target`` (of ``kind`` when given), or None where
    none ships or this install has no source tree beside it."""
    entry = SHIPPED.get(target)
    if entry is None or (kind is not None and kind != entry[0]):
        return None
    root = Path(__file__).resolve().parents[3] / "drafters" / entry[1]
    return root if (root / "config.json").is_file() else None


def shipped_kind(target: str) -> str | None:
    entry = SHIPPED.get(target)
    return None if entry is None or shipped_drafter(target) is None else entry[0]
