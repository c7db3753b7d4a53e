"""SQLite store for tuning: deployments, mechanisms, runs, trials, validated results.

WAL mode and one transaction per finished trial: a search killed with SIGKILL loses at most the
trial in flight, and ``tune --resume`` skips every trial already recorded for the run.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specpilot.errors import SpecPilotError
from specpilot.memory.fingerprint import Fingerprint

SCHEMA = """
CREATE TABLE IF NOT EXISTS deployments (
    key TEXT PRIMARY KEY,
    fingerprint TEXT NOT NULL,          -- JSON of Fingerprint
    label TEXT NOT NULL,                -- human-readable: target, drafter, device, dtype, mode
    created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS mechanisms (
    name TEXT PRIMARY KEY,
    component TEXT NOT NULL,
    plug_point TEXT NOT NULL,
    lossless TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    deployment TEXT NOT NULL REFERENCES deployments(key),
    started REAL NOT NULL,
    finished REAL,
    settings TEXT NOT NULL,             -- JSON: budget, prompts, executor, ...
    status TEXT NOT NULL                -- running | done | stopped
);
CREATE TABLE IF NOT EXISTS trials (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run INTEGER NOT NULL REFERENCES runs(id),
    deployment TEXT NOT NULL REFERENCES deployments(key),
    round INTEGER NOT NULL,
    explorer TEXT NOT NULL,
    config_hash TEXT NOT NULL,
    config TEXT NOT NULL,               -- JSON EngineConfig
    metrics TEXT NOT NULL,              -- JSON: tok_s, speedup, tau, ...
    forcing_ok INTEGER NOT NULL,
    forcing TEXT NOT NULL,              -- JSON: counts and first mismatch
    gpu_seconds REAL NOT NULL,
    wall_seconds REAL NOT NULL,
    created REAL NOT NULL,
    UNIQUE (run, config_hash)
);
CREATE TABLE IF NOT EXISTS validated (
    deployment TEXT NOT NULL REFERENCES deployments(key),
    config_hash TEXT NOT NULL,
    config TEXT NOT NULL,
    speedup REAL NOT NULL,
    trial INTEGER NOT NULL REFERENCES trials(id),
    created REAL NOT NULL,
    PRIMARY KEY (deployment, config_hash)
);
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
class TrialRow:
    id: int
    run: int
    deployment: str
    round: int
    explorer: str
    config_hash: str
    config: dict[str, Any]
    metrics: dict[str, Any]
    forcing_ok: bool
    forcing: dict[str, Any]
    gpu_seconds: float
    wall_seconds: float


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


class MemoryStore:
    """One SQLite file; open it, use it, close it (or use it as a context manager)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._db = sqlite3.connect(str(path), timeout=30, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA foreign_keys=ON")
            self._db.executescript(SCHEMA)
        except sqlite3.DatabaseError as e:
            raise SpecPilotError(
                f"Memory file {path} is not a usable SQLite database ({e})."
            ) from None

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> MemoryStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    # --------------------------------------------------------------- writes
    def add_deployment(self, fp: Fingerprint, label: str) -> str:
        with self._tx() as db:
            db.execute(
                "INSERT OR IGNORE INTO deployments VALUES (?, ?, ?, ?)",
                (fp.key, json.dumps(fp.to_dict()), label, time.time()),
            )
        return fp.key

    def add_mechanism(self, name: str, component: str, plug_point: str, lossless: str) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT OR REPLACE INTO mechanisms VALUES (?, ?, ?, ?)",
                (name, component, plug_point, lossless),
            )

    def start_run(self, deployment: str, settings: dict[str, Any]) -> int:
        with self._tx() as db:
            cur = db.execute(
                "INSERT INTO runs (deployment, started, settings, status) VALUES (?, ?, ?, 'running')",
                (deployment, time.time(), json.dumps(settings)),
            )
            assert cur.lastrowid is not None
            return int(cur.lastrowid)

    def finish_run(self, run: int, status: str = "done") -> None:
        with self._tx() as db:
            db.execute(
                "UPDATE runs SET finished = ?, status = ? WHERE id = ?", (time.time(), status, run)
            )

    def add_trial(
        self,
        run: int,
        deployment: str,
        round_: int,
        explorer: str,
        config_hash: str,
        config: dict[str, Any],
        metrics: dict[str, Any],
        forcing_ok: bool,
        forcing: dict[str, Any],
        gpu_seconds: float,
        wall_seconds: float,
    ) -> int:
        with self._tx() as db:
            cur = db.execute(
                "INSERT OR IGNORE INTO trials (run, deployment, round, explorer, config_hash, config, metrics, "
                "forcing_ok, forcing, gpu_seconds, wall_seconds, created) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                (
                    run,
                    deployment,
                    round_,
                    explorer,
                    config_hash,
                    json.dumps(config),
                    json.dumps(metrics),
                    int(forcing_ok),
                    json.dumps(forcing),
                    gpu_seconds,
                    wall_seconds,
                    time.time(),
                ),
            )
            return int(cur.lastrowid or 0)

    def validate(
        self, deployment: str, config_hash: str, config: dict[str, Any], speedup: float, trial: int
    ) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT OR REPLACE INTO validated VALUES (?, ?, ?, ?, ?, ?)",
                (deployment, config_hash, json.dumps(config), speedup, trial, time.time()),
            )

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

    # ---------------------------------------------------------------- reads
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

    def trials(self, run: int | None = None, deployment: str | None = None) -> list[TrialRow]:
        q, args = "SELECT * FROM trials WHERE 1=1", list[Any]()
        if run is not None:
            q, args = q + " AND run = ?", [*args, run]
        if deployment is not None:
            q, args = q + " AND deployment = ?", [*args, deployment]
        rows = self._db.execute(q + " ORDER BY id", args).fetchall()
        return [
            TrialRow(
                id=r[0],
                run=r[1],
                deployment=r[2],
                round=r[3],
                explorer=r[4],
                config_hash=r[5],
                config=json.loads(r[6]),
                metrics=json.loads(r[7]),
                forcing_ok=bool(r[8]),
                forcing=json.loads(r[9]),
                gpu_seconds=r[10],
                wall_seconds=r[11],
            )
            for r in rows
        ]

    def latest_run(self, deployment: str) -> tuple[int, str] | None:
        row = self._db.execute(
            "SELECT id, status FROM runs WHERE deployment = ? ORDER BY id DESC LIMIT 1",
            (deployment,),
        ).fetchone()
        return None if row is None else (int(row[0]), str(row[1]))

    def deployments(self) -> list[tuple[str, Fingerprint, str]]:
        rows = self._db.execute(
            "SELECT key, fingerprint, label FROM deployments ORDER BY created"
        ).fetchall()
        return [(r[0], Fingerprint(**json.loads(r[1])), r[2]) for r in rows]

    def validated(self, deployment: str | None = None) -> list[dict[str, Any]]:
        q = "SELECT deployment, config_hash, config, speedup, trial FROM validated"
        rows = self._db.execute(
            q + (" WHERE deployment = ?" if deployment else "") + " ORDER BY speedup DESC",
            (deployment,) if deployment else (),
        ).fetchall()
        return [
            {
                "deployment": r[0],
                "config_hash": r[1],
                "config": json.loads(r[2]),
                "speedup": r[3],
                "trial": r[4],
            }
            for r in rows
        ]

    def similar_validated(
        self, fp: Fingerprint, limit: int = 5
    ) -> list[tuple[str, int, dict[str, Any]]]:
        """Validated configs of other deployments, most similar first: (label, similarity, row)."""
        out = []
        for key, other, label in self.deployments():
            if key == fp.key:
                continue
            for row in self.validated(key)[:1]:
                out.append((label, fp.similarity(other), row))
        out.sort(key=lambda t: (-t[1], -t[2]["speedup"]))
        return out[:limit]

    def runs(self) -> list[dict[str, Any]]:
        rows = self._db.execute(
            "SELECT id, deployment, started, finished, settings, status FROM runs ORDER BY id"
        ).fetchall()
        return [
            {
                "id": r[0],
                "deployment": r[1],
                "started": r[2],
                "finished": r[3],
                "settings": json.loads(r[4]),
                "status": r[5],
            }
            for r in rows
        ]

    def export(self) -> dict[str, Any]:
        """Everything, as JSON-ready data (``specpilot memory export``)."""
        return {
            "deployments": [
                {"key": k, "label": lbl, "fingerprint": fp.to_dict()}
                for k, fp, lbl in self.deployments()
            ],
            "mechanisms": [
                dict(zip(("name", "component", "plug_point", "lossless"), r, strict=True))
                for r in self._db.execute("SELECT * FROM mechanisms").fetchall()
            ],
            "runs": self.runs(),
            "trials": [
                t.__dict__ if hasattr(t, "__dict__") else _row_dict(t) for t in self.trials()
            ],
            "validated": self.validated(),
            "kernels": [_row_dict(k) for k in self.kernels()],
        }


def _row_dict(t: TrialRow | KernelRow) -> dict[str, Any]:
    return {f: getattr(t, f) for f in type(t).__dataclass_fields__}
