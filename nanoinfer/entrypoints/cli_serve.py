"""`nanoinfer serve MODEL`: an OpenAI-compatible HTTP server, like `vllm serve`."""

from __future__ import annotations

import argparse
import logging
import os
import socket

from nanoinfer.entrypoints.engine_args import add_engine_args, engine_kwargs_from_args
from nanoinfer.entrypoints.http_limits import add_limit_args, limits_from_args

API_KEY_ENV = "NANOINFER_API_KEY"
# The choices of --tool-call-parser and --reasoning-parser (entrypoints/structured_requests.py's).
TOOL_CALL_PARSERS = ("hermes",)
REASONING_PARSERS = ("qwen3",)
# The server's, here so that --help does not import the server (and its web framework).
GRACEFUL_SHUTDOWN_TIMEOUT_S = 5.0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serves MODEL at /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.",
    )
    parser.add_argument("model", help="checkpoint directory (Hugging Face layout) or GGUF file")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    parser.add_argument("--port", type=_port, default=8000, help="port to bind (default: %(default)s)")
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
    parser.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the engine core in a process of its own, so that HTTP, tokenization and streaming never "
        "hold up its steps; --no-engine-process runs it on a thread of the server's process "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=_seconds,
        default=GRACEFUL_SHUTDOWN_TIMEOUT_S,
        metavar="SECONDS",
        help="after SIGINT/SIGTERM, how long in-flight requests may finish; those still open then end with "
        "an error (default: %(default)s)",
    )
    tools = parser.add_argument_group("tool calling and reasoning (vLLM's flags)")
    tools.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model decide whether to call tools (tool_choice "auto", the default when a request '
        "gives tools): calls are parsed out of its output; needs --tool-call-parser",
    )
    tools.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=None,
        help="the format of tool calls in the output: hermes is <tool_call>{...}</tool_call> (Qwen, Hermes)",
    )
    tools.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=None,
        help="split the reasoning off the answer into reasoning_content: qwen3 is <think>...</think>",
    )
    add_limit_args(parser)
    add_engine_args(parser)
    parser.set_defaults(func=_serve)


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 65535], got {text!r}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text!r}")
    return value


def check_port_is_free(host: str, port: int) -> None:
    """Binds ``host:port`` and lets it go again, the way uvicorn will bind it (SO_REUSEADDR, IPv6 for an
    address with a colon), so that a port already in use is an error before the model spends time
    loading rather than after. Raises SystemExit with a one-line message."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            reason = e.strerror or str(e)
            raise SystemExit(
                f"nanoinfer serve: error: cannot listen on {host}:{port}: {reason} "
                "(is another server running there? choose another --port)"
            ) from None


def _serve(args: argparse.Namespace) -> int:
    from nanoinfer.entrypoints.server import run_server

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise SystemExit("nanoinfer serve: error: --enable-auto-tool-choice needs --tool-call-parser")
    check_port_is_free(args.host, args.port)
    try:
        return run_server(
            args.model,
            host=args.host,
            port=args.port,
            api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
            served_model_names=args.served_model_name,
            limits=limits_from_args(args),
            log_level=args.log_level,
            engine_process=args.engine_process,
            shutdown_timeout_s=args.shutdown_timeout,
            enable_auto_tool_choice=args.enable_auto_tool_choice,
            tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser,
            **engine_kwargs_from_args(args),
        )
    except (FileNotFoundError, ValueError) as e:  # a bad model path, engine option or limit
        raise SystemExit(f"nanoinfer serve: error: {e}") from None
