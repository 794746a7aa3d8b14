"""An OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of AsyncLLM.

Endpoints: POST /v1/completions, POST /v1/chat/completions (both streaming over server-sent events or
not), GET /v1/models, GET /v1/models/{id}, GET /health, GET /metrics (Prometheus), and vLLM's POST
/tokenize, POST /detokenize, GET /version, GET|POST /ping. Prompts are rendered and tokenized here, on
a worker thread of their own (never on the event loop), so that the engine only runs the model and no
request stalls the others. What one request may cost is bounded by :class:`ServerLimits`.

Fields a request leaves out take the model's default sampling parameters (``generation_config``). While
requests run, a log line every STATS_LOG_INTERVAL_S gives the throughput and the KV cache usage (vLLM's),
unless ``disable_log_stats``.

`run_server` runs the engine core in a process of its own by default (this process then does HTTP,
tokenization, detokenization and streaming), or on a thread of this one. Its life cycle: if the engine
stops by itself, every unfinished request fails (an error event in a stream, 503 otherwise), /health
answers 503 and the server exits with status 1; SIGINT/SIGTERM stop taking connections, let in-flight
requests finish for up to ``shutdown_timeout_s``, then end those still open with an error (never a
silently cut stream), stop the engine and exit with status 0.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import hmac
import inspect
import json
import logging
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

import nanoinfer
from nanoinfer.entrypoints import openai_protocol as protocol
from nanoinfer.entrypoints.http_limits import ServerLimits, header_timeout_protocol
from nanoinfer.entrypoints.openai_protocol import APIError, ChatCompletionRequest, CompletionRequest
from nanoinfer.entrypoints.structured_requests import (
    ChatOutputParser,
    ChatStreamParser,
    ToolOptions,
    constrain_after_reasoning,
    reasoning_token_ids,
    request_constraint,
)
from nanoinfer.frontend.async_llm import (
    AsyncLLM,
    EngineDeadError,
    InvalidRequestError,
    RequestFailedError,
    RequestStream,
)
from nanoinfer.frontend.input_processor import check_prompt_token_ids
from nanoinfer.heap import freeze_startup_heap
from nanoinfer.metrics import ServingMetrics
from nanoinfer.outputs import Logprob, PositionLogprobs, RequestOutput
from nanoinfer.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

# OpenAI's default for /v1/completions; chat requests default to the rest of the context instead.
DEFAULT_COMPLETION_MAX_TOKENS = 16
# After SIGINT/SIGTERM, in-flight requests may finish for this long; then those still open end with an error.
GRACEFUL_SHUTDOWN_TIMEOUT_S = 5.0
# How long after that uvicorn waits for them to send their last bytes before it cancels them.
SHUTDOWN_FINAL_SEND_S = 2.0
# Seconds between the periodic statistics log lines (vLLM's interval).
STATS_LOG_INTERVAL_S = 10.0


class OpenAIServer:
    """The FastAPI app (``.app``) serving one AsyncLLM under one or more model names."""

    def __init__(
        self,
        async_llm: AsyncLLM,
        served_model_names: list[str],
        api_key: str | None = None,
        limits: ServerLimits | None = None,
        tokenizer: Any = None,
        stats_log_interval_s: float = STATS_LOG_INTERVAL_S,
        tool_options: ToolOptions | None = None,
    ):
        if not served_model_names or not all(isinstance(n, str) and n for n in served_model_names):
            raise ValueError(f"served_model_names must be non-empty strings, got {served_model_names!r}")
        if api_key is not None and (not isinstance(api_key, str) or not api_key):
            raise ValueError("api_key must be a non-empty string or None")
        self.async_llm = async_llm
        self.served_model_names = list(served_model_names)
        # Compared as UTF-8 bytes with the header's raw bytes, so that a non-ASCII key works.
        self._api_key = api_key.encode() if api_key is not None else None
        self.limits = limits if limits is not None else ServerLimits()
        config = async_llm.config
        self.model_path = config.model
        self.max_model_len = config.max_model_len
        self.max_prompt_chars = self.limits.prompt_chars(config.max_model_len)
        self.vocab_size = config.hf_config.vocab_size
        # SamplingParams keywords for the fields a request leaves out.
        self.generation_defaults = dict(config.generation_defaults)
        if tokenizer is None:
            from nanoinfer.models.checkpoint import load_tokenizer

            # A tokenizer of our own: the engine thread uses the engine's concurrently.
            tokenizer = load_tokenizer(config.model, config.tokenizer, config.chat_template_text)
        self.tokenizer = tokenizer
        self.tool_options = tool_options if tool_options is not None else ToolOptions()
        # The tokenizer's added tokens (Qwen3's <tool_call>): a tool-call constraint names them as tokens.
        self._special_tokens = frozenset(
            t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()
        )
        self._think_token_ids = reasoning_token_ids(tokenizer) if self.tool_options.reasoning_parser else None
        # Arguments of apply_chat_template itself: chat_template_kwargs are template variables only.
        self._reserved_template_kwargs = set(inspect.signature(tokenizer.apply_chat_template).parameters)
        # One thread renders and tokenizes prompts, one request at a time: a fast tokenizer object is not
        # safe for concurrent calls, and its encode releases the GIL, so the event loop keeps running.
        self._tokenizer_thread = concurrent.futures.ThreadPoolExecutor(1, "nanoinfer-tokenizer")
        self.metrics = ServingMetrics(self.served_model_names[0])
        async_llm.stats_listener = self.metrics
        self.stats_log = (
            None if config.disable_log_stats else PeriodicStatsLog(async_llm, stats_log_interval_s)
        )
        self.app = self._build_app()

    def startup_lines(self) -> list[str]:
        """What the server logs when it starts: the model and how it runs (the engine itself logs the
        default sampling parameters)."""
        config = self.async_llm.config
        stats = self.async_llm.stats(timeout=30)
        blocks = stats.get("num_kv_blocks_total", 0)
        block_size = config.kvcache_block_size
        architectures = getattr(config.hf_config, "architectures", None) or ["?"]
        dtype = str(config.torch_dtype).removeprefix("torch.")
        return [
            f"model {config.model} ({architectures[0]}), dtype {dtype}, device {config.device}, "
            f"tensor parallel size {config.tensor_parallel_size}",
            f"context length {config.max_model_len} tokens; KV cache {blocks} blocks of {block_size} tokens "
            f"({blocks * block_size} tokens)",
            f"served model names: {', '.join(self.served_model_names)}",
        ]

    # -- app ------------------------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(_: FastAPI):
            task = asyncio.ensure_future(self.stats_log.run()) if self.stats_log is not None else None
            try:
                yield
            finally:
                if task is not None:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)

        app = FastAPI(title="nanoinfer", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
        if self.limits.allowed_hosts is not None:
            app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(self.limits.allowed_hosts))

        @app.exception_handler(APIError)
        async def api_error(_: Request, e: APIError) -> JSONResponse:
            return JSONResponse(e.body(), status_code=e.status_code)

        @app.exception_handler(StarletteHTTPException)
        async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
            body = protocol.error_body(str(e.detail), "invalid_request_error")
            return JSONResponse(body, status_code=e.status_code, headers=e.headers)

        @app.exception_handler(ClientDisconnect)
        async def client_left(request: Request, _: ClientDisconnect) -> Response:
            # Nobody reads the answer; one line, no traceback.
            logger.info("client %s disconnected while sending its request", _client_address(request))
            return Response(status_code=499)

        @app.exception_handler(Exception)
        async def internal_error(_: Request, e: Exception) -> JSONResponse:
            logger.exception("unhandled error while serving a request")
            return JSONResponse(protocol.error_body(f"internal server error: {e!r}", "server_error"), 500)

        @app.get("/health")
        async def health() -> Response:
            if self.async_llm.is_healthy:
                return JSONResponse({"status": "ok"})
            return JSONResponse(protocol.error_body(str(self.async_llm.error), "server_error"), 503)

        @app.get("/metrics")
        async def metrics() -> Response:
            self.metrics.update_engine_stats(await self.async_llm.get_stats())
            return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

        @app.api_route("/ping", methods=["GET", "POST"])
        async def ping() -> Response:
            return await health()

        @app.get("/version")
        async def version() -> JSONResponse:
            return JSONResponse({"version": nanoinfer.__version__})

        @app.get("/v1/models")
        async def models(request: Request) -> JSONResponse:
            self._authorize(request)
            cards = [
                protocol.model_card(n, self.model_path, self.max_model_len) for n in self.served_model_names
            ]
            return JSONResponse({"object": "list", "data": cards})

        # The openai client's models.retrieve; served names may hold slashes ("org/name", a path).
        @app.get("/v1/models/{model_id:path}")
        async def model(request: Request, model_id: str) -> JSONResponse:
            self._authorize(request)
            name = self._model_name(model_id)
            return JSONResponse(protocol.model_card(name, self.model_path, self.max_model_len))

        @app.post("/tokenize")
        async def tokenize(request: Request) -> JSONResponse:
            self._authorize(request)
            body = await self._read_body(request)
            chat = _has_key(body, "messages")
            model_cls = protocol.TokenizeChatRequest if chat else protocol.TokenizeCompletionRequest
            parsed = protocol.parse_body(model_cls, body)
            self._model_name(parsed.model)
            return JSONResponse(await self._on_tokenizer_thread(self._tokenize, parsed))

        @app.post("/detokenize")
        async def detokenize(request: Request) -> JSONResponse:
            self._authorize(request)
            parsed = protocol.parse_body(protocol.DetokenizeRequest, await self._read_body(request))
            self._model_name(parsed.model)
            bad = [t for t in parsed.tokens if not 0 <= t < self.vocab_size]
            if bad:
                raise APIError(f"tokens must be in [0, {self.vocab_size}); got {bad[:5]}", param="tokens")
            text = await self._on_tokenizer_thread(self.tokenizer.decode, parsed.tokens)
            return JSONResponse({"prompt": text})

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await self._generate(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request) -> Response:
            return await self._generate(request, chat=True)

        return app

    # -- request checks ---------------------------------------------------------------------------------

    def _authorize(self, request: Request) -> None:
        if self._api_key is None:
            return
        # Starlette decodes header bytes as latin-1; encoding back gives the bytes the client sent.
        header = request.headers.get("authorization", "").encode("latin-1")
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self._api_key):
            raise APIError(
                "missing or invalid API key: send it as 'Authorization: Bearer <key>'",
                status_code=401,
                code="invalid_api_key",
            )

    async def _read_body(self, request: Request) -> bytes:
        content_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if content_type != "application/json":
            raise APIError(
                f"the request body must be JSON, sent with 'Content-Type: application/json' (got "
                f"{content_type or 'no content type'!r})",
                status_code=415,
                code="unsupported_media_type",
            )
        try:
            return await asyncio.wait_for(self._receive_body(request), self.limits.body_timeout_s)
        except asyncio.TimeoutError:
            raise APIError(
                f"the request body did not arrive within {self.limits.body_timeout_s:g} s",
                status_code=408,
                code="request_timeout",
            ) from None

    async def _receive_body(self, request: Request) -> bytes:
        limit = self.limits.max_request_body_bytes
        too_large = APIError(
            f"the request body is larger than the limit of {limit} bytes",
            status_code=413,
            code="request_too_large",
        )
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_large
        chunks = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    def _model_name(self, requested: str | None) -> str:
        if requested is None:
            return self.served_model_names[0]
        if requested not in self.served_model_names:
            raise APIError(
                f"the model `{requested}` does not exist; this server serves {self.served_model_names}",
                status_code=404,
                param="model",
                code="model_not_found",
            )
        return requested

    def _check_limits(self, request: CompletionRequest | ChatCompletionRequest) -> None:
        """Rejects a request that asks for more work than the server's limits allow (before any of it)."""
        limits = self.limits
        stop = [request.stop] if isinstance(request.stop, str) else request.stop or []
        if len(stop) > limits.max_stop_strings:
            raise APIError(
                f"stop has {len(stop)} entries; at most {limits.max_stop_strings} are allowed", param="stop"
            )
        longest = max(map(len, stop), default=0)
        if longest > limits.max_stop_string_chars:
            raise APIError(
                f"stop strings may be at most {limits.max_stop_string_chars} characters, got one of "
                f"{longest}",
                param="stop",
            )
        n = request.n or 1
        if n > limits.max_n:
            raise APIError(f"n must be at most {limits.max_n}, got {n}", param="n")
        num_prompts = len(request.prompts()) if isinstance(request, CompletionRequest) else 1
        if num_prompts * n > limits.max_sequences_per_request:
            raise APIError(
                f"this request asks for {num_prompts} prompts x n={n} = {num_prompts * n} completions; at "
                f"most {limits.max_sequences_per_request} are allowed per request",
                param="n" if num_prompts == 1 else "prompt",
            )
        self._check_template_kwargs(getattr(request, "chat_template_kwargs", None))

    def _check_template_kwargs(self, kwargs: dict | None) -> None:
        kwargs = kwargs or {}
        if "chat_template" in kwargs and not self.limits.trust_request_chat_template:
            raise APIError(
                "chat_template_kwargs.chat_template is not allowed: this server does not run templates sent "
                "by clients (start it with --trust-request-chat-template to allow them)",
                param="chat_template_kwargs",
            )
        reserved = sorted((set(kwargs) & self._reserved_template_kwargs) - {"chat_template"})
        if reserved:
            raise APIError(
                f"chat_template_kwargs may only hold template variables; {reserved} are not allowed",
                param="chat_template_kwargs",
            )

    def _check_prompt_chars(self, text: str, field: str) -> None:
        if len(text) > self.max_prompt_chars:
            raise APIError(
                f"the prompt is {len(text)} characters long; this server accepts at most "
                f"{self.max_prompt_chars} (the context is {self.max_model_len} tokens)",
                param=field,
                code="context_length_exceeded",
            )

    def _render_chat(self, request: ChatCompletionRequest | protocol.TokenizeChatRequest) -> str:
        """The prompt text the chat template makes of the request's messages. Runs on the tokenizer
        thread."""
        messages = [m.template_input() for m in request.messages]
        self._check_prompt_chars("".join(m["content"] for m in messages), "messages")
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tools=request.tools or None,
                tokenize=False,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                **(request.chat_template_kwargs or {}),
            )
        except Exception as e:  # a template error, or chat_template_kwargs it cannot take
            raise APIError(f"cannot apply the chat template: {e}", param="messages") from e
        self._check_prompt_chars(text, "messages")
        return text

    def _tokenize(self, request: protocol.TokenizeCompletionRequest | protocol.TokenizeChatRequest) -> dict:
        """vLLM's /tokenize answer. Runs on the tokenizer thread."""
        if isinstance(request, protocol.TokenizeChatRequest):
            self._check_template_kwargs(request.chat_template_kwargs)
            text = self._render_chat(request)
        else:
            text = request.prompt
            self._check_prompt_chars(text, "prompt")
        ids = self.tokenizer.encode(text, add_special_tokens=request.add_special_tokens)
        token_strs = self.tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
        return protocol.tokenize_response(ids, self.max_model_len, token_strs)

    def _prompt_token_ids(
        self, request: CompletionRequest | ChatCompletionRequest
    ) -> tuple[list[list[int]], str | None]:
        """Renders (chat) and tokenizes the request's prompts; also returns a chat prompt's text. Runs on
        the tokenizer thread."""
        if isinstance(request, ChatCompletionRequest):
            # The template already contains every special token the model expects.
            text = self._render_chat(request)
            return [self.tokenizer.encode(text, add_special_tokens=False)], text
        prompts = request.prompts()
        for p in prompts:
            if isinstance(p, str):
                self._check_prompt_chars(p, "prompt")
            else:
                # Here, before echo decodes them (the input processor checks them again).
                try:
                    check_prompt_token_ids(p, self.vocab_size)
                except ValueError as e:
                    raise APIError(str(e), param="prompt") from None
        # Text is tokenized exactly as LLMEngine.add_request tokenizes it.
        return [self.tokenizer.encode(p) if isinstance(p, str) else p for p in prompts], None

    async def _on_tokenizer_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, fn, *args)

    def _sampling_params(
        self, request: CompletionRequest | ChatCompletionRequest, num_prompt_tokens: int
    ) -> SamplingParams:
        limit = self.max_model_len
        prompt_field = "messages" if isinstance(request, ChatCompletionRequest) else "prompt"
        if num_prompt_tokens >= limit:
            raise APIError(
                f"this model's maximum context length is {limit} tokens, but the prompt has "
                f"{num_prompt_tokens} tokens, leaving no room to generate",
                param=prompt_field,
                code="context_length_exceeded",
            )
        max_tokens = request.requested_max_tokens()
        if max_tokens is None and "max_tokens" in self.generation_defaults:
            max_tokens = min(self.generation_defaults["max_tokens"], limit - num_prompt_tokens)
        if max_tokens is None:
            max_tokens = (
                DEFAULT_COMPLETION_MAX_TOKENS if prompt_field == "prompt" else limit - num_prompt_tokens
            )
        if num_prompt_tokens + max_tokens > limit:
            raise APIError(
                f"this model's maximum context length is {limit} tokens, but "
                f"{num_prompt_tokens + max_tokens} were requested ({num_prompt_tokens} in the prompt, "
                f"{max_tokens} to generate); "
                "shorten the prompt or lower max_tokens",
                param="max_tokens",
                code="context_length_exceeded",
            )
        params = request.sampling_params(max_tokens, self.generation_defaults)
        if isinstance(request, CompletionRequest) and request.echo and params.logprobs is not None:
            # Echoed logprobs cover the prompt too.
            params = dataclasses.replace(params, prompt_logprobs=params.logprobs)
        return params

    def _decode_token(self, token_id: int, logprob: Logprob | None) -> str:
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return self.tokenizer.decode([token_id])

    def _echo_texts(self, request: CompletionRequest, prompts: list[list[int]]) -> list[str]:
        """The prompts as echo returns them: the text sent, or the token ids decoded. Runs on the
        tokenizer thread."""
        return [
            p if isinstance(p, str) else self.tokenizer.decode(ids)
            for p, ids in zip(request.prompts(), prompts, strict=True)
        ]

    # -- generation -------------------------------------------------------------------------------------

    async def _generate(self, raw_request: Request, chat: bool) -> Response:
        self._authorize(raw_request)
        body = await self._read_body(raw_request)
        request = protocol.parse_request(ChatCompletionRequest if chat else CompletionRequest, body)
        model = self._model_name(request.model)
        if not self.async_llm.is_healthy:
            raise APIError(f"the engine is not running: {self.async_llm.error}", status_code=503)
        self._check_limits(request)
        constraint = request_constraint(request, self._special_tokens)
        prompts, chat_text = await self._on_tokenizer_thread(self._prompt_token_ids, request)
        parser = ChatOutputParser(request, self.tool_options, chat_text) if chat else None
        if parser is not None and parser.reasoning is not None:
            constraint = constrain_after_reasoning(constraint, self._think_token_ids, chat_text)
        echo = None
        if not chat and request.echo:
            echo = _Echo(prompts, await self._on_tokenizer_thread(self._echo_texts, request, prompts))
        # A stream consumes each step's new text only; a whole response, the final output only.
        kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
        params = [
            dataclasses.replace(
                self._sampling_params(request, len(ids)), output_kind=kind, structured_outputs=constraint
            )
            for ids in prompts
        ]
        response_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        streams = await self._add_requests(response_id, prompts, params, request)
        reply = _Reply(
            response_id, model, chat, [len(p) for p in prompts], params[0], self._decode_token, echo, parser
        )
        if request.stream:
            events = reply.stream_events(
                streams, request.include_usage_in_stream, request.continuous_usage_in_stream
            )
            return _EventStreamResponse(events, streams)
        try:
            constraint_field = _constraint_field(request) if constraint is not None else None
            finals = await _unless_disconnected(
                raw_request, _collect_final_outputs(streams, constraint_field)
            )
        finally:
            # Also covers cancellation before the collecting coroutine ever ran.
            for stream in streams:
                stream.abort()
        if finals is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        return JSONResponse(reply.full_response(finals))

    async def _add_requests(
        self,
        response_id: str,
        prompts: list[list[int]],
        params: list[SamplingParams],
        request: CompletionRequest | ChatCompletionRequest,
    ) -> list[RequestStream]:
        """Adds one engine request per prompt; on any failure aborts those already added. The engine's
        errors start with the name of what is wrong: a request field, or else the prompt."""
        streams: list[RequestStream] = []
        try:
            for i, (token_ids, sampling_params) in enumerate(zip(prompts, params, strict=True)):
                stream = await self.async_llm.add_request(
                    f"{response_id}-{i}", {"prompt_token_ids": token_ids}, sampling_params
                )
                streams.append(stream)
        except BaseException as e:
            for stream in streams:
                stream.abort()
            if isinstance(e, ValueError):
                named = str(e).split(" ", 1)[0]
                prompt_field = "messages" if isinstance(request, ChatCompletionRequest) else "prompt"
                param = named if named in type(request).model_fields else prompt_field
                if named.startswith("structured_outputs."):
                    param = _constraint_field(request)
                raise APIError(str(e), param=param) from e
            if isinstance(e, EngineDeadError):
                raise APIError(str(e), status_code=503) from e
            raise
        return streams


@dataclasses.dataclass
class _Echo:
    """/v1/completions' echo: per prompt, its token ids and its text, put before each completion."""

    prompt_token_ids: list[list[int]]
    texts: list[str]


class _Reply:
    """Builds one request's response bodies (whole or streamed) from its engine outputs."""

    def __init__(
        self,
        response_id: str,
        model: str,
        chat: bool,
        prompt_lengths: list[int],
        params: SamplingParams,
        decode: protocol.TokenDecoder,
        echo: _Echo | None = None,
        parser: ChatOutputParser | None = None,
    ):
        self.response_id = response_id
        self.model = model
        self.chat = chat
        self.created = int(time.time())
        self.num_prompt_tokens = sum(prompt_lengths)
        self.num_prompts = len(prompt_lengths)
        self.num_choices = params.n
        self.num_top_logprobs = params.logprobs
        self.decode = decode
        self.echo = echo
        # Chat only, when reasoning or tool calls are split out of the text.
        self.parser = parser if parser is not None and parser.active else None

    def _choice_index(self, prompt_index: int, completion_index: int) -> int:
        return prompt_index * self.num_choices + completion_index

    def _logprobs(self, token_ids: list[int], logprobs: list | None, text_offset: int) -> dict | None:
        """The logprobs of these tokens, in the endpoint's format."""
        if self.num_top_logprobs is None or logprobs is None:
            return None
        if self.chat:
            return protocol.chat_logprobs(token_ids, logprobs, self.decode, self.num_top_logprobs)
        return protocol.completion_logprobs(token_ids, logprobs, self.decode, text_offset)

    def _with_echo(
        self, prompt_index: int, output: RequestOutput, text: str, token_ids: list[int], logprobs: list | None
    ) -> tuple[str, list[int], list[PositionLogprobs | None] | None]:
        """A choice's text, tokens and logprobs with the prompt's before them (echo)."""
        prompt_ids = self.echo.prompt_token_ids[prompt_index]
        prompt_logprobs = output.prompt_logprobs
        if logprobs is not None and prompt_logprobs is not None:
            logprobs = list(prompt_logprobs) + list(logprobs)
        return self.echo.texts[prompt_index] + text, prompt_ids + token_ids, logprobs

    def full_response(self, finals: dict[int, RequestOutput]) -> dict[str, Any]:
        choices = []
        num_generated = 0
        build = protocol.chat_choice if self.chat else protocol.completion_choice
        for prompt_index in sorted(finals):
            for c in finals[prompt_index].outputs:
                index = self._choice_index(prompt_index, c.index)
                text, token_ids, logprobs = c.text, c.token_ids, c.logprobs
                if self.echo is not None:
                    text, token_ids, logprobs = self._with_echo(
                        prompt_index, finals[prompt_index], text, token_ids, logprobs
                    )
                finish_reason, message = c.finish_reason, None
                if self.parser is not None:
                    message, finish_reason = self.parser.message(text, finish_reason)
                logprobs_body = self._logprobs(token_ids, logprobs, 0)
                if message is not None:
                    choices.append(build(index, text, finish_reason, logprobs_body, message))
                else:
                    choices.append(build(index, text, finish_reason, logprobs_body))
                num_generated += len(c.token_ids)
        object_type = "chat.completion" if self.chat else "text_completion"
        usage = protocol.usage(self.num_prompt_tokens, num_generated)
        return protocol.response_body(object_type, self.response_id, self.created, self.model, choices, usage)

    def _usage(self, num_generated: int) -> dict[str, int]:
        return protocol.usage(self.num_prompt_tokens, num_generated)

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> str:
        object_type = "chat.completion.chunk" if self.chat else "text_completion"
        return protocol.sse_event(
            protocol.response_body(object_type, self.response_id, self.created, self.model, choices, usage)
        )

    async def stream_events(
        self, streams: list[RequestStream], include_usage: bool, continuous_usage: bool = False
    ) -> AsyncIterator[bytes]:
        """The SSE events of a streamed response, from the requests' DELTA outputs: one event per engine
        step with every choice that has new text (all of it, however many tokens the step made), and with
        ``continuous_usage`` the usage so far in each. Closing this generator aborts unfinished requests."""
        num_generated: dict[int, int] = {}
        # Per choice: tokens (with logprobs) not yet sent because they do not complete a character yet,
        # and (legacy logprobs) the text offset reached.
        unsent: dict[int, tuple[list[int], list]] = {}
        text_offsets: dict[int, int] = {}
        echoed: set[int] = set()  # choices whose first chunk (with the echoed prompt) went out
        parsers: dict[int, ChatStreamParser] = {}
        try:
            if self.chat:
                # OpenAI opens each chat choice with the role before any content.
                role_delta = {"role": "assistant", "content": ""}
                roles = [
                    protocol.chat_chunk_choice(self._choice_index(p, c), role_delta, None)
                    for p in range(self.num_prompts)
                    for c in range(self.num_choices)
                ]
                yield self._chunk(roles, self._usage(0) if continuous_usage else None)
            async with contextlib.aclosing(_merge_streams(streams)) as outputs:
                async for prompt_index, output in outputs:
                    choices = []
                    for c in output.outputs:
                        index = self._choice_index(prompt_index, c.index)
                        num_generated[index] = num_generated.get(index, 0) + len(c.token_ids)
                        token_ids, logprobs = unsent.pop(index, ([], []))
                        token_ids, logprobs = token_ids + c.token_ids, logprobs + (c.logprobs or [])
                        text = c.text
                        if self.echo is not None and index not in echoed:
                            echoed.add(index)
                            text, token_ids, logprobs = self._with_echo(
                                prompt_index, output, text, token_ids, logprobs
                            )
                        if not text and c.finish_reason is None:
                            unsent[index] = (token_ids, logprobs)
                            continue
                        choice_logprobs = self._logprobs(token_ids, logprobs, text_offsets.get(index, 0))
                        if choice_logprobs is not None and not self.chat and choice_logprobs["tokens"]:
                            last = choice_logprobs["text_offset"][-1] + len(choice_logprobs["tokens"][-1])
                            text_offsets[index] = last
                        if self.chat:
                            finish_reason = c.finish_reason
                            if self.parser is None:
                                delta = {"content": text} if text else {}
                            else:
                                stream_parser = parsers.get(index)
                                if stream_parser is None:
                                    stream_parser = parsers[index] = self.parser.stream()
                                deltas = stream_parser.feed(text) if text else []
                                if finish_reason is not None:
                                    deltas += stream_parser.finish()
                                    if finish_reason == "stop" and stream_parser.tools_called:
                                        finish_reason = "tool_calls"
                                delta = _merge_deltas(deltas)
                                if not delta and finish_reason is None and choice_logprobs is None:
                                    continue  # held back by the parser (a possible tag)
                            choices.append(
                                protocol.chat_chunk_choice(index, delta, finish_reason, choice_logprobs)
                            )
                        else:
                            choices.append(
                                protocol.completion_choice(index, text, c.finish_reason, choice_logprobs)
                            )
                    if choices:
                        usage = self._usage(sum(num_generated.values())) if continuous_usage else None
                        yield self._chunk(choices, usage)
            if include_usage:
                yield self._chunk([], self._usage(sum(num_generated.values())))
        except InvalidRequestError as e:
            yield protocol.sse_event(protocol.error_body(str(e), "invalid_request_error"))
        except (EngineDeadError, RequestFailedError, ValueError) as e:
            yield protocol.sse_event(protocol.error_body(str(e), "server_error"))
        yield protocol.SSE_DONE


def _merge_deltas(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """One step's parser deltas as one chunk's delta: text fields joined, tool-call entries in order
    (the client merges entries of the same call index)."""
    merged: dict[str, Any] = {}
    for delta in deltas:
        for key, value in delta.items():
            if key == "tool_calls":
                merged.setdefault("tool_calls", []).extend(value)
            else:
                merged[key] = merged.get(key, "") + value
    return merged


def _constraint_field(request: CompletionRequest | ChatCompletionRequest) -> str:
    """The request field that carried the output constraint (for a 400's ``param``)."""
    for name in ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                 "guided_grammar"):  # fmt: skip
        if getattr(request, name, None) is not None:
            return name
    return "tool_choice" if getattr(request, "tools", None) else "structured_outputs"


async def _merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream index, output) pairs from several streams as they arrive; aborts them all when closed."""
    if len(streams) == 1:  # the common case, without a pump task and a second queue hop per output
        try:
            async for output in streams[0]:
                yield 0, output
        finally:
            streams[0].abort()
        return
    merged: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                merged.put_nowait((index, output))
        except Exception as e:
            merged.put_nowait((index, e))
            return
        merged.put_nowait((index, end))

    pumps = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, item = await merged.get()
            if item is end:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in pumps:
            task.cancel()
        for stream in streams:
            stream.abort()


async def _collect_final_outputs(
    streams: list[RequestStream], constraint_field: str | None = None
) -> dict[int, RequestOutput]:
    """The streams' final outputs; a request that failed for its input (``InvalidRequestError``) is a
    400 naming ``constraint_field``, one that failed otherwise a 500."""
    finals = {}
    try:
        async with contextlib.aclosing(_merge_streams(streams)) as outputs:
            async for index, output in outputs:
                if output.finished:
                    finals[index] = output
    except EngineDeadError as e:
        raise APIError(str(e), status_code=503) from e
    except InvalidRequestError as e:
        raise APIError(str(e), param=constraint_field) from e
    except RequestFailedError as e:
        raise APIError(str(e), status_code=500) from e
    return finals


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Awaits ``work``, cancelling it (which aborts its requests) if the client disconnects first.

    Returns None after a disconnect. The request body must already be read.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        task.cancel()  # no-op when it finished; otherwise we were cancelled or the client left
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        return None
    return task.result()


class _EventStreamResponse(StreamingResponse):
    """Server-sent events that stop as soon as the client disconnects, even while no event is due.

    Starlette notices a disconnect only on some ASGI versions or at the next send; here a watcher task
    cancels the stream at once and closing the events generator aborts the requests behind it.
    """

    def __init__(self, events: AsyncIterator[bytes], streams: list[RequestStream]):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._streams = streams

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streaming = asyncio.ensure_future(self.stream_response(send))
        watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
        try:
            await asyncio.wait({streaming, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            streaming.cancel()
            watcher.cancel()
            await asyncio.gather(streaming, watcher, return_exceptions=True)
            await self.body_iterator.aclose()
            # Also covers a disconnect before the events generator ever ran.
            for stream in self._streams:
                stream.abort()
        if not streaming.cancelled() and streaming.exception() is not None:
            logger.warning("streaming a response failed: %r", streaming.exception())


class PeriodicStatsLog:
    """vLLM's periodic statistics line, every ``interval_s`` while requests run or tokens moved: prompt
    and generation throughput over the interval, running and waiting requests, KV cache usage and the
    prefix cache hit rate. The stats come from AsyncLLM.get_stats() on the event loop."""

    def __init__(self, async_llm: AsyncLLM, interval_s: float = STATS_LOG_INTERVAL_S):
        if not interval_s > 0:
            raise ValueError(f"stats_log_interval_s must be > 0, got {interval_s!r}")
        self.async_llm = async_llm
        self.interval_s = interval_s
        self._last: tuple[float, dict[str, int]] | None = None

    def line(self, stats: dict[str, int], now: float) -> str | None:
        """The line for ``stats`` taken at ``now`` (time.monotonic()), against the previous call's; None
        while the engine is idle (nothing running or waiting, no tokens since the previous call)."""
        last, self._last = self._last, (now, dict(stats))
        if last is None:
            return None
        then, before = last

        def moved(key: str) -> int:
            return stats.get(key, 0) - before.get(key, 0)

        prompt_tokens, generated = moved("num_prompt_tokens_computed"), moved("num_generated_tokens")
        running, waiting = stats.get("num_running", 0), stats.get("num_waiting", 0)
        if not (running or waiting or prompt_tokens or generated):
            return None
        elapsed = max(now - then, 1e-9)
        total = stats.get("num_kv_blocks_total", 0)
        usage = 1.0 - stats.get("num_kv_blocks_free", 0) / total if total else 0.0
        queried, hits = moved("prefix_cache_queried_tokens"), moved("prefix_cache_hit_tokens")
        hit_rate = hits / queried if queried > 0 else 0.0
        return (
            f"Avg prompt throughput: {prompt_tokens / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {generated / elapsed:.1f} tokens/s, "
            f"Running: {running} reqs, Waiting: {waiting} reqs, KV cache usage: {100 * usage:.1f}%, "
            f"Prefix cache hit rate: {100 * hit_rate:.1f}%"
        )

    async def log_once(self) -> str | None:
        line = self.line(await self.async_llm.get_stats(), time.monotonic())
        if line is not None:
            logger.info("%s", line)
        return line

    async def run(self) -> None:
        """Logs until cancelled (the server's lifespan runs it)."""
        await self.log_once()  # the baseline
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.log_once()
            except EngineDeadError:
                return


def _has_key(body: bytes, key: str) -> bool:
    """Whether the JSON body is an object with ``key`` (False for anything that does not parse: the
    request model then reports what is wrong)."""
    try:
        value = json.loads(body)
    except ValueError:
        return False
    return isinstance(value, dict) and key in value


def _client_address(request: Request) -> str:
    client = request.client
    return f"{client.host}:{client.port}" if client else "?"


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, whose graceful shutdown (SIGINT, SIGTERM, should_exit) lets in-flight requests
    finish for ``drain_timeout_s`` seconds and then calls ``end_requests`` (on a worker thread), which
    ends those still open with an error of their own. Only requests that still have not ended when
    uvicorn's ``timeout_graceful_shutdown`` (set longer) is over are cancelled, which cuts a stream short."""

    def __init__(self, config: uvicorn.Config, drain_timeout_s: float, end_requests: Callable[[], None]):
        super().__init__(config)
        self.drain_timeout_s = drain_timeout_s
        self.end_requests = end_requests

    async def shutdown(self, sockets: list | None = None) -> None:
        loop = asyncio.get_running_loop()

        def drain_timeout() -> None:
            logger.warning("ending the requests still open %g s into the shutdown", self.drain_timeout_s)
            loop.run_in_executor(None, self.end_requests)

        timer = loop.call_later(self.drain_timeout_s, drain_timeout)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


def run_server(
    model: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    served_model_names: list[str] | None = None,
    limits: ServerLimits | None = None,
    log_level: str = "info",
    engine_process: bool = True,
    shutdown_timeout_s: float = GRACEFUL_SHUTDOWN_TIMEOUT_S,
    enable_auto_tool_choice: bool = False,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    **engine_kwargs: Any,
) -> int:
    """Loads the model and serves it until SIGINT/SIGTERM (see the module's docstring); then stops the
    engine. ``engine_process``: the engine core runs in a process of its own (else on a thread of this
    one). Returns the exit status: 0 after a requested shutdown, 1 when the engine stopped by itself (a
    device error, a dead tensor-parallel worker, a killed engine process): then no request can be served,
    and the process must end rather than answer 503 forever."""
    if not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port must be an integer in [0, 65535], got {port!r}")
    if not isinstance(shutdown_timeout_s, int | float) or not 0 <= shutdown_timeout_s < float("inf"):
        raise ValueError(f"shutdown_timeout_s must be a finite number >= 0, got {shutdown_timeout_s!r}")
    limits = limits if limits is not None else ServerLimits()
    tool_options = ToolOptions(enable_auto_tool_choice, tool_call_parser, reasoning_parser)
    async_llm = AsyncLLM.from_kwargs(model, engine_process=engine_process, **engine_kwargs)
    try:
        server = OpenAIServer(
            async_llm, served_model_names or [model], api_key, limits, tool_options=tool_options
        )
        for line in server.startup_lines():
            logger.info("%s", line)
        config = uvicorn.Config(
            server.app,
            host=host,
            port=port,
            log_level=log_level,
            http=header_timeout_protocol(limits.header_timeout_s),
            timeout_graceful_shutdown=shutdown_timeout_s + SHUTDOWN_FINAL_SEND_S,
        )
        # Shutting the engine down fails every unfinished request with EngineDeadError: a stream then
        # ends with an error event, a whole response with 503.
        uv_server = _DrainingServer(config, shutdown_timeout_s, async_llm.shutdown)
        # Called on the engine's thread; uvicorn polls should_exit, so setting it from there is enough.
        async_llm.on_engine_dead(lambda _: setattr(uv_server, "should_exit", True))
        if threading.current_thread() is threading.main_thread():
            # uvicorn shuts down gracefully on SIGINT/SIGTERM and then raises the signal again with the
            # handlers found at start-up restored: these make that a plain return, so that a requested
            # shutdown exits with status 0 (the default handlers would end the process by the signal).
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: None)
        freeze_startup_heap()
        uv_server.run()
        if async_llm.crashed:
            logger.critical("exiting: %s", async_llm.error)
            return 1
        return 0
    finally:
        async_llm.shutdown()
