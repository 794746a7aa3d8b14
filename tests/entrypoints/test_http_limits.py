"""The header deadline on both of uvicorn's HTTP protocols (httptools when installed, h11 otherwise)."""

import socket
import time

import pytest
from uvicorn.protocols.http.h11_impl import H11Protocol

from nanoinfer.entrypoints.http_limits import header_timeout_protocol, http_protocol_base
from tests.entrypoints.test_server import uvicorn_in_thread

HEADER_TIMEOUT_S = 0.5


async def _app(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    for part in (b"one ", b"two"):  # streamed, in two chunks
        await send({"type": "http.response.body", "body": part, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def _bases():
    bases = [H11Protocol]
    if http_protocol_base() is not H11Protocol:
        bases.append(http_protocol_base())
    return bases


@pytest.fixture(params=_bases(), ids=lambda base: base.__name__)
def port(request):
    protocol = header_timeout_protocol(HEADER_TIMEOUT_S, request.param)
    with uvicorn_in_thread(_app, http=protocol) as url:
        yield int(url.rsplit(":", 1)[1])


def _read_all(sock: socket.socket, limit_s: float = 5.0) -> bytes:
    sock.settimeout(limit_s)
    chunks = []
    while True:
        data = sock.recv(65536)
        if not data:
            return b"".join(chunks)
        chunks.append(data)


def test_unfinished_headers_are_cut_off(port):
    with socket.create_connection(("127.0.0.1", port)) as sock:
        started = time.monotonic()
        sock.sendall(b"GET / HTTP/1.1\r\nhost: 127.0.0.1\r\n")  # no blank line: headers never end
        assert _read_all(sock) == b""
        assert HEADER_TIMEOUT_S * 0.8 <= time.monotonic() - started < HEADER_TIMEOUT_S + 3


def test_a_served_connection_idles_into_the_next_deadline(port):
    with socket.create_connection(("127.0.0.1", port)) as sock:
        started = time.monotonic()
        sock.sendall(b"GET / HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
        answer = _read_all(sock)  # the response, then the close once the re-armed deadline passes
        # Sooner than uvicorn's own keep-alive timeout (5 s): the header deadline closed it.
        assert time.monotonic() - started < HEADER_TIMEOUT_S + 3
    assert answer.startswith(b"HTTP/1.1 200")
    assert b"one " in answer and b"two" in answer
