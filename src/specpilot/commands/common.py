"""Arguments and set-up shared by the commands that run an engine."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch

from specpilot.engine import SpecEngine
from specpilot.engine.build import EngineBuild, build_engine
from specpilot.engine.config import DeploymentSpec, EngineConfig
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
        choices=["none", "ngram", "draft-model"],
        help="drafter kind (default: %(default)s; none = plain AR)",
    )
    g.add_argument(
        "--draft-model",
        default=None,
        help="model for --drafter draft-model (same tokenizer as the target)",
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
        cfg = self.build.config
        if self.build.drafter is None:
            return "none"
        return f"{cfg.deployment.drafter}(k={cfg.k})"

    def meta(self) -> dict[str, str]:
        return {
            "target": self.target.spec,
            "dtype": dtype_name(self.dtype),
            "device": str(self.device),
            "drafter": self.drafter_name,
        }

    def engines(self) -> tuple[SpecEngine, SpecEngine]:
        """(stock AR engine, speculative engine) over the same target weights."""
        return self.build.stock_engine(), self.build.engine()

    @property
    def eos_ids(self) -> tuple[int, ...]:
        tok = self.target.tokenizer
        return tok.eos_token_ids if tok is not None else self.target.model.cfg.eos_token_ids


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The engine config: ``--engine FILE`` if given, else one made from the flags."""
    if getattr(args, "engine", None) is not None:
        return EngineConfig.load(args.engine)
    k = args.k if args.k is not None else (4 if args.drafter == "draft-model" else 8)
    knobs = {"max_n": args.ngram_max, "min_n": args.ngram_min} if args.drafter == "ngram" else {}
    dep = DeploymentSpec(
        target=args.target,
        drafter=args.drafter,
        draft_model=args.draft_model,
        dtype=args.dtype,
        device=args.device,
        mode=getattr(args, "mode", None) or "single",
    )
    return EngineConfig(deployment=dep, k=k, drafter_knobs=knobs)


def build_deployment(args: argparse.Namespace) -> Deployment:
    if args.threads:
        torch.set_num_threads(args.threads)
    config = config_from_args(args)
    build = build_engine(config, args.max_context)
    dep = config.deployment
    return Deployment(build=build, dtype=parse_dtype(dep.dtype), device=parse_device(dep.device))
