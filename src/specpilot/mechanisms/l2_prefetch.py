"""L2 prefetch: before a small phase of each decoder layer, prefetch the first bytes of the matrix
that follows it into L2, so that its GEMV reads them from L2 instead of HBM.

A decode or verify step at a few rows streams every weight once. Between the matrices run small
kernels — the norms, RoPE + K/V write + attention at short context, SiLU·mul — during which HBM
is mostly idle. Prefetching the head of the next matrix in that window takes those bytes off the
GEMV's critical path: at most ``min(prefetched bytes / HBM bandwidth, idle window)`` per phase
(``l2_prefetch_cost.py``). An L2 (50 MB on the H200) holds only part of the next matrix at 8B
shapes (w_qkv 48 MiB, w_o 32, w_gate_up 224, w_down 112 MiB for Llama-3-8B), hence the ``mb``
knob: MiB per phase, capped by the matrix and the device's L2.

Plug point ``layer_phases``: ``install`` puts hooks in ``DecoderLayer.phase_hooks`` at the idle
points of ``models/forward.PHASE_POINTS`` (knob ``phases``; each prefetches the matrix that
follows: ``input_norm`` → w_qkv, ``attention`` → w_o, ``post_attn_norm`` → w_gate_up, ``silu_mul``
→ w_down). The prefetch kernel is ``kernels/l2_prefetch.py`` (knobs ``instruction``,
``programs``). Knob ``stream``:

* ``same`` — the prefetch kernel is launched on the step's stream just before the phase: it
  only issues hints and exits, and the phase's kernels run while HBM serves them;
* ``side`` — forked onto a side stream at the phase (``side.wait_stream(current)``) and joined
  back just before the matrix (``current.wait_stream(side)``), so the phase's kernels never wait
  for the prefetch kernel. Inside CUDA-graph capture the fork and join become edges of a parallel
  branch of the graph; every fork is joined in the same layer body, so capture ends joined.

Prefetches are issued only inside CUDA-graph capture (the engine's decode, verify and draft
steps): in an eager step each hook would pay a host launch (tens of µs of Python and driver),
more than it saves, and eager prefill is compute-bound. The kernel is compiled and loaded at
install, outside any capture. On the CPU the hooks run the no-op or interpreted launch path
(``kernels/l2_prefetch.launch_mode``), so tests exercise the same code. A matrix that another
mechanism reads from its own storage (``DecoderLayer.linear_fns``, e.g. W12) is not prefetched.

Why it is lossless: a prefetch is a cache hint. The kernel executes only ``prefetch.global.L2`` /
``cp.async.bulk.prefetch.L2`` on the weight matrices (read-only during decoding) and stores
nothing; the forward's kernels, their inputs and their order on the step's stream are unchanged
(the side stream only adds dependencies), so every kernel computes bit for bit what it computes
without the mechanism. Tests: engine tokens with the hooks equal those without (AR, chain and
tree verify); on CUDA (the GPU bench) the same with graphs, both streams, fp32 and bf16.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from specpilot.errors import SpecPilotError
from specpilot.kernels.l2_prefetch import PrefetchSpec, bulk_supported, launch_mode, prefetch_l2
from specpilot.mechanisms.registry import Applicability, ConfigView, Knob, Mechanism

if TYPE_CHECKING:
    from specpilot.mechanisms.parts import EngineParts
    from specpilot.models.layer import DecoderLayer
    from specpilot.models.transformer import Transformer

NEXT_MATRIX = {
    "input_norm": "w_qkv",
    "attention": "w_o",
    "post_attn_norm": "w_gate_up",
    "silu_mul": "w_down",
}
"""Idle point of the layer body → the matrix right after it (whose head is prefetched there)."""

PHASE_SETS = {
    "all": ("input_norm", "attention", "post_attn_norm", "silu_mul"),
    "attention": ("attention",),
    "norms": ("input_norm", "post_attn_norm"),
    "attention+norms": ("input_norm", "attention", "post_attn_norm"),
    "mlp": ("post_attn_norm", "silu_mul"),
}
"""Knob ``phases``: which idle points prefetch."""

MiB = 1 << 20


@dataclass(slots=True)
class PhasePrefetch:
    """One idle point of one layer: prefetch ``nbytes`` of ``weight``, on a side stream or not.
    ``start`` is the hook at ``point``; ``join`` (side stream only) the hook at ``matrix``."""

    owner: L2Prefetch
    weight: Tensor  # [N, K] the matrix after the phase
    nbytes: int
    layer: DecoderLayer | None = None
    point: str = ""
    matrix: str = ""
    forked: bool = False

    def start(self) -> None:
        """Hook at the idle point: issue the prefetch (forking onto the side stream)."""
        pf = self.owner
        if not pf.active():
            return
        pf.issued += 1
        if pf.mode == "none":  # the CPU: nothing to launch
            return
        side = pf.side
        if side is None:
            prefetch_l2(self.weight, self.nbytes, pf.spec)
            return
        side.wait_stream(torch.cuda.current_stream(side.device))
        with torch.cuda.stream(side):
            prefetch_l2(self.weight, self.nbytes, pf.spec)
        self.forked = True

    def join(self) -> None:
        """Hook before the matrix: the step's stream waits for the side stream's prefetch."""
        if self.forked:
            side = self.owner.side
            assert side is not None
            torch.cuda.current_stream(side.device).wait_stream(side)
            self.forked = False

    def hooks(self) -> dict[str, Callable[[], None]]:
        """Point of the layer body → hook."""
        out: dict[str, Callable[[], None]] = {self.point: self.start}
        if self.owner.side is not None:
            out[self.matrix] = self.join
        return out


@dataclass(slots=True)
class L2Prefetch:
    """The prefetches of one model: :meth:`attach` puts their hooks in its layers, :meth:`detach`
    takes them out (a CUDA graph captured meanwhile keeps what it captured)."""

    device: torch.device
    spec: PrefetchSpec
    side: torch.cuda.Stream | None
    """The side stream (knob ``stream=side`` on CUDA), else None: the step's own stream."""
    phases: list[PhasePrefetch] = field(default_factory=list)
    issued: int = 0
    """Prefetches requested so far (inside capture on CUDA; every call on the CPU)."""
    mode: str = ""
    """``kernels/l2_prefetch.launch_mode`` of the device, fixed at construction."""

    def __post_init__(self) -> None:
        self.mode = launch_mode(self.device)

    def active(self) -> bool:
        """Issue now? Inside CUDA-graph capture on CUDA; always elsewhere (no-op or interpreted)."""
        return self.device.type != "cuda" or torch.cuda.is_current_stream_capturing()

    @property
    def prefetch_bytes(self) -> int:
        """Bytes prefetched per forward (all layers)."""
        return sum(p.nbytes for p in self.phases)

    def attach(self) -> None:
        """Install every hook; refuses (installing none) a point another hook holds."""
        for p in self.phases:
            assert p.layer is not None
            for point in p.hooks():
                if point in p.layer.phase_hooks:
                    raise SpecPilotError(
                        f"Another mechanism already hooks '{point}' of the layer body; "
                        "L2 prefetch cannot share it."
                    )
        for p in self.phases:
            assert p.layer is not None
            p.layer.phase_hooks.update(p.hooks())

    def detach(self) -> None:
        """Take every hook this object installed out of its layers."""
        for p in self.phases:
            assert p.layer is not None
            for point, fn in p.hooks().items():
                if p.layer.phase_hooks.get(point) == fn:
                    del p.layer.phase_hooks[point]

    def compile(self) -> None:
        """Launch every prefetch once now (CUDA), so that Triton compiles and loads the kernel
        outside any graph capture."""
        if self.mode == "asm":
            for p in self.phases:
                prefetch_l2(p.weight, p.nbytes, self.spec)
            torch.cuda.synchronize(self.device)


def installed(model: Transformer) -> L2Prefetch | None:
    """The :class:`L2Prefetch` whose hooks are in ``model``'s layers, if any."""
    for layer in model.layers:
        for fn in layer.phase_hooks.values():  # type: ignore[operator]
            owner = getattr(getattr(fn, "__self__", None), "owner", None)
            if isinstance(owner, L2Prefetch):
                return owner
    return None


def resolve_instruction(instruction: str, device: torch.device) -> str:
    """``auto`` → ``bulk`` where the device has ``cp.async.bulk`` (sm_90+), else ``line``."""
    if instruction != "auto":
        if instruction == "bulk" and device.type == "cuda" and not bulk_supported(device):
            raise SpecPilotError(
                "instruction=bulk needs compute capability 9.0 (Hopper) or newer; use line or auto."
            )
        return instruction
    return "bulk" if device.type != "cuda" or bulk_supported(device) else "line"


def l2_bytes(device: torch.device) -> int | None:
    """The device's L2 size (None on the CPU: no cap)."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.get_device_properties(device).L2_cache_size)


def install(
    model: Transformer,
    phases: str = "all",
    mb: float = 8,
    stream: str = "side",
    instruction: str = "auto",
    programs: int = 8,
) -> L2Prefetch:
    """Hook L2 prefetches into every decoder layer of ``model``; returns the handle."""
    from specpilot.models.layer import DecoderLayer

    if phases not in PHASE_SETS:
        raise SpecPilotError(f"phases must be one of {', '.join(PHASE_SETS)}, got '{phases}'.")
    if stream not in ("side", "same"):
        raise SpecPilotError(f"stream must be 'side' or 'same', got '{stream}'.")
    dev = model.device
    spec = PrefetchSpec(resolve_instruction(instruction, dev), programs)
    side = torch.cuda.Stream(dev) if dev.type == "cuda" and stream == "side" else None
    pf = L2Prefetch(device=dev, spec=spec, side=side)
    cap = l2_bytes(dev)
    want = int(mb * MiB)
    for layer in model.layers:
        assert isinstance(layer, DecoderLayer)
        for point in PHASE_SETS[phases]:
            matrix = NEXT_MATRIX[point]
            if matrix in layer.linear_fns:  # read from another storage: nothing to prefetch
                continue
            weight: Tensor = getattr(layer, matrix)
            nbytes = min(want, weight.numel() * weight.element_size(), cap or want)
            pf.phases.append(PhasePrefetch(pf, weight, nbytes, layer, point, matrix))
    pf.attach()
    pf.compile()
    return pf


def _apply(build: EngineParts, knobs: Mapping[str, Any]) -> None:
    pf = install(build.target.model, **knobs)  # the knobs are install's keyword arguments
    build.notes.append(
        f"l2-prefetch: {len(pf.phases)} prefetches per forward, {pf.prefetch_bytes / MiB:.0f} MiB "
        f"in all ({pf.spec.instruction}, {pf.spec.programs} programs, "
        f"{'side' if pf.side is not None else 'same'} stream)"
    )


MEASURED_LOSSES = {
    "H200": (
        "bench/l2_prefetch_gpu.py, 2026-12-01: every micro variant 0.3-2.3 us slower per "
        "segment (predicted 0.5-2 us faster), AR decode of the 8B shape x0.86-0.95; a read after "
        "a prefetch was slower than a cold one"
    ),
}
"""GPUs (by a substring of the CUDA device name) on which the mechanism was measured to lose,
with the measurement: the tuner does not try it there (``_screen``)."""


def _screen(config: ConfigView) -> str | None:
    """A reason not to try it on this deployment's GPU (a measured loss), or None."""
    dev = config.deployment.device
    if not torch.cuda.is_available() or not (dev == "auto" or dev.startswith("cuda")):
        return None
    name = torch.cuda.get_device_name(dev if dev.startswith("cuda") else None)
    for gpu, why in MEASURED_LOSSES.items():
        if gpu in name:
            return f"measured slower on this GPU ({name}): {why}"
    return None


MECHANISM = Mechanism(
    name="l2-prefetch",
    component="mlp",
    plug_point="layer_phases",
    lossless=(
        "A prefetch is a cache hint: the kernel only issues prefetch.global.L2 / "
        "cp.async.bulk.prefetch.L2 on read-only weights and stores nothing; every kernel of the "
        "forward runs unchanged, in the same order on its stream (a side stream only adds "
        "dependencies), so every value is bit for bit the same. Argument in "
        "mechanisms/l2_prefetch.py."
    ),
    apply=_apply,
    knobs=(
        Knob(
            "phases",
            "all",
            choices=tuple(PHASE_SETS),
            doc="idle points that prefetch the next matrix: all, attention (-> o), norms "
            "(-> qkv, gate_up), attention+norms, mlp (post-attn norm -> gate_up, SiLU -> down)",
        ),
        Knob("mb", 8, low=1, high=48, doc="MiB of each next matrix to prefetch (capped by L2)"),
        Knob(
            "stream",
            "side",
            choices=("side", "same"),
            doc="prefetch on a side stream (forked at the phase, joined before the matrix) or "
            "on the step's stream just before the phase",
        ),
        Knob(
            "instruction",
            "auto",
            choices=("auto", "bulk", "line"),
            doc="cp.async.bulk.prefetch.L2 (sm_90+), prefetch.global.L2 per 128-byte line, or "
            "auto (bulk where the GPU has it)",
        ),
        Knob("programs", 8, low=1, high=64, doc="CTAs of each prefetch launch"),
    ),
    applies=Applicability(devices=("cuda",)),
    screen=_screen,
    summary="prefetch the head of the next matrix into L2 while the norms / attention run",
)

__all__ = [
    "MECHANISM",
    "NEXT_MATRIX",
    "PHASE_SETS",
    "L2Prefetch",
    "PhasePrefetch",
    "install",
    "installed",
    "l2_bytes",
    "resolve_instruction",
]
