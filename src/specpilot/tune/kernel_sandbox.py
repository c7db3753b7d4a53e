"""The kernel sandbox: an agent-proposed kernel source, compiled, run, checked and timed away
from the process that serves.

:func:`run_sandbox` writes the source to a private folder and starts
``tune/kernel_sandbox_child.py`` in a new process (its own session, so a hang is killed with
everything it started). The child builds the slot's cases, says it is ready, imports the source
(Triton compiles on the first call), runs the entry at every claimed shape, saves the outputs
and times the candidate against the engine's current kernel. Here, in the parent, the outputs
are checked against the slot's reference (``kernels/slots.py``): the check cases are rebuilt
from the same seed by code the candidate never shared a process with, so a candidate cannot
pass by patching its checker. A candidate is accepted only if every case of every claimed shape
passes and it was timed; it is *offered* to the kernel search at the shapes where it is faster
than the current kernel beyond the noise (every round).

What the sandbox is not: a security boundary. The child runs the agent's code with this user's
rights (process isolation and a time limit keep a crash, a hang or a lossy kernel away from the
serving process; they do not keep hostile code off the machine). Run agents you would let run
code here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specpilot.bench.protocol import Ratio
from specpilot.kernels.slots import KernelSlot, Shape, resolve_slot

MAX_SOURCE_BYTES = 200_000
STARTUP_LIMIT_S = 300.0
"""Seconds the child may take to import torch and build the check cases (not the kernel's)."""


@dataclass(slots=True)
class SandboxVerdict:
    accepted: bool
    stage: str
    """How far it got: ``refused`` (before starting), ``unavailable`` (no device for the slot),
    ``compile``, ``run``, ``check``, ``time-limit``, ``crashed``, ``time``, or ``done``."""
    reason: str | None = None
    checks: list[dict[str, Any]] = field(default_factory=list)
    """Per shape: the shape, the cases checked and passed (all of them when accepted)."""
    timings: list[dict[str, Any]] = field(default_factory=list)
    """Per shape: median microseconds of candidate and current, speedup rounds and verdict."""
    faster_at: list[dict[str, int]] = field(default_factory=list)
    first_call_s: float | None = None
    """Seconds of the candidate's first call (Triton's compile included)."""
    wall_s: float = 0.0

    def summary(self) -> str:
        if not self.accepted:
            return f"rejected at {self.stage}: {self.reason}"
        where = ", ".join(_shape_text(s) for s in self.faster_at) or "no shape"
        return f"accepted (every check passed); faster than the current kernel at {where}"

    def to_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__slots__}


def _shape_text(s: Shape) -> str:
    return "x".join(f"{k}{v}" for k, v in s.items())


def _refuse(why: str, stage: str = "refused") -> SandboxVerdict:
    return SandboxVerdict(False, stage, why)


def precheck(
    source: Any, entry: Any, slot: KernelSlot, shapes: Sequence[Any], allowed: Sequence[Shape]
) -> str | None:
    """Why a proposal cannot even be started (None: it can)."""
    if not isinstance(source, str) or not source.strip():
        return "the source must be a non-empty string of Python"
    if len(source.encode()) > MAX_SOURCE_BYTES:
        return f"the source is over {MAX_SOURCE_BYTES} bytes"
    if not isinstance(entry, str) or not entry.isidentifier():
        return f"entry must be the name of the kernel's Python function, got {entry!r}"
    if not shapes:
        return "the proposal claims no shape"
    known = [dict(s) for s in allowed]
    for s in shapes:
        if not isinstance(s, dict) or dict(s) not in known:
            return f"shape {s!r} is not one this slot runs at here ({', '.join(map(_shape_text, known))})"
    return None


def run_sandbox(
    source: str,
    entry: str,
    slot_name: str,
    shapes: Sequence[Shape],
    device: str,
    time_limit_s: float,
    seed: int = 0,
    real: tuple[str, str] | None = None,
    rounds: int = 5,
    reps: int = 10,
    interpret: bool = False,
    startup_limit_s: float = STARTUP_LIMIT_S,
) -> SandboxVerdict:
    """Compile, run, check and time one candidate for ``slot_name`` at ``shapes`` on ``device``.

    ``real``: (safetensors file, tensor name) of a real weight the cases are built from besides
    the seeded random ones. ``interpret``: run Triton's interpreter (``TRITON_INTERPRET=1``, on
    the CPU, tiny shapes): a slot that needs CUDA runs on the CPU only so."""
    t0 = time.perf_counter()
    slot = resolve_slot(slot_name)
    if slot.needs_cuda and not device.startswith("cuda") and not interpret:
        return _refuse(
            f"{slot.name} needs CUDA (or the Triton interpreter, for tiny shapes)", "unavailable"
        )
    with tempfile.TemporaryDirectory(prefix="specpilot-kernel-") as tmp:
        work = Path(tmp)
        (work / "candidate.py").write_text(source)
        req = {
            "source_file": str(work / "candidate.py"),
            "entry": entry,
            "slot": slot_name,
            "shapes": [dict(s) for s in shapes],
            "seed": seed,
            "real": list(real) if real else None,
            "device": device,
            "rounds": rounds,
            "reps": reps,
            "outputs": str(work / "outputs.safetensors"),
            "result": str(work / "result.json"),
            "ready": str(work / "ready"),
        }
        (work / "request.json").write_text(json.dumps(req))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        env.pop("TRITON_INTERPRET", None)
        if interpret:
            env["TRITON_INTERPRET"] = "1"
        with open(work / "log.txt", "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "specpilot.tune.kernel_sandbox_child", str(work / "request.json")],
                env=env, cwd=tmp, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
            killed = _wait(proc, work / "ready", startup_limit_s, time_limit_s)
        verdict = _read(work, slot, shapes, seed, real, proc.returncode, killed)
    verdict.wall_s = time.perf_counter() - t0
    return verdict


def _wait(
    proc: subprocess.Popen[bytes], ready: Path, startup_s: float, limit_s: float
) -> str | None:
    """Wait for the child; kill its whole session past a limit and say which."""
    start, ready_at = time.perf_counter(), None
    while proc.poll() is None:
        now = time.perf_counter()
        if ready_at is None and ready.exists():
            ready_at = now
        why = None
        if ready_at is None and now - start > startup_s:
            why = f"the sandbox did not start within {startup_s:g} s"
        elif ready_at is not None and now - ready_at > limit_s:
            why = f"time limit: killed after {limit_s:g} s (compile, checks and timing)"
        if why is not None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return why
        time.sleep(0.02)
    return None


def _read(
    work: Path,
    slot: KernelSlot,
    shapes: Sequence[Shape],
    seed: int,
    real: tuple[str, str] | None,
    returncode: int | None,
    killed: str | None,
) -> SandboxVerdict:
    if killed is not None:
        return _refuse(killed, "time-limit")
    result_file = work / "result.json"
    if not result_file.exists():
        tail = (work / "log.txt").read_text(errors="replace")[-400:].strip()
        code = returncode if returncode is None or returncode >= 0 else f"signal {-returncode}"
        return _refuse(
            f"the candidate's process died (exit {code}); its last output: {tail!r}", "crashed"
        )
    res = json.loads(result_file.read_text())
    if res["stage"] in ("compile", "run"):
        return _refuse(res["reason"], res["stage"])
    verdict = SandboxVerdict(False, "check", first_call_s=res.get("first_call_s"))
    reason = check_outputs(work / "outputs.safetensors", slot, shapes, seed, real, verdict.checks)
    if reason is not None:
        verdict.reason = reason
        return verdict
    if res["stage"] != "done":
        verdict.stage, verdict.reason = res["stage"], res["reason"]
        return verdict
    for t in res["timings"]:
        ratio = Ratio(
            [c / k for c, k in zip(t["current_s"], t["candidate_s"], strict=True) if k > 0]
        )
        row = {
            "shape": t["shape"],
            "candidate_us": 1e6 * Ratio(t["candidate_s"]).median,
            "current_us": 1e6 * Ratio(t["current_s"]).median,
            "speedup": ratio.to_dict(),
            "verdict": ratio.verdict(),
        }
        verdict.timings.append(row)
        if ratio.verdict() == "faster":
            verdict.faster_at.append(t["shape"])
    verdict.accepted, verdict.stage = True, "done"
    return verdict


def check_outputs(
    path: Path,
    slot: KernelSlot,
    shapes: Sequence[Shape],
    seed: int,
    real: tuple[str, str] | None,
    into: list[dict[str, Any]],
) -> str | None:
    """Every saved output against the slot's reference, rebuilt here; the first failure's
    reason (None: all passed). One row per shape is appended to ``into``."""
    from safetensors.torch import load_file

    outputs = load_file(str(path)) if path.exists() else {}
    weight = load_file(real[0])[real[1]] if real else None
    for i, shape in enumerate(shapes):
        cases = slot.cases(shape, seed, weight)
        row: dict[str, Any] = {"shape": dict(shape), "cases": len(cases), "passed": 0}
        into.append(row)
        for j, case in enumerate(cases):
            y = outputs.get(f"{i}/{j}")
            why = "no output was saved" if y is None else case.check(y)
            if why is not None:
                return f"shape {_shape_text(shape)}, {case.label}: {why}"
            row["passed"] += 1
    return None


__all__ = ["MAX_SOURCE_BYTES", "SandboxVerdict", "check_outputs", "precheck", "run_sandbox"]
