"""The kernel memory: kernel sources the sandbox judged, and the kernel search's tilings.

Two tables of the memory file beside the search's (``memory/store.py``): ``kernels`` (a source
per slot and device, with its checks and verdict, ``tune/kernel_sandbox.py``) and
``kernel_tilings`` (the winning tiling per GPU, kernel, weight shape and width,
``tune/kernel_search.py``). :class:`MemoryStore` has these methods through :class:`KernelMemory`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from specpilot.memory.db import Database

KERNEL_SCHEMA = """
CREATE TABLE IF NOT EXISTS kernels (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    slot TEXT NOT NULL,                 -- kernels/slots.py name
    device TEXT NOT NULL,               -- the GPU (or CPU) it was checked and timed on
    source_hash TEXT NOT NULL,
    entry TEXT NOT NULL,
    source TEXT NOT NULL,
    shapes TEXT NOT NULL,               -- JSON: the shapes it claimed
    accepted INTEGER NOT NULL,          -- every check passed at every claimed shape
    verdict TEXT NOT NULL,              -- JSON: stage, reason, checks, timings, faster_at
    hypothesis TEXT NOT NULL,
    created REAL NOT NULL,
    UNIQUE (slot, device, source_hash)
);
CREATE TABLE IF NOT EXISTS kernel_tilings (
    gpu TEXT NOT NULL,                  -- memory.fingerprint.gpu_fingerprint()["key"]
    kernel TEXT NOT NULL,               -- e.g. w12_mma
    shape TEXT NOT NULL,                -- "NxK" of the weight
    width INTEGER NOT NULL,             -- the M bucket
    config TEXT NOT NULL,               -- JSON: the winning tiling
    metrics TEXT NOT NULL,              -- JSON: times, the default's and cuBLAS's, device seconds
    gpu_info TEXT NOT NULL,             -- JSON: the fingerprint's fields
    created REAL NOT NULL,
    PRIMARY KEY (gpu, kernel, shape, width)
);
"""


@dataclass(frozen=True, slots=True)
class KernelRow:
    id: int
    slot: str
    device: str
    source_hash: str
    entry: str
    source: str
    shapes: list[dict[str, int]]
    accepted: bool
    verdict: dict[str, Any]
    hypothesis: str


class KernelMemory(Database):
    """The memory's kernel tables (a part of :class:`specpilot.memory.MemoryStore`)."""

    def add_kernel(
        self,
        slot: str,
        device: str,
        source_hash: str,
        entry: str,
        source: str,
        shapes: list[dict[str, int]],
        verdict: dict[str, Any],
        hypothesis: str,
    ) -> int:
        """A kernel source the sandbox judged (``tune/kernel_sandbox.py``), with its checks."""
        with self._tx() as db:
            cur = db.execute(
                "INSERT OR REPLACE INTO kernels (slot, device, source_hash, entry, source, shapes, "
                "accepted, verdict, hypothesis, created) VALUES (?,?,?,?,?,?,?,?,?,?)",
                (
                    slot, device, source_hash, entry, source, json.dumps(shapes),
                    int(bool(verdict.get("accepted"))), json.dumps(verdict), hypothesis, time.time(),
                ),
            )  # fmt: skip
            return int(cur.lastrowid or 0)

    def put_tiling(
        self,
        gpu: dict[str, str],
        kernel: str,
        shape: tuple[int, int],
        width: int,
        config: dict[str, Any],
        metrics: dict[str, Any],
    ) -> None:
        """Record the kernel search's winner for one weight shape and width on one GPU."""
        with self._tx() as db:
            db.execute(
                "INSERT OR REPLACE INTO kernel_tilings VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (gpu["key"], kernel, f"{shape[0]}x{shape[1]}", width, json.dumps(config),
                 json.dumps(metrics), json.dumps(gpu), time.time()),
            )  # fmt: skip

    def tilings(self, gpu_key: str, kernel: str) -> dict[tuple[int, int, int], dict[str, Any]]:
        """The kernel search's winners on GPU ``gpu_key``: ``(N, K, width) -> {"config",
        "metrics"}``."""
        rows = self._db.execute(
            "SELECT shape, width, config, metrics FROM kernel_tilings WHERE gpu = ? AND kernel = ?",
            (gpu_key, kernel),
        ).fetchall()
        out = {}
        for shape, width, config, metrics in rows:
            n, k = (int(v) for v in shape.split("x"))
            out[(n, k, int(width))] = {"config": json.loads(config), "metrics": json.loads(metrics)}
        return out

    def kernels(
        self, slot: str | None = None, device: str | None = None, accepted: bool | None = None
    ) -> list[KernelRow]:
        q, args = (
            "SELECT id, slot, device, source_hash, entry, source, shapes, accepted, verdict, hypothesis FROM kernels WHERE 1=1",
            list[Any](),
        )
        for col, value in (("slot", slot), ("device", device), ("accepted", accepted)):
            if value is not None:
                q, args = q + f" AND {col} = ?", [*args, int(value) if col == "accepted" else value]
        rows = self._db.execute(q + " ORDER BY id", args).fetchall()
        return [
            KernelRow(
                r[0],
                r[1],
                r[2],
                r[3],
                r[4],
                r[5],
                json.loads(r[6]),
                bool(r[7]),
                json.loads(r[8]),
                r[9],
            )
            for r in rows
        ]
