"""Arguments and set-up shared by the commands that run an engine."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from specpilot.drafters.base import Drafter
from specpilot.engine import SpecEngine
from specpilot.runtime import (
    DEFAULT_MAX_CONTEXT,
    LoadedModel,
    build_drafter,
    dtype_name,
    load_model,
    parse_device,
    parse_dtype,
)

DEFAULT_TARGET = "smollm2-135m"


def add_engine_args(p: argparse.ArgumentParser, default_drafter: str = "ngram") -> None:
    g = p.add_argument_group("deployment")
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
    target: LoadedModel
    drafter: Drafter | None
    drafter_name: str
    dtype: torch.dtype
    device: torch.device

    def meta(self) -> dict[str, str]:
        return {
            "target": self.target.spec,
            "dtype": dtype_name(self.dtype),
            "device": str(self.device),
            "drafter": self.drafter_name,
        }

    def engines(self) -> tuple[SpecEngine, SpecEngine]:
        """(stock AR engine, speculative engine) over the same target weights."""
        return SpecEngine(self.target.model), SpecEngine(self.target.model, self.drafter)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        tok = self.target.tokenizer
        return tok.eos_token_ids if tok is not None else self.target.model.cfg.eos_token_ids


def build_deployment(args: argparse.Namespace) -> Deployment:
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype, device = parse_dtype(args.dtype), parse_device(args.device)
    target = load_model(args.target, dtype, device, args.max_context)
    draft = (
        load_model(args.draft_model, dtype, device, args.max_context) if args.draft_model else None
    )
    k = args.k if args.k is not None else (4 if args.drafter == "draft-model" else 8)
    knobs = {"max_n": args.ngram_max, "min_n": args.ngram_min} if args.drafter == "ngram" else {}
    drafter = build_drafter(args.drafter, target, k, draft, knobs)
    name = "none" if drafter is None else f"{args.drafter}(k={k})"
    return Deployment(target=target, drafter=drafter, drafter_name=name, dtype=dtype, device=device)
