"""Timed runs of the static engine for the GPU benchmark scripts, and their lossless check."""

from __future__ import annotations

import argparse
import datetime
import platform
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specpilot.bench.records import git_rev
from specpilot.drafters.block_drafter import BlockDrafter
from specpilot.engine.loop import GenerationResult
from specpilot.engine.static_engine import StaticEngine
from specpilot.forcing import force_tokens
from specpilot.models.transformer import Transformer
from specpilot.synthetic import build_block_drafter, build_target, make_peaked


@dataclass(frozen=True, slots=True)
class SyntheticDeployment:
    """The seeded target and block drafter of the static-engine GPU benches."""

    target: Transformer
    block: BlockDrafter
    shape: str
    draft_shape: str

    def label(self) -> str:
        """``<shape> <dtype> · <draft shape>``, how each bench's label starts."""
        dtype = str(self.target.dtype).removeprefix("torch.")
        return f"{self.shape} {dtype} · {self.draft_shape}"


def synthetic_deployment(
    tiny: bool, seed: int, peaked: bool, max_positions: int
) -> SyntheticDeployment:
    """llama3-8b bf16 with a DFlash-b16-shaped block drafter on the GPU (``tiny``: the tiny
    fp32 shapes on the CPU); ``peaked``: ``synthetic.make_peaked`` on the target."""
    dev = torch.device("cpu" if tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if tiny else torch.bfloat16
    shape, dshape = ("tiny-llama", "tiny-block") if tiny else ("llama3-8b", "dflash-b16")
    target = build_target(shape, dev, dtype, seed=seed, max_positions=max_positions)
    if peaked:
        make_peaked(target)
    return SyntheticDeployment(target, build_block_drafter(target, dshape), shape, dshape)


def run_twice(
    engine: StaticEngine, prompts: list[list[int]], n: int, steady: bool = False
) -> tuple[list[GenerationResult], float]:
    """Warm-up (graph capture), then the timed run; returns its results and decode tok/s.

    ``steady``: time only the window in which every row decodes (until the first row is done),
    the throughput of a batch whose finished rows are replaced at once."""
    engine.generate(prompts, n, until_first_done=steady)
    res = engine.generate(prompts, n, until_first_done=steady)
    new = sum(len(r.tokens) - 1 for r in res)  # the first token comes from prefill
    return res, new / engine.times.wall


def check_rows(
    target: Transformer,
    prompts: Sequence[Sequence[int]],
    ref: Sequence[Sequence[int]],
    got: Sequence[Sequence[int]],
) -> dict[str, Any]:
    """Rows equal to (a prefix of) AR's; the others token-forced (near-ties counted)."""
    differ = [
        i for i, (a, b) in enumerate(zip(ref, got, strict=True)) if list(a[: len(b)]) != list(b)
    ]
    out: dict[str, Any] = {"rows": len(ref), "rows_equal_ar": len(ref) - len(differ)}
    if differ:
        report = force_tokens(target, [(str(i), prompts[i], got[i]) for i in differ])
        out.update(near_ties=report.near_ties, mismatches=report.mismatches, forcing=report.ok)
    else:
        out.update(near_ties=0, mismatches=0, forcing=True)
    return out


def add_simulation_options(ap: argparse.ArgumentParser) -> None:
    """``--steady`` and ``--peaked``: the two simulation fixes of the batched GPU benches."""
    ap.add_argument(
        "--steady",
        action="store_true",
        help="time the window in which every row decodes (until the first row is done)",
    )
    ap.add_argument(
        "--peaked",
        action="store_true",
        help="peaked random target (synthetic.make_peaked): clear top-1 margins, no bf16 near-ties",
    )


def simulation_label(args: argparse.Namespace) -> str:
    """What ``--peaked`` / ``--steady`` add to a run's label (empty when neither is on)."""
    return (" · peaked random target" if args.peaked else "") + (
        " · steady-state window (until the first row is done)" if args.steady else ""
    )


def run_header(label: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """The label, date, commit, machine and arguments every GPU bench JSON starts with."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine()
    return {
        "label": label,
        "date": datetime.date.today().isoformat(),
        "commit": git_rev(),
        "machine": {"device": name, "torch": torch.__version__},
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }
