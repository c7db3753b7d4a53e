"""Ray for a machine that has neither it nor a package registry: its wheels, cut to fit a carry.

    python3 bench/ray_wheels.py --out .whl/ray                 # CPython 3.12 (the GPU machine)
    python3 bench/ray_wheels.py --out DIR --python 3.11 --check  # this machine's Python: try it

Downloads (pip, here) ``ray==VERSION`` and every dependency as manylinux x86_64 wheels for
``--python``, then rewrites Ray's wheel without what ``specpilot tune --executor ray`` never loads:
``ray/jars`` (the Java workers, 32 of its 79 MB), ``ray/rllib`` and ``ray/llm``, so that the
folder (about 50 MB) fits a 64 MiB carry. There:

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/ray/*.whl
    export PYTHONPATH=/tmp/site:src

``--check`` installs the folder into a fresh directory and runs two actors on a local cluster
from it (only when ``--python`` is this interpreter's).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

DROP = ("ray/jars/", "ray/rllib/", "ray/llm/")
"""Folders of Ray's wheel that the executor never imports."""

CHECK = """
import os, ray
ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
assert ray.__file__.startswith(os.environ["SITE"]), ray.__file__
@ray.remote(num_cpus=1, max_restarts=1)
class A:
    def pid(self):
        return os.getpid()
print("actors on", sorted(ray.get([A.remote().pid.remote() for _ in range(2)])), "from", ray.__file__)
ray.shutdown()
"""


def prune(wheel: Path) -> int:
    """Rewrite ``wheel`` without ``DROP`` (and their RECORD lines); bytes saved."""
    before = wheel.stat().st_size
    tmp = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():  # the ZipInfo keeps each file's mode (Ray's binaries)
            if info.filename.startswith(DROP):
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(x for x in lines if not x.startswith(DROP)).encode()
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    tmp.replace(wheel)
    return before - wheel.stat().st_size


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--version", default="2.60.0")
    ap.add_argument("--python", default="3.12")
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", f"ray=={args.version}", "-q"]
    cmd += ["--python-version", args.python, "--only-binary=:all:", "-d", str(args.out)]
    for tag in ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64", "any"):
        cmd += ["--platform", tag]
    subprocess.run(cmd, check=True)
    for wheel in args.out.glob("ray-*.whl"):
        print(f"{wheel.name}: {prune(wheel) / 1e6:.1f} MB of {', '.join(DROP)} left out")
    total = sum(f.stat().st_size for f in args.out.glob("*.whl"))
    print(f"{args.out}: {len(list(args.out.glob('*.whl')))} wheels, {total / 2**20:.1f} MiB")
    if args.check and args.python == f"{sys.version_info.major}.{sys.version_info.minor}":
        with tempfile.TemporaryDirectory() as site:
            pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
            subprocess.run([*pip, "--target", site, *map(str, args.out.glob("*.whl"))], check=True)
            env = {"PYTHONPATH": site, "SITE": site, "PATH": "/usr/bin:/bin"}
            subprocess.run([sys.executable, "-c", CHECK], check=True, env=env)


if __name__ == "__main__":
    main()
