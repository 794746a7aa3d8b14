"""The `nanoinfer` console script: one subcommand per module, each exposing ``register(subparsers)``."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

# Each module registers its subcommand(s) and sets ``func`` on its parser; heavy imports stay inside
# the handlers so that `nanoinfer --help` is instant.
_SUBCOMMAND_MODULES = (
    "nanoinfer.entrypoints.cli_generate",  # generate, chat
    "nanoinfer.entrypoints.cli_serve",  # serve
    "nanoinfer.entrypoints.cli_bench",  # bench throughput, bench serve
)


class SubcommandParser(argparse.ArgumentParser):
    """A subcommand's parser that reports its own errors with its own usage.

    argparse hands a subcommand's unrecognized arguments back to the top-level parser, whose error shows
    the top-level usage (``nanoinfer [-h] {generate,...}``), which says nothing about the subcommand's
    flags. This parser rejects them itself, and runs checks that involve several flags (``add_check``)
    the same way, so every mistake shows ``usage: nanoinfer SUBCOMMAND ...``.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._checks: list[Callable[[argparse.Namespace], None]] = []

    def add_check(self, check: Callable[[argparse.Namespace], None]) -> None:
        """``check(args)`` runs after parsing; a ValueError it raises becomes this parser's usage error."""
        self._checks.append(check)

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        for check in self._checks:
            try:
                check(namespace)
            except ValueError as e:
                self.error(str(e))
        return namespace, extras


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nanoinfer", description="nanoinfer: a compact LLM inference engine"
    )
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=SubcommandParser)
    for name in _SUBCOMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
