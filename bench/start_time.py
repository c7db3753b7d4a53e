"""Start time of ``specpilot generate``: wall time from launch to the first streamed token.

For each repeat: a fresh cache holding only the fetched model file (no converted copy, no
converted tokenizer) and a first start in it, then a second start in the same cache. Prints each
start and the medians; ``--src`` times another source tree the same way (e.g. a checkout of
main, for the start before the converted copy existed), interleaved with this one so that both
see the same machine load.

    python bench/start_time.py --repeats 3 [--src /path/to/other/src] [-- generate args]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1] / "src"


def first_token_s(src: Path, cache: Path, extra: list[str]) -> float:
    """Seconds from launching ``generate`` until its first byte on stdout (the first token)."""
    env = {
        **os.environ,
        "SPECPILOT_CACHE": str(cache),
        "PYTHONPATH": str(src),
        "PYTHONUNBUFFERED": "1",
    }
    cmd = [sys.executable, "-m", "specpilot.cli", "generate", *extra]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    assert proc.stdout is not None
    first = proc.stdout.read(1)
    seconds = time.perf_counter() - t0
    proc.kill()
    proc.wait()
    if not first:
        raise SystemExit(f"{' '.join(cmd)} printed nothing (exit status {proc.returncode})")
    return seconds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--src", type=Path, action="append", default=[], help="other source trees")
    p.add_argument(
        "--model",
        type=Path,
        default=Path.home()
        / ".cache/specpilot/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf",
        help="the fetched model file to seed each fresh cache with",
    )
    p.add_argument("extra", nargs="*", help="arguments after `generate` (default: none)")
    args = p.parse_args()
    if not args.model.is_file():
        raise SystemExit(f"{args.model} does not exist; run `specpilot models fetch` first")
    trees = [HERE, *[s.resolve() for s in args.src]]
    times: dict[tuple[Path, str], list[float]] = {}
    for r in range(args.repeats):
        for src in trees:
            with tempfile.TemporaryDirectory(prefix="specpilot-start-") as tmp:
                cache = Path(tmp)
                models = cache / "models" / "smollm2-135m"
                models.mkdir(parents=True)
                shutil.copy2(args.model, models / args.model.name)
                for which in ("first", "second"):
                    s = first_token_s(src, cache, args.extra)
                    times.setdefault((src, which), []).append(s)
                    print(f"repeat {r + 1} {src}: {which} start {s:.2f} s", flush=True)
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    for src in trees:
        first = statistics.median(times[(src, "first")])
        second = statistics.median(times[(src, "second")])
        print(
            f"{src}: median first start {first:.2f} s, second start {second:.2f} s "
            f"({second / first:.2f} of the first) over {args.repeats} repeats"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
