"""JSONL run records: what ``generate`` and ``bench`` write and ``verify`` reads.

One line per (prompt, engine) run. Appending is the only write, so an interrupted bench keeps
what it finished and ``--resume`` skips it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specpilot.errors import SpecPilotError


@dataclass(slots=True)
class RunRecord:
    id: str
    """Prompt id (``copy-heavy/quote-01``) or ``prompt`` for a one-off generate."""
    engine: str
    """``ar`` (our stock path), ``spec`` (speculative), ``hf`` (transformers generate)."""
    target: str
    dtype: str
    device: str
    prompt_ids: list[int]
    tokens: list[int]
    stop_reason: str
    seconds: float
    """Wall time of the whole generation, prefill included (device synchronised)."""
    drafter: str = "none"
    k: int = 0
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def tok_s(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> str:
        d = asdict(self)
        d["tok_s"] = self.tok_s
        return json.dumps(d)


def make_record(
    prompt_id: str,
    engine: str,
    meta: dict[str, str],
    prompt_ids: list[int],
    tokens: list[int],
    stop_reason: str,
    seconds: float,
    k: int = 0,
    stats: dict[str, Any] | None = None,
) -> RunRecord:
    """A record for one run; ``meta`` holds target, dtype, device and drafter (``none`` for AR/HF)."""
    return RunRecord(
        id=prompt_id,
        engine=engine,
        target=meta["target"],
        dtype=meta["dtype"],
        device=meta["device"],
        prompt_ids=prompt_ids,
        tokens=tokens,
        stop_reason=stop_reason,
        seconds=seconds,
        drafter=meta["drafter"] if engine == "spec" else "none",
        k=k,
        stats=stats or {},
    )


def append_records(path: Path, records: Iterable[RunRecord]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        for r in records:
            f.write(r.to_json() + "\n")
            f.flush()


def read_records(path: Path) -> list[RunRecord]:
    if not path.is_file():
        raise SpecPilotError(
            f"Records file {path} does not exist; write one with generate --out or bench --out."
        )
    names = set(RunRecord.__dataclass_fields__)
    out: list[RunRecord] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                out.append(RunRecord(**{k: v for k, v in d.items() if k in names}))
            except (json.JSONDecodeError, TypeError) as e:
                raise SpecPilotError(
                    f"{path}:{lineno} is not a SpecPilot run record ({e})."
                ) from None
    return out


def git_rev() -> str:
    """The short commit hash of the working tree (``unknown`` outside a git checkout)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def run_section(
    out: dict[str, Any], name: str, fn: Callable[[], Any], save: Callable[[], None]
) -> Any:
    """``out["sections"][name] = fn()`` for a GPU script: a failing section is reported (error
    and trace, also on stderr) and the others still run; its seconds go to
    ``out["section_s"]``; ``save`` runs after it either way."""
    t = time.perf_counter()
    sec = out.setdefault("sections", {})
    try:
        sec[name] = fn()
    except Exception as e:
        sec[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
        print(sec[name]["trace"], file=sys.stderr)
    out.setdefault("section_s", {})[name] = time.perf_counter() - t
    save()
    return sec[name]
