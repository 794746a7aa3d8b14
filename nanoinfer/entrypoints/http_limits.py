"""What one HTTP request may cost the server, and the guard against clients that send it slowly.

Every limit is an option of ``nanoinfer serve`` (``--max-stop-strings`` etc.); a request over one gets a
400 naming the field. The defaults follow OpenAI and vLLM where they have one.
"""

from __future__ import annotations

import argparse
import asyncio
import math
from dataclasses import dataclass

from uvicorn.protocols.http.h11_impl import H11Protocol

# A token is at least one byte of text for every tokenizer nanoinfer loads, and real text averages 3-5
# characters per token: a prompt longer than this many characters per token of context cannot fit, so it
# is rejected before it is tokenized.
PROMPT_CHARS_PER_CONTEXT_TOKEN = 32


def _check_positive(name: str, value: object, kind: type = int) -> None:
    ok = isinstance(value, int | float) if kind is float else isinstance(value, int)
    if not ok or isinstance(value, bool) or value <= 0 or (kind is float and not math.isfinite(value)):
        raise ValueError(f"{name} must be a positive {kind.__name__}, got {value!r}")


@dataclass(frozen=True)
class ServerLimits:
    max_request_body_bytes: int = 1 << 20
    max_stop_strings: int = 16  # OpenAI allows 4
    max_stop_string_chars: int = 256
    max_n: int = 128
    # Completions one request may start: prompts x n (a batch of prompts in /v1/completions).
    max_sequences_per_request: int = 256
    # The prompt text (or the chat prompt the template rendered) before tokenization; None:
    # PROMPT_CHARS_PER_CONTEXT_TOKEN x max_model_len.
    max_prompt_chars: int | None = None
    # A template in the request (chat_template_kwargs.chat_template) runs arbitrary, unbounded Jinja; like
    # vLLM's --trust-request-chat-template, off unless the operator trusts every client.
    trust_request_chat_template: bool = False
    # A client must send its request headers, and then its body, within these.
    header_timeout_s: float = 30.0
    body_timeout_s: float = 30.0
    # Host header values accepted (None: any), against DNS rebinding from a browser.
    allowed_hosts: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("max_request_body_bytes", "max_stop_strings", "max_stop_string_chars", "max_n"):
            _check_positive(name, getattr(self, name))
        _check_positive("max_sequences_per_request", self.max_sequences_per_request)
        if self.max_prompt_chars is not None:
            _check_positive("max_prompt_chars", self.max_prompt_chars)
        _check_positive("header_timeout_s", self.header_timeout_s, float)
        _check_positive("body_timeout_s", self.body_timeout_s, float)
        if not isinstance(self.trust_request_chat_template, bool):
            raise ValueError(
                f"trust_request_chat_template must be a bool, got {self.trust_request_chat_template!r}"
            )
        if self.allowed_hosts is not None and (
            not self.allowed_hosts or not all(isinstance(h, str) and h for h in self.allowed_hosts)
        ):
            raise ValueError(
                f"allowed_hosts must be None or non-empty host names, got {self.allowed_hosts!r}"
            )

    def prompt_chars(self, max_model_len: int) -> int:
        if self.max_prompt_chars is not None:
            return self.max_prompt_chars
        return PROMPT_CHARS_PER_CONTEXT_TOKEN * max_model_len


def http_protocol_base() -> type:
    """uvicorn's HTTP protocol: httptools' (a C parser, and responses written without h11's per-event
    state machine: the cost of every streamed event) when it is installed, h11's otherwise."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return H11Protocol
    return HttpToolsProtocol


def header_timeout_protocol(timeout_s: float, base: type | None = None) -> type:
    """uvicorn's HTTP protocol (``base``, default :func:`http_protocol_base`) with a deadline for each
    request's line and headers. uvicorn has none: a client that opens connections and never finishes its
    headers would hold them forever. Passed to uvicorn as ``Config(http=...)``."""

    class HeaderTimeoutProtocol(base or http_protocol_base()):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_deadline()

        def _arm_deadline(self) -> None:
            self._disarm_deadline()
            self._deadline = self.loop.call_later(timeout_s, self._deadline_passed)

        def _disarm_deadline(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _waiting_for_headers(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _deadline_passed(self) -> None:
            self._deadline = None
            if self._waiting_for_headers() and not self.transport.is_closing():
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if not self._waiting_for_headers():
                self._disarm_deadline()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self._waiting_for_headers():
                self._arm_deadline()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_deadline()
            super().connection_lost(exc)

    return HeaderTimeoutProtocol


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    """``nanoinfer serve``'s flags for :class:`ServerLimits` (defaults shown in --help)."""
    defaults = ServerLimits()
    group = parser.add_argument_group("request limits (a request over one gets a 400 naming the field)")
    group.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=defaults.max_request_body_bytes,
        help="larger request bodies get 413 (default: %(default)s)",
    )
    group.add_argument(
        "--max-stop-strings", type=int, default=defaults.max_stop_strings, help="(default: %(default)s)"
    )
    group.add_argument(
        "--max-stop-string-length",
        type=int,
        default=defaults.max_stop_string_chars,
        help="characters per stop string (default: %(default)s)",
    )
    group.add_argument("--max-n", type=int, default=defaults.max_n, help="(default: %(default)s)")
    group.add_argument(
        "--max-sequences-per-request",
        type=int,
        default=defaults.max_sequences_per_request,
        help="prompts x n of one request (default: %(default)s)",
    )
    group.add_argument(
        "--max-prompt-chars",
        type=int,
        default=None,
        help=f"prompt text, or rendered chat prompt, before tokenization (default: "
        f"{PROMPT_CHARS_PER_CONTEXT_TOKEN} x max_model_len)",
    )
    group.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let requests send their own chat template (chat_template_kwargs.chat_template); it runs "
        "unbounded template code, so only for trusted clients",
    )
    group.add_argument(
        "--header-timeout",
        type=float,
        default=defaults.header_timeout_s,
        help="seconds a client has to send its request headers (default: %(default)s)",
    )
    group.add_argument(
        "--body-timeout",
        type=float,
        default=defaults.body_timeout_s,
        help="seconds a client has to send its request body (default: %(default)s)",
    )
    group.add_argument(
        "--allowed-hosts",
        nargs="+",
        default=None,
        metavar="HOST",
        help="accept only these Host header values, e.g. localhost 127.0.0.1 (default: any)",
    )


def limits_from_args(args: argparse.Namespace) -> ServerLimits:
    return ServerLimits(
        max_request_body_bytes=args.max_request_body_bytes,
        max_stop_strings=args.max_stop_strings,
        max_stop_string_chars=args.max_stop_string_length,
        max_n=args.max_n,
        max_sequences_per_request=args.max_sequences_per_request,
        max_prompt_chars=args.max_prompt_chars,
        trust_request_chat_template=args.trust_request_chat_template,
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        allowed_hosts=tuple(args.allowed_hosts) if args.allowed_hosts else None,
    )
