"""A converted copy of each GGUF in the cache, so that only the first start dequantizes it.

Reading a GGUF costs seconds before the first token (its reader parses 49k tokens of metadata
for SmolLM2, then every tensor is dequantized; 30–55 s on a loaded 2-core machine, issue 16).
The first load writes what it produced — the loaded network's float32 weights
(``Transformer.weights``: q/k/v and gate/up already fused) and the model config — to
``<cache>/converted/<stem>-<key>/``:

* ``model.safetensors`` — the weights, bit-identical to a fresh dequantization (float32,
  whatever dtype a command asks for), written 64-byte aligned so that a later load can map
  them as the network's parameters without copying them (``Transformer.adopt_weights``);
* ``manifest.json`` — the format version, the layout of the tensors, the source's fingerprint
  (resolved path, size, mtime in ns, sha256 of its first and last MiB), the config, and the
  weights' size and CRC-32.

A later load trusts the copy only when the fingerprint still matches the source (otherwise the
source changed: it is converted again) and the weights' size and CRC-32 match the manifest
(otherwise the copy is corrupt: it is rebuilt, with a note). CRC-32 rather than sha256 because
it is checked on every start and runs at several GB/s: it catches truncation and damaged
pages; anyone who could forge it could rewrite the manifest too. The weights are written under a
temporary name and renamed into place, and the manifest is removed first and written last, so a
process killed at any point leaves either a complete entry or none that is trusted. A cache
that cannot be written (read-only, too little free space) costs only the conversion next time.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import shutil
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from specpilot.config import ModelConfig
from specpilot.errors import CheckpointError
from specpilot.loading.fetch import cache_dir
from specpilot.loading.names import check_tensors
from specpilot.progress import QUIET, Progress, megabytes

FORMAT = 1
"""Version of the entry layout; an entry of another version is rebuilt."""
WEIGHTS = "model.safetensors"
MANIFEST = "manifest.json"
_EDGE = 1 << 20  # bytes hashed at each end of the source for its fingerprint
_CHUNK = 64 << 20  # bytes per CRC-32 update

Convert = Callable[[Path, Progress], tuple[ModelConfig, dict[str, torch.Tensor]]]
"""Reads a source file into a config and named tensors (e.g. ``load_gguf``: HF names)."""
Validate = Callable[[ModelConfig, Mapping[str, torch.Tensor], str], None]
"""Raises CheckpointError, naming the entry (its third argument), if tensors do not fit a
config."""
_ALIGN = 64  # bytes: where every tensor of a whole multiple of this size starts
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def converted_dir(source: Path) -> Path:
    """The cache entry of ``source``: one per resolved path, rebuilt in place when it changes."""
    resolved = Path(source).expanduser().resolve()
    key = hashlib.sha256(str(resolved).encode()).hexdigest()[:12]
    return cache_dir() / "converted" / f"{resolved.stem}-{key}"


def source_fingerprint(source: Path) -> dict[str, Any]:
    """What identifies the bytes of ``source`` without reading them all."""
    path = Path(source).expanduser().resolve()
    st = path.stat()
    digest = hashlib.sha256()
    with path.open("rb") as f:
        digest.update(f.read(_EDGE))
        if st.st_size > 2 * _EDGE:
            f.seek(st.st_size - _EDGE)
            digest.update(f.read(_EDGE))
    return {
        "path": str(path),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "edges_sha256": digest.hexdigest(),
    }


def file_crc32(path: Path) -> int:
    """CRC-32 of the whole file (memory-mapped, in chunks)."""
    crc = 0
    with path.open("rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return crc
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            view = memoryview(mm)
            try:
                for start in range(0, len(view), _CHUNK):
                    crc = zlib.crc32(view[start : start + _CHUNK], crc)
            finally:
                view.release()
    return crc


def check_hf_tensors(cfg: ModelConfig, tensors: Mapping[str, torch.Tensor], where: str) -> None:
    """The default :data:`Validate`: HF-named tensors, as the checkpoint readers return them."""
    check_tensors(cfg, tensors, where)


def load_with_converted_copy(
    source: Path,
    convert: Convert,
    progress: Progress = QUIET,
    layout: str = "hf",
    validate: Validate = check_hf_tensors,
    also_accept: tuple[str, ...] = (),
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """``convert(source)``, from the cache's converted copy when it is valid; the first call
    converts and writes the copy. ``layout`` names what ``convert`` returns; a copy of that
    layout or of one in ``also_accept`` is used, one of another layout is rebuilt. ``validate``
    checks that a copy's tensors fit its config."""
    source = Path(source).expanduser()
    entry = converted_dir(source)
    fingerprint = source_fingerprint(source)
    layouts = (layout, *also_accept)
    cached = _read_entry(entry, source, fingerprint, layouts, validate, progress)
    if cached is not None:
        return cached
    cfg, tensors = convert(source, progress)
    _write_entry(entry, source, fingerprint, layout, cfg, tensors, progress)
    return cfg, tensors


def _read_entry(
    entry: Path,
    source: Path,
    fingerprint: dict[str, Any],
    layouts: tuple[str, ...],
    validate: Validate,
    progress: Progress,
) -> tuple[ModelConfig, dict[str, torch.Tensor]] | None:
    """The entry's config and tensors, or None (with a note when a copy existed but is not
    trusted) if it must be (re)built."""
    manifest_path = entry / MANIFEST
    if not manifest_path.is_file():
        return None
    rebuild = f"rebuilding the converted copy of {source.name} in {entry}"
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        stored_source = manifest["source"]
        weights_bytes, weights_crc = int(manifest["weights_bytes"]), int(manifest["weights_crc32"])
        config = manifest["config"]
        fmt, layout = manifest.get("format"), manifest.get("layout")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        progress.note(f"the manifest of the converted copy is unreadable; {rebuild}.")
        return None
    if fmt != FORMAT:
        progress.note(f"the converted copy was made by another SpecPilot version; {rebuild}.")
        return None
    if layout not in layouts:
        progress.note(
            f"the converted copy holds {layout}, this load needs {layouts[0]}; {rebuild}."
        )
        return None
    if stored_source != fingerprint:
        progress.note(f"{source} changed since it was converted; converting it again.")
        return None
    weights = entry / WEIGHTS
    progress.phase(f"checking the converted copy of {source.name}")
    try:
        intact = weights.stat().st_size == weights_bytes and file_crc32(weights) == weights_crc
    except OSError:
        intact = False
    if not intact:
        progress.note(f"the converted copy is corrupt (its size or CRC-32 is wrong); {rebuild}.")
        return None
    progress.phase(f"loading the converted copy of {source.name} ({megabytes(weights_bytes)})")
    try:
        from safetensors.torch import load_file

        cfg = ModelConfig.from_dict(config)
        tensors = load_file(str(weights))  # memory-mapped: pages are read when first touched
        validate(cfg, tensors, str(entry))
    except (CheckpointError, OSError, ValueError, TypeError, KeyError, RuntimeError) as e:
        progress.note(f"the converted copy does not load ({_first_line(e)}); {rebuild}.")
        return None
    return cfg, tensors


def _write_entry(
    entry: Path,
    source: Path,
    fingerprint: dict[str, Any],
    layout: str,
    cfg: ModelConfig,
    tensors: dict[str, torch.Tensor],
    progress: Progress,
) -> None:
    """Write the entry atomically (weights renamed into place, manifest last); on failure leave
    no trusted entry and say so."""
    need = sum(t.numel() * t.element_size() for t in tensors.values())
    part = entry / f"{WEIGHTS}.{os.getpid()}.part"
    try:
        entry.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(entry).free
        if free < need + need // 20 + (64 << 20):
            progress.note(
                f"{entry.parent} has {megabytes(free)} free, too little for a converted copy of "
                f"{source.name} ({megabytes(need)}); the next start converts it again."
            )
            return
        progress.phase(f"writing a converted copy of {source.name} ({megabytes(need)}) to {entry}")
        (entry / MANIFEST).unlink(missing_ok=True)  # the old copy stops being trusted first
        save_aligned(tensors, part)
        os.chmod(part, 0o644)  # cached files are shared data
        manifest = {
            "format": FORMAT,
            "layout": layout,
            "source": fingerprint,
            "config": cfg.to_dict(),
            "weights_bytes": part.stat().st_size,
            "weights_crc32": file_crc32(part),
        }
        os.replace(part, entry / WEIGHTS)
        _write_atomically(entry / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    except OSError as e:
        progress.note(
            f"could not write a converted copy of {source.name} to {entry} ({_first_line(e)}); "
            "the next start converts it again."
        )
    finally:
        _remove(part)


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):  # nothing was written where the folder could not be made
        path.unlink(missing_ok=True)


def save_aligned(tensors: Mapping[str, torch.Tensor], path: Path) -> None:
    """Write ``tensors`` in the safetensors format with every tensor's data 64-byte aligned.

    safetensors' own writer starts the data wherever its header ends; here the header is padded
    with spaces (which the format allows) so that the data starts on a multiple of 64, and
    tensors whose size is a multiple of 64 bytes come first, so that each of them starts on
    one too (a mapped tensor can then serve as a parameter as it is).
    """
    order = sorted(
        tensors,
        key=lambda n: (tensors[n].numel() * tensors[n].element_size() % _ALIGN != 0, n),
    )
    header: dict[str, Any] = {}
    offset = 0
    for name in order:
        t = tensors[name]
        if t.dtype not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"Cannot cache tensor {name} of dtype {t.dtype}.")
        nbytes = t.numel() * t.element_size()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % _ALIGN)
    with path.open("wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name in order:
            flat = tensors[name].detach().contiguous().reshape(-1)
            f.write(flat.view(torch.uint8).cpu().numpy().data)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.part")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        _remove(tmp)


def list_converted() -> list[tuple[Path, str, int]]:
    """Converted copies in the cache as ``(entry, source path, bytes)``; reads only manifests."""
    root = cache_dir() / "converted"
    rows: list[tuple[Path, str, int]] = []
    for manifest_path in sorted(root.glob(f"*/{MANIFEST}")) if root.is_dir() else []:
        try:
            manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
            rows.append(
                (
                    manifest_path.parent,
                    str(manifest["source"]["path"]),
                    int(manifest["weights_bytes"]),
                )
            )
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return rows


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
