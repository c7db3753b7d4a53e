"""A deployment's identity: what it runs (content hashes) and where (GPU, driver, torch, dtype, mode).

Two tunes of the same fingerprint share trials; deployments that differ only in some fields
are *similar*, and a tune warm-starts from their validated results.
"""

from __future__ import annotations

import hashlib
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


@dataclass(frozen=True, slots=True)
class Fingerprint:
    target_hash: str
    """sha256 (first 16 hex) of the target's files; a synthetic target hashes its spec."""
    drafter: str
    """Drafter kind, plus the draft model's hash when there is one."""
    device_name: str
    capability: str
    driver: str
    torch_version: str
    dtype: str
    mode: str

    @property
    def key(self) -> str:
        """One string for the whole fingerprint (the deployments table's primary key)."""
        raw = "|".join(str(v) for v in asdict(self).values())
        return hashlib.sha256(raw.encode()).hexdigest()[:16]

    def similarity(self, other: Fingerprint) -> int:
        """How many identity fields two deployments share (higher = more alike)."""
        mine, theirs = asdict(self), asdict(other)
        weights = {
            "target_hash": 3,
            "drafter": 2,
            "device_name": 3,
            "capability": 1,
            "dtype": 2,
            "mode": 2,
        }
        return sum(w for f, w in weights.items() if mine[f] == theirs[f])

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


def content_hash(spec: str) -> str:
    """Hash a model's files (size + first and last MiB of each, for speed), or the spec itself."""
    from specpilot.errors import SpecPilotError
    from specpilot.loading import resolve_model

    try:
        path = resolve_model(spec)
    except SpecPilotError:
        return hashlib.sha256(spec.encode()).hexdigest()[:16]
    files = (
        [path]
        if path.is_file()
        else sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".json"))
    )
    h = hashlib.sha256()
    for f in files:
        _hash_file(h, f)
    return h.hexdigest()[:16]


def _hash_file(h: hashlib._Hash, f: Path) -> None:
    size = f.stat().st_size
    h.update(f.name.encode() + str(size).encode())
    with f.open("rb") as fh:
        h.update(fh.read(1 << 20))
        if size > 2 << 20:
            fh.seek(-(1 << 20), 2)
            h.update(fh.read(1 << 20))


def device_identity(device: torch.device) -> tuple[str, str, str]:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return props.name, f"sm_{props.major}{props.minor}", str(torch.version.cuda)
    return platform.processor() or platform.machine(), "cpu", "-"


def fingerprint_deployment(
    target: str, drafter: str, draft_model: str | None, device: torch.device, dtype: str, mode: str
) -> Fingerprint:
    name, cap, driver = device_identity(device)
    drafter_id = drafter if draft_model is None else f"{drafter}:{content_hash(draft_model)}"
    return Fingerprint(
        target_hash=content_hash(target),
        drafter=drafter_id,
        device_name=name,
        capability=cap,
        driver=driver,
        torch_version=torch.__version__,
        dtype=dtype,
        mode=mode,
    )


def gpu_fingerprint(device: torch.device, copy_bandwidth: float | None = None) -> dict[str, str]:
    """What a kernel's measured tiling depends on: the GPU (name, capability, SM count, memory
    size, memory clock and bus width where NVML or torch tell them), the driver, torch and triton.
    ``key`` (16 hex) hashes these; ``copy_bw`` (TB/s, measured) is recorded beside, not hashed,
    since it moves run to run."""
    info: dict[str, str] = {"torch": torch.__version__}
    try:
        import triton

        info["triton"] = str(triton.__version__)
    except ImportError:
        info["triton"] = "-"
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info |= {
            "name": p.name,
            "capability": f"sm_{p.major}{p.minor}",
            "sms": str(p.multi_processor_count),
            "memory_gib": str(round(p.total_memory / 2**30)),
            "cuda": str(torch.version.cuda),
        }
        for attr, field_name in (("memory_clock_rate", "mem_clock_khz"),
                                 ("memory_bus_width", "mem_bus_bits")):  # fmt: skip
            if hasattr(p, attr):
                info[field_name] = str(getattr(p, attr))
        try:
            import pynvml

            pynvml.nvmlInit()
            info["driver"] = str(pynvml.nvmlSystemGetDriverVersion())
        except Exception:
            info["driver"] = str(torch.version.cuda)
    else:
        info |= {"name": platform.processor() or platform.machine(), "capability": "cpu"}
    info["key"] = hashlib.sha256("|".join(f"{k}={v}" for k, v in sorted(info.items())).encode()).hexdigest()[:16]  # fmt: skip
    if copy_bandwidth is not None:
        info["copy_bw_TBps"] = f"{copy_bandwidth / 1e12:.2f}"
    return info
