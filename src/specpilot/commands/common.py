"""Arguments and set-up shared by the commands that run an engine."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from specpilot.commands.checks import MAX_K, Check, at_least, check_shared
from specpilot.drafters import CHECKPOINT_DRAFTERS
from specpilot.engine import Engine
from specpilot.engine.build import EngineBuild, build_engine
from specpilot.engine.config import DeploymentSpec, EngineConfig
from specpilot.errors import SpecPilotError
from specpilot.loading.fetch import check_model_spec
from specpilot.progress import QUIET, Progress
from specpilot.runtime import (
    DEFAULT_MAX_CONTEXT,
    LoadedModel,
    check_dtype_on_device,
    dtype_name,
    load_model,
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
        choices=["none", "ngram", "draft-model", "block", "dflash", "dflash2", "eagle3"],
        help="drafter kind (default: %(default)s; none = plain AR; block = a DFlash-shaped block "
        "drafter with seeded random weights, for timing under --simulate-acceptance; dflash, "
        "dflash2 = a learned block drafter from --draft-model DIR; eagle3 = an EAGLE-3 head from "
        "--draft-model DIR)",
    )
    g.add_argument(
        "--draft-model",
        default=None,
        help="model for --drafter draft-model (same tokenizer as the target), or the checkpoint "
        "directory of --drafter dflash|dflash2|eagle3 (config.json + safetensors)",
    )
    g.add_argument(
        "-k",
        "--num-draft",
        dest="k",
        type=int,
        default=None,
        help=f"tokens drafted per cycle, 0 to {MAX_K} (default: 8 for ngram, 4 for draft-model, "
        "15 for block; 0 drafts nothing: plain AR)",
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
        "block - 1; ',sibling=0.5': after a first-choice miss a tree's second choice is right "
        "with that probability); verification stays real and every figure says 'simulated "
        "acceptance'",
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


DEFAULT_K = {"ngram": 8, "draft-model": 4, "block": 15, "eagle3": 6}
"""Tokens drafted per cycle when ``-k`` is not given (block: DFlash's block of 16; eagle3:
EAGLE-3's chain of 7 steps, the verify's bonus being the seventh token)."""


def default_k(drafter: str, draft_model: str | None) -> int:
    """Tokens drafted per cycle when ``-k`` is not given; a DFlash checkpoint's block less one."""
    if drafter in ("dflash", "dflash2") and draft_model is not None:
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


def check_args(args: argparse.Namespace, module: ModuleType) -> list[str]:
    """Every check of ``args`` before anything is loaded (``commands/checks.py``): the shared
    options, the command's own (``module.check``), then the deployment (or the engine config a
    command reads), whose paths and models are checked last, unless the command says it loads
    no model for these arguments (``module.loads_model(args)`` false)."""
    check_shared(args)
    own: Check | None = getattr(module, "check", None)
    notes = [] if own is None else own(args)
    loads: Callable[[argparse.Namespace], bool] | None = getattr(module, "loads_model", None)
    if loads is not None and not loads(args):  # e.g. bench --mode serve: a server does
        return notes
    if hasattr(args, "drafter"):  # the deployment options of add_engine_args
        notes += check_deployment(args)
    elif isinstance(getattr(args, "engine", None), Path):  # compare: configs, no flags
        notes += check_engine_config(EngineConfig.load(args.engine), str(args.engine))
    return notes


def check_deployment(args: argparse.Namespace) -> list[str]:
    """Check the deployment options (and the ``--engine`` file) without loading anything;
    return notes for what is allowed but easy to misread (``-k 0`` is plain AR)."""
    if args.k is not None and args.k < 0:
        raise SpecPilotError(f"-k must be at least 0 (0 drafts nothing: plain AR), got {args.k}.")
    at_least(args, "ngram_min", 1)
    if args.ngram_max < args.ngram_min:
        raise SpecPilotError(
            f"--ngram-max ({args.ngram_max}) must be at least --ngram-min ({args.ngram_min})."
        )
    at_least(args, "max_context", 2)
    new = getattr(args, "max_new_tokens", None)
    if new is not None and new >= args.max_context:
        raise SpecPilotError(
            f"--max-new-tokens {new} does not fit --max-context {args.max_context} (the prompt "
            "needs room too); raise --max-context or lower --max-new-tokens."
        )
    config = config_from_args(args)
    return check_engine_config(config, None if args.engine is None else str(args.engine))


def check_engine_config(config: EngineConfig, source: str | None = None) -> list[str]:
    """What can be checked of an engine config before loading its models: k, the drafter, the
    model paths, dtype and device, and where each mechanism applies (all but the architecture).
    ``source``: the file it came from (the messages name it), None for command-line flags."""
    from specpilot.drafters import DRAFTERS
    from specpilot.mechanisms import MECHANISMS

    dep = config.deployment
    k_is = f"k = {config.k} in {source}" if source else f"-k {config.k}"
    if config.k > MAX_K:
        raise SpecPilotError(
            f"{k_is} is more than the {MAX_K} tokens a cycle may draft: every cycle verifies "
            "k + 1 tokens in one target forward and keeps 2·(k + 1) slots of context free, so a "
            f"larger k spends compute and context on drafts that are almost never accepted in "
            f"full; choose 1 to {MAX_K} (0 is plain AR)."
        )
    if dep.drafter not in ("none", *DRAFTERS):
        raise SpecPilotError(
            f"Unknown drafter '{dep.drafter}'"
            + (f" in {source}" if source else "")
            + f"; choose one of none, {', '.join(sorted(DRAFTERS))}."
        )
    check_model_spec(dep.target)
    from specpilot.drafters.shipped import shipped_drafter

    shipped = shipped_drafter(dep.target, dep.drafter) is not None  # needs no --draft-model
    if dep.draft_model is not None:
        try:
            check_model_spec(dep.draft_model)
        except SpecPilotError as e:
            raise SpecPilotError(f"The draft model: {e}") from None
    if (
        dep.drafter == "draft-model"
        and dep.draft_model is None
        and "exit_layers" not in config.drafter_knobs
    ):
        raise SpecPilotError(
            "The draft-model drafter needs --draft-model (a smaller model with the same tokenizer)."
        )
    if dep.drafter in CHECKPOINT_DRAFTERS and dep.draft_model is None and not shipped:
        raise SpecPilotError(
            f"The {dep.drafter} drafter needs --draft-model DIR, a {dep.drafter} checkpoint "
            "directory (config.json + safetensors)"
            + ("" if dep.drafter == "eagle3" else "; train one with specpilot train-drafter")
            + "."
        )
    drafts = dep.drafter != "none" and config.k > 0
    if dep.simulate_acceptance is not None and not drafts:
        raise SpecPilotError(
            "Simulated acceptance needs a drafter that drafts; choose one with --drafter."
        )
    dtype, device = parse_dtype(dep.dtype), parse_device(dep.device)
    check_dtype_on_device(dtype, device)
    drafter_name = dep.drafter if drafts else "none"
    for name in config.mechanisms:
        where = dataclasses.replace(MECHANISMS[name].applies, archs=())  # the arch: once loaded
        if not where.allows(device.type, dep.dtype, drafter_name, dep.mode, ""):
            raise SpecPilotError(
                f"Mechanism '{name}' does not apply to this deployment "
                f"({device.type}, {dep.dtype}, drafter {drafter_name}, {dep.mode})."
            )
    if dep.drafter != "none" and config.k == 0:
        return [f"{k_is} drafts nothing, so this runs plain AR decoding (as --drafter none does)."]
    return []


def build_deployment(args: argparse.Namespace, progress: Progress = QUIET) -> Deployment:
    """Load the target (reporting each phase to ``progress``), then build the engine from the
    composition root over it."""
    if args.threads:
        torch.set_num_threads(args.threads)
    config = config_from_args(args)
    dep = config.deployment
    dtype, device = parse_dtype(dep.dtype), parse_device(dep.device)
    target = load_model(dep.target, dtype, device, args.max_context, progress=progress)
    progress.phase(
        "building the engine"
        + (f" (loading the draft model {dep.draft_model})" if dep.draft_model else "")
    )
    build = build_engine(
        config, args.max_context, target=target, graphs=getattr(args, "graphs", None)
    )
    return Deployment(build=build, dtype=dtype, device=device)
