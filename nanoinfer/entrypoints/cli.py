"""The `nanoinfer` console script: one subcommand per module, each exposing ``register(subparsers)``."""

from __future__ import annotations

import argparse
import importlib
import sys

# Each module registers its subcommand(s) and sets ``func`` on its parser; heavy imports stay inside
# the handlers so that `nanoinfer --help` is instant.
_SUBCOMMAND_MODULES = (
    "nanoinfer.entrypoints.cli_generate",  # generate, chat
    "nanoinfer.entrypoints.cli_serve",  # serve
    "nanoinfer.entrypoints.cli_bench",  # bench throughput, bench serve
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nanoinfer", description="nanoinfer: a compact LLM inference engine"
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in _SUBCOMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
