"""Hardware ceilings: measured on the spot, or taken from a datasheet table for planning.

Three numbers bound a decode step (see docs/COSTMODEL.md):

* ``bandwidth_Bps`` — memory bandwidth; measured as a large device-to-device copy counting bytes
  read **plus** bytes written (what a weight stream through a GEMV can hope for);
* ``matmul_flops`` — dense matmul rate in the model's dtype (an n×n×n product);
* ``launch_s`` — fixed cost per kernel (GPU: one kernel of a replayed CUDA graph, the engine's
  mode; CPU: one tiny torch op, i.e. dispatch overhead).

Measured figures time with CUDA events on a GPU and ``perf_counter`` on the CPU (torch's
current thread count), median of 3 runs after warm-up. Datasheet figures (``GPUS``) are
vendor peak numbers, never measurements; ``GpuSpec.ceilings`` can scale them by the fractions we
measured on our H200 to turn a peak into an achievable estimate.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from specpilot.timing import time_call


@dataclass(frozen=True, slots=True)
class Ceilings:
    """What one device can do; the denominators of every roofline time."""

    name: str
    bandwidth_Bps: float
    """Memory bandwidth in bytes/s, read + write counted."""
    matmul_flops: float
    """Dense matmul rate in FLOP/s in ``dtype``."""
    launch_s: float
    """Fixed cost per kernel (GPU: inside a CUDA graph; CPU: one torch op's dispatch)."""
    dtype: str
    source: str
    """``measured (...)`` or ``datasheet (...)``: every report prints it."""
    eager_launch_s: float | None = None
    """GPU only: per-kernel cost of eager (non-graph) launches, for reference."""

    def __post_init__(self) -> None:
        if self.bandwidth_Bps <= 0 or self.matmul_flops <= 0 or self.launch_s < 0:
            raise ValueError(f"ceilings of {self.name} must be positive")

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """Datasheet figures of one GPU (dense rates: no 2:4 sparsity)."""

    name: str
    bandwidth_Bps: float
    bf16_flops: float
    fp8_flops: float | None
    """None where the GPU has no FP8 tensor cores (A100)."""
    l2_bytes: int
    sm_count: int
    memory_bytes: int
    source: str

    def ceilings(
        self,
        dtype: str = "bf16",
        bandwidth_fraction: float = 1.0,
        matmul_fraction: float = 1.0,
        launch_s: float = 2.0e-6,
    ) -> Ceilings:
        """Ceilings for a paper prediction: the datasheet peaks times the given fractions."""
        rate = self.bf16_flops
        if dtype == "fp8":
            if self.fp8_flops is None:
                raise ValueError(f"{self.name} has no FP8 tensor cores")
            rate = self.fp8_flops
        label = (
            "datasheet peak"
            if bandwidth_fraction == matmul_fraction == 1.0
            else (f"datasheet x {bandwidth_fraction:.3f} bandwidth, x {matmul_fraction:.3f} matmul")
        )
        return Ceilings(
            name=self.name,
            bandwidth_Bps=self.bandwidth_Bps * bandwidth_fraction,
            matmul_flops=rate * matmul_fraction,
            launch_s=launch_s,
            dtype=dtype,
            source=f"{label} ({self.source}); launch {launch_s * 1e6:.1f} us/kernel assumed",
        )


_GB, _MB, _T = 10**9, 2**20, 10**12

# Datasheet figures (vendor peaks, dense). Sources:
#  H100 SXM5  — NVIDIA H100 Tensor Core GPU datasheet (3.35 TB/s HBM3; BF16 989 / FP8 1979 dense
#               TFLOP/s, listed as 1979 / 3958 "with sparsity"); Hopper architecture whitepaper
#               (132 SMs on SXM5, 50 MB L2).
#  H200 SXM   — NVIDIA H200 Tensor Core GPU datasheet (141 GB HBM3e at 4.8 TB/s; same GH100 compute
#               as H100 SXM: BF16 989 / FP8 1979 dense; 132 SMs, 50 MB L2).
#  B200       — NVIDIA DGX/HGX B200 datasheets divided per GPU (8 TB/s HBM3e; BF16 2.25 / FP8
#               4.5 PFLOP/s dense, half the "sparse" figures; 180 GB). SM count (148) and L2
#               (126 MiB) are not on the datasheet: they are what CUDA's device query reports in
#               public B200 listings; treat them as approximate.
#  RTX PRO 6000 Blackwell (Workstation) — NVIDIA RTX PRO 6000 Blackwell datasheet (96 GB GDDR7,
#               1792 GB/s) and the RTX Blackwell architecture whitepaper (GB202: 188 SMs, 128 MB
#               L2; FP16/BF16 tensor with FP32 accumulate 503.8 dense, FP8 1007.6 dense TFLOP/s).
#  A100 80GB SXM — NVIDIA A100 datasheet (2039 GB/s HBM2e; BF16 312 dense; no FP8); Ampere
#               whitepaper (108 SMs, 40 MB L2).
#  L40S       — NVIDIA L40S datasheet (48 GB GDDR6 at 864 GB/s; BF16 362 / FP8 733 dense, listed as
#               733 / 1466 with sparsity); Ada whitepaper (142 SMs, 96 MB L2).
GPUS: dict[str, GpuSpec] = {
    "h100": GpuSpec("H100 SXM", 3.35e12, 989.4 * _T, 1978.9 * _T, 50 * _MB, 132, 80 * _GB,
                    "NVIDIA H100 datasheet"),
    "h200": GpuSpec("H200 SXM", 4.8e12, 989.4 * _T, 1978.9 * _T, 50 * _MB, 132, 141 * _GB,
                    "NVIDIA H200 datasheet"),
    "b200": GpuSpec("B200", 8.0e12, 2250 * _T, 4500 * _T, 126 * _MB, 148, 180 * _GB,
                    "NVIDIA DGX B200 datasheet, per GPU"),
    "rtx-pro-6000": GpuSpec("RTX PRO 6000 Blackwell", 1.792e12, 503.8 * _T, 1007.6 * _T,
                            128 * _MB, 188, 96 * _GB, "NVIDIA RTX PRO 6000 Blackwell datasheet"),
    "a100": GpuSpec("A100 80GB SXM", 2.039e12, 312 * _T, None, 40 * _MB, 108, 80 * _GB,
                    "NVIDIA A100 datasheet"),
    "l40s": GpuSpec("L40S", 0.864e12, 362.05 * _T, 733 * _T, 96 * _MB, 142, 48 * _GB,
                    "NVIDIA L40S datasheet"),
}  # fmt: skip
"""Key → datasheet figures. Keys are what ``specpilot profile --paper`` accepts."""

H200_MEASURED_BANDWIDTH_FRACTION = 4.25e12 / 4.8e12
"""Copy bandwidth we measured on our H200 (4.25 TB/s, DESIGN.md) over its datasheet 4.8 TB/s."""
H200_MEASURED_MATMUL_FRACTION = 790e12 / 989.4e12
"""bf16 matmul rate we measured on our H200 (≈790 TFLOP/s) over its datasheet dense peak."""


def gpu_spec(key: str) -> GpuSpec:
    try:
        return GPUS[key.lower()]
    except KeyError:
        raise ValueError(f"Unknown GPU '{key}'; choose one of {', '.join(GPUS)}.") from None


# ---------------------------------------------------------------------- measured on the spot


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


Clock = Callable[[], float]


def copy_bandwidth(device: torch.device, nbytes: int, clock: Clock = time.perf_counter) -> float:
    """Bytes/s of a device-to-device copy of ``nbytes``, counting read + write."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    sec = time_call(lambda: dst.copy_(src), device, iters=10, clock=clock)
    return 2 * src.numel() * 4 / sec


def matmul_rate(
    device: torch.device, dtype: torch.dtype, n: int, clock: Clock = time.perf_counter
) -> float:
    """FLOP/s of an n×n×n matmul in ``dtype``."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    sec = time_call(lambda: a @ b, device, iters=5 if device.type == "cpu" else 20, clock=clock)
    return 2 * n**3 / sec


def launch_latency(device: torch.device, graph: bool, clock: Clock = time.perf_counter) -> float:
    """Seconds per tiny kernel: ``x.add_(1)`` on one element, back to back (in a CUDA graph when
    ``graph``), i.e. the fixed cost one more kernel adds to a step."""
    x = torch.zeros(1, device=device)
    n = 200
    if graph and device.type == "cuda":
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            x.add_(1)
        torch.cuda.current_stream(device).wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(n):
                x.add_(1)
        return time_call(g.replay, device, iters=10) / n

    def burst() -> None:
        for _ in range(n):
            x.add_(1)

    return time_call(burst, device, iters=3, clock=clock) / n


def measure_ceilings(
    device: torch.device, dtype: torch.dtype, quick: bool = False, process_clock: bool = False
) -> Ceilings:
    """Measure the three ceilings on ``device`` in ``dtype`` (``quick``: small sizes, for tests;
    ``process_clock``: CPU seconds of this process instead of wall time, CPU only)."""
    from specpilot.runtime import dtype_name

    cuda = device.type == "cuda"
    if cuda:
        nbytes, n = (64 << 20, 1024) if quick else (4 << 30, 8192)
        name = torch.cuda.get_device_name(device)
    else:
        nbytes, n = (16 << 20, 256) if quick else (512 << 20, 1024)
        name = f"CPU ({torch.get_num_threads()} torch threads)"
    clock = time.process_time if process_clock and not cuda else time.perf_counter
    with torch.inference_mode():
        bw = copy_bandwidth(device, nbytes, clock)
        rate = matmul_rate(device, dtype, n, clock)
        launch = launch_latency(device, graph=cuda, clock=clock)
        eager = launch_latency(device, graph=False) if cuda else None
    return Ceilings(
        name=name,
        bandwidth_Bps=bw,
        matmul_flops=rate,
        launch_s=launch,
        dtype=dtype_name(dtype),
        source=f"measured ({'CUDA events' if cuda else clock.__name__}, copy {nbytes >> 20} MiB, "
        f"matmul {n}^3)",
        eager_launch_s=eager,
    )
