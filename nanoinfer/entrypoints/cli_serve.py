"""`nanoinfer serve MODEL`: an OpenAI-compatible HTTP server, like `vllm serve`."""

from __future__ import annotations

import argparse
import logging
import os

from nanoinfer.entrypoints.engine_args import add_engine_args, engine_kwargs_from_args
from nanoinfer.entrypoints.http_limits import add_limit_args, limits_from_args

API_KEY_ENV = "NANOINFER_API_KEY"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serves MODEL at /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.",
    )
    parser.add_argument("model", help="checkpoint directory (Hugging Face layout) or GGUF file")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port to bind (default: %(default)s)")
    parser.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV} if set, else no key)",
    )
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="model name(s) clients use in requests; the first is reported in metrics (default: MODEL)",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="server log level (default: %(default)s)",
    )
    add_limit_args(parser)
    add_engine_args(parser)
    parser.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    from nanoinfer.entrypoints.server import run_server

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    return run_server(
        args.model,
        host=args.host,
        port=args.port,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        served_model_names=args.served_model_name,
        limits=limits_from_args(args),
        log_level=args.log_level,
        **engine_kwargs_from_args(args),
    )
