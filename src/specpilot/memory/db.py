"""The memory's SQLite file: opened in WAL mode, one transaction per write.

WAL mode and one transaction per finished trial: a search killed with SIGKILL loses at most the
trial in flight, and ``tune --resume`` skips every trial already recorded for the run.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Self

from specpilot.errors import SpecPilotError


class Database:
    """One SQLite file with its tables (``schema``); open it, use it, close it (or use it as a
    context manager)."""

    def __init__(self, path: Path, schema: str) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._db = sqlite3.connect(str(path), timeout=30, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA foreign_keys=ON")
            self._db.executescript(schema)
        except sqlite3.DatabaseError as e:
            raise SpecPilotError(
                f"Memory file {path} is not a usable SQLite database ({e})."
            ) from None

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> Self:
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
