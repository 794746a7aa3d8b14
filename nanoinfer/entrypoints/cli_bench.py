"""`nanoinfer bench {throughput,serve}`: offline engine throughput and online serving benchmarks."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    # Each benchmark module defines its own flags; the throughput one is the engine's own benchmark.
    from nanoinfer.benchmarks import serve, throughput
    from nanoinfer.entrypoints.cli import SubcommandParser

    bench = subparsers.add_parser("bench", help="benchmarks", description="Benchmarks.")
    kinds = bench.add_subparsers(dest="bench_command", required=True, parser_class=SubcommandParser)
    for name, module, help_text in (
        ("throughput", throughput, "offline throughput of the engine (no server)"),
        ("serve", serve, "latency and throughput of a running OpenAI-compatible server"),
    ):
        parser = kinds.add_parser(
            name,
            help=help_text,
            description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_args(parser)
        parser.set_defaults(func=module.run)
    kinds.choices["throughput"].add_check(throughput.check_workload_args)
