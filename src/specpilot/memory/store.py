"""SQLite store for tuning: deployments, mechanisms, runs, trials, validated results.

One file (``memory/db.py``: WAL, one transaction per finished trial) that also holds the kernel
tables (``memory/kernels.py``, whose methods the store has).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specpilot.memory.fingerprint import Fingerprint
from specpilot.memory.kernels import KERNEL_SCHEMA, KernelMemory, KernelRow

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


class MemoryStore(KernelMemory):
    """One SQLite file; open it, use it, close it (or use it as a context manager)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, SCHEMA + KERNEL_SCHEMA)

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

    # ---------------------------------------------------------------- reads
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
