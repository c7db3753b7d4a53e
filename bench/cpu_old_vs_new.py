"""The one engine against the drivers it replaced, on the CPU: AR and n-gram on SmolLM2, fp32.

    PYTHONPATH=src python3 bench/cpu_old_vs_new.py --ref 6d5009c --out DIR

``--ref`` is a commit of this repository that still has ``SpecEngine`` (before the one engine);
its ``src/specpilot`` is extracted to a temporary folder and imported as ``specpilot_old``, so
both run in one process on **the same weight tensors** (the old model's parameters are made to
point at the new model's: where a copy of 540 MB lives in memory moved throughput by ±5% here,
which would otherwise swamp the comparison). Arms: old AR, new AR, old n-gram, new n-gram, each
over the same prompts, interleaved in ``--rounds`` rounds after a warm-up; per-round ratios
new/old with their spread. Writes ``DIR/cpu_old_vs_new.json``; prints a short table last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def extract_old(ref: str, into: Path) -> None:
    """``git archive`` of ``ref``'s ``src/specpilot`` as package ``specpilot_old`` in ``into``."""
    tar = subprocess.run(
        ["git", "-C", str(ROOT), "archive", ref, "src/specpilot"], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=tar, check=True)
    pkg = into / "specpilot_old"
    (into / "src" / "specpilot").rename(pkg)
    for f in pkg.rglob("*.py"):
        text = f.read_text()
        text = re.sub(r"\bspecpilot\.", "specpilot_old.", text)
        f.write_text(text.replace("from specpilot import", "from specpilot_old import"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ref", default="6d5009c")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompts", default="copy-heavy")
    ap.add_argument("--limit", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp())
    extract_old(args.ref, tmp)
    sys.path.insert(0, str(tmp))

    import specpilot_old.runtime as old_rt  # type: ignore[import-not-found]
    from specpilot_old.drafters import NgramDrafter as OldNgram  # type: ignore[import-not-found]
    from specpilot_old.engine import SpecEngine  # type: ignore[import-not-found]

    from specpilot.bench.prompts import load_prompt_set
    from specpilot.bench.protocol import Sample, interleave, timed
    from specpilot.bench.records import git_rev
    from specpilot.drafters import NgramDrafter
    from specpilot.engine import Engine, generate
    from specpilot.runtime import load_model

    new = load_model("smollm2-135m")
    old = old_rt.load_model("smollm2-135m", with_tokenizer=False)
    params = dict(new.model.named_parameters())
    for name, p in old.model.named_parameters():  # one copy of the weights serves both
        p.data = params[name].data
    for lo, ln in zip(old.model.layers, new.model.layers, strict=True):
        lo.gemv = ln.gemv
    old.model.lm_head_in_out = new.model.lm_head_in_out
    old.model.lm_head = old.model.embed
    tok = new.tokenizer
    assert tok is not None
    eos = list(tok.eos_token_ids)
    prompts = [
        tok.apply_chat_template(p.messages) for p in load_prompt_set(args.prompts, args.limit)
    ]
    n = args.max_new_tokens
    ar_new, ng_new = Engine(new.model), Engine(new.model, NgramDrafter(k=8))
    ar_old, ng_old = SpecEngine(old.model), SpecEngine(old.model, OldNgram(k=8))

    def arm(run) -> Sample:  # type: ignore[no-untyped-def]
        def fn() -> tuple[int, list[list[int]]]:
            outs = [run(p) for p in prompts]
            return sum(map(len, outs)), outs

        return timed(torch.device("cpu"), fn)

    arms = {
        "old_ar": lambda: arm(lambda p: ar_old.generate([p], n, eos)[0].tokens),
        "new_ar": lambda: arm(lambda p: generate(ar_new, [p], n, eos)[0].tokens),
        "old_ngram": lambda: arm(lambda p: ng_old.generate([p], n, eos)[0].tokens),
        "new_ngram": lambda: arm(lambda p: generate(ng_new, [p], n, eos)[0].tokens),
    }
    m = interleave(arms, rounds=args.rounds, warmup=1)
    same = {
        kind: m.last(f"old_{kind}").payload == m.last(f"new_{kind}").payload
        for kind in ("ar", "ngram")
    }
    out = {
        "date": datetime.date.today().isoformat(),
        "commit": git_rev(),
        "old_ref": args.ref,
        "machine": {"cpu": platform.processor(), "threads": args.threads},
        "prompts": f"{args.prompts} x {len(prompts)}, {n} new tokens",
        "tok_s": {name: [s.tok_s for s in samples] for name, samples in m.samples.items()},
        "new_over_old": {
            kind: m.ratio(f"new_{kind}", f"old_{kind}").to_dict() for kind in ("ar", "ngram")
        },
        "identical_tokens": same,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cpu_old_vs_new.json").write_text(json.dumps(out, indent=1))
    print(f"{'arm':<10} tok/s (median of {args.rounds} rounds)")
    for name in arms:
        print(f"{name:<10} {m.tok_s(name):8.1f}")
    for kind in ("ar", "ngram"):
        r = m.ratio(f"new_{kind}", f"old_{kind}")
        print(f"{kind}: new/old {r.text()} ({r.verdict()}), identical tokens: {same[kind]}")


if __name__ == "__main__":
    main()
