"""The kernel sandbox's child process: runs one candidate kernel, saves its outputs, times it.

``python -m specpilot.tune.kernel_sandbox_child REQUEST.json`` (started by
``tune/kernel_sandbox.py``, never imported by the engine). It builds the slot's check cases
(inputs only: their checks run in the parent, on the outputs saved here), writes the ready
marker (the parent's time limit starts then, so start-up is not counted against the kernel),
imports the candidate's source, runs its entry on every case of every claimed shape, saves the
outputs (safetensors: the parent never unpickles anything of the child's), then times the
candidate against the engine's current kernel: warmed up, interleaved rounds, the device
synchronised before every clock read. Whatever goes wrong is written as a stage and a reason;
a crash or a hang is the parent's to see (no result file, or the time limit).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any


def _tail(exc: BaseException, n: int = 600) -> str:
    if isinstance(exc, SyntaxError):
        return f"SyntaxError: {exc.msg} (candidate line {exc.lineno})"
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "candidate" in f.filename]
    where = f" (candidate line {frames[-1].lineno})" if frames else ""
    return (text + where)[-n:]


def _time(fn: Any, args: tuple[Any, ...], reps: int, sync: Any) -> float:
    """Seconds per call over ``reps`` calls, the device synchronised before each clock read."""
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn(*args)
    sync()
    return (time.perf_counter() - t0) / reps


def main(request_path: str) -> int:
    req = json.loads(Path(request_path).read_text())
    result: dict[str, Any] = {"stage": "started"}
    out = Path(req["result"])

    def finish(stage: str, reason: str | None = None, **extra: Any) -> int:
        result.update(stage=stage, reason=reason, **extra)
        out.write_text(json.dumps(result))
        return 0

    import torch
    from safetensors.torch import load_file, save_file

    from specpilot.kernels.slots import load, resolve_slot, to_device

    slot = resolve_slot(req["slot"])
    device = torch.device(req["device"])
    real = load_file(req["real"][0])[req["real"][1]] if req.get("real") else None
    shapes = req["shapes"]
    cases = [slot.cases(s, req["seed"], real) for s in shapes]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    Path(req["ready"]).write_text("ready")
    try:
        spec = importlib.util.spec_from_file_location("candidate", req["source_file"])
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except BaseException as e:
        return finish("compile", f"the source does not import: {_tail(e)}")
    entry = getattr(module, req["entry"], None)
    if not callable(entry):
        return finish("compile", f"the source defines no function {req['entry']!r}")
    outputs: dict[str, torch.Tensor] = {}
    first_call_s = None
    for i, shape_cases in enumerate(cases):
        for j, case in enumerate(shape_cases):
            args = tuple(to_device(a, device) for a in case.args)
            try:
                t0 = time.perf_counter()
                y = entry(*args)
                sync()
                if first_call_s is None:
                    first_call_s = time.perf_counter() - t0  # compile + first run
            except BaseException as e:
                return finish("run", f"shape {shapes[i]}, {case.label}: {_tail(e)}")
            if not isinstance(y, torch.Tensor):
                return finish(
                    "run",
                    f"shape {shapes[i]}, {case.label}: returned {type(y).__name__}, not a tensor",
                )
            outputs[f"{i}/{j}"] = y.detach().to("cpu").contiguous()
    save_file(outputs, req["outputs"])
    result["first_call_s"] = first_call_s
    current = load(slot.current)
    timings = []
    for i, shape_cases in enumerate(cases):
        args = tuple(to_device(a, device) for a in shape_cases[-1].args)
        try:
            for _ in range(2):  # warm-up (and the current kernel's compile)
                entry(*args)
                current(*args)
            cand: list[float] = []
            cur: list[float] = []
            for r in range(req["rounds"]):  # interleaved, the order alternating
                pair = [(entry, cand), (current, cur)]
                for fn, into in pair if r % 2 == 0 else pair[::-1]:
                    into.append(_time(fn, args, req["reps"], sync))
        except BaseException as e:
            return finish("time", f"timing at shape {shapes[i]}: {_tail(e)}")
        timings.append({"shape": shapes[i], "candidate_s": cand, "current_s": cur})
    return finish("done", None, timings=timings)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
