"""Arguments and set-up shared by the commands that run an engine."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from specpilot.drafters import CHECKPOINT_DRAFTERS
from specpilot.engine import Engine
from specpilot.engine.build import EngineBuild, build_engine
from specpilot.engine.config import DeploymentSpec, EngineConfig
from specpilot.errors import SpecPilotError
from specpilot.runtime import (
    DEFAULT_MAX_CONTEXT,
    LoadedModel,
    dtype_name,
    parse_device,
    parse_dtype,
)

DEFAULT_TARGET = "smollm2-135m"


def add_engine_args(p: argparse.ArgumentParser, default_drafter: str = "ngram") -> None:
    g = p.add_argument_group("deployment")
    g.add_argument(
        "--engine",
        type=Path,
        default=None,
        help="engine config JSON (as written by tune); overrides the flags below",
    )
    g.add_argument(
        "--target",
        default=DEFAULT_TARGET,
        help="known model name, HF directory or .gguf file (default: %(default)s)",
    )
    g.add_argument(
        "--drafter",
        default=default_drafter,
        choices=["none", "ngram", "draft-model", "block", "dflash", "dflash2"],
        help="drafter kind (default: %(default)s; none = plain AR; block = a DFlash-shaped block "
        "drafter with seeded random weights, for timing under --simulate-acceptance; dflash, "
        "dflash2 = a learned block drafter from --draft-model DIR)",
    )
    g.add_argument(
        "--draft-model",
        default=None,
        help="model for --drafter draft-model (same tokenizer as the target), or the checkpoint "
        "directory of --drafter dflash|dflash2 (config.json + safetensors)",
    )
    g.add_argument(
        "-k",
        "--num-draft",
        dest="k",
        type=int,
        default=None,
        help="tokens drafted per cycle (default: 8 for ngram, 4 for draft-model)",
    )
    g.add_argument(
        "--ngram-max",
        type=int,
        default=3,
        help="longest suffix n-gram tried by the ngram drafter (default: %(default)s)",
    )
    g.add_argument(
        "--ngram-min",
        type=int,
        default=1,
        help="shortest suffix n-gram tried (default: %(default)s)",
    )
    g.add_argument(
        "--device", default="auto", help="cpu, cuda, cuda:N or auto (default: %(default)s)"
    )
    g.add_argument(
        "--dtype",
        default="fp32",
        help="fp32, bf16 or fp16 (default: %(default)s; fp32 is bit-exact versus AR)",
    )
    g.add_argument(
        "--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)"
    )
    g.add_argument(
        "--max-context",
        type=int,
        default=DEFAULT_MAX_CONTEXT,
        help="context cap in tokens (default: %(default)s)",
    )
    g.add_argument(
        "--simulate-acceptance",
        metavar="PROFILE",
        default=None,
        help="time a deployment whose real drafter is not at hand: the drafter runs for real, its "
        "proposals follow PROFILE ('tau=6.5,block=16' or 'rates=0.9,0.8,...'; block sets -k to "
        "block - 1); verification stays real and every figure says 'simulated acceptance'",
    )
    g.add_argument(
        "--no-gate",
        dest="gate",
        action="store_false",
        default=True,
        help="draft on every cycle (default: a request stops drafting while its drafts do not "
        "pay, and probes again later; lossless either way)",
    )
    g.add_argument(
        "--no-graphs",
        dest="graphs",
        action="store_false",
        default=None,
        help="run every step eagerly on CUDA (default: CUDA graphs on CUDA, eager on the CPU)",
    )


@dataclass(slots=True)
class Deployment:
    build: EngineBuild
    dtype: torch.dtype
    device: torch.device

    @property
    def target(self) -> LoadedModel:
        return self.build.target

    @property
    def drafter_name(self) -> str:
        return self.build.label

    def meta(self) -> dict[str, str]:
        return {
            "target": self.target.spec,
            "dtype": dtype_name(self.dtype),
            "device": str(self.device),
            "drafter": self.drafter_name,
            "runner": "cuda-graphs" if self.graphs else "eager",
        }

    @property
    def graphs(self) -> bool:
        g = self.build.graphs
        return self.device.type == "cuda" if g is None else g

    def engines(self) -> tuple[Engine, Engine]:
        """(stock AR engine, speculative engine) over the same target weights and runner."""
        return self.build.stock_engine(), self.build.engine()

    @property
    def eos_ids(self) -> tuple[int, ...]:
        tok = self.target.tokenizer
        return tok.eos_token_ids if tok is not None else self.target.model.cfg.eos_token_ids


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The engine config: ``--engine FILE`` if given, else one made from the flags."""
    sim = getattr(args, "simulate_acceptance", None)
    if getattr(args, "engine", None) is not None:
        config = EngineConfig.load(args.engine)
        if sim is not None:  # the flag wins over the file's profile
            dep = dataclasses.replace(config.deployment, simulate_acceptance=sim)
            config = dataclasses.replace(config, deployment=dep, k=_sim_k(sim, config.k))
        if not getattr(args, "gate", True):
            config = dataclasses.replace(config, gate={**(config.gate or {}), "enabled": False})
        return config
    k = args.k if args.k is not None else default_k(args.drafter, args.draft_model)
    if sim is not None:
        k = _sim_k(sim, args.k)
    knobs = {"max_n": args.ngram_max, "min_n": args.ngram_min} if args.drafter == "ngram" else {}
    dep = DeploymentSpec(
        target=args.target,
        drafter=args.drafter,
        draft_model=args.draft_model,
        dtype=args.dtype,
        device=args.device,
        mode=getattr(args, "mode", None) or "single",
        simulate_acceptance=sim,
    )
    gate = None if getattr(args, "gate", True) else {"enabled": False}
    return EngineConfig(deployment=dep, k=k, drafter_knobs=knobs, gate=gate)


DEFAULT_K = {"ngram": 8, "draft-model": 4, "block": 15}
"""Tokens drafted per cycle when ``-k`` is not given (block: DFlash's block of 16)."""


def default_k(drafter: str, draft_model: str | None) -> int:
    """Tokens drafted per cycle when ``-k`` is not given; a DFlash checkpoint's block less one."""
    if drafter in CHECKPOINT_DRAFTERS and draft_model is not None:
        from specpilot.loading.dflash import block_size_of

        return block_size_of(Path(draft_model)) - 1
    return DEFAULT_K.get(drafter, 8)


def _sim_k(profile: str, k: int | None) -> int:
    """The draft length a simulated-acceptance profile implies (``-k`` must agree with it)."""
    from specpilot.drafters.simulated import AcceptanceProfile

    try:
        pk = AcceptanceProfile.parse(profile).k
    except ValueError as e:
        raise SpecPilotError(f"--simulate-acceptance: {e}") from None
    if k is not None and k != pk:
        raise SpecPilotError(
            f"--simulate-acceptance '{profile}' drafts {pk} tokens per cycle but -k is {k}; "
            f"drop -k or give block={k + 1}."
        )
    return pk


def build_deployment(args: argparse.Namespace) -> Deployment:
    if args.threads:
        torch.set_num_threads(args.threads)
    config = config_from_args(args)
    build = build_engine(config, args.max_context, graphs=getattr(args, "graphs", None))
    dep = config.deployment
    return Deployment(build=build, dtype=parse_dtype(dep.dtype), device=parse_device(dep.device))
