"""`nanoinfer serve`: a bad model path is a one-line error with exit status 1, and a port in use is
reported before any model loads."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from nanoinfer.entrypoints import cli, cli_serve, server

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_bad_model_path_is_one_line_and_exit_status_1():
    # A real process: what a user sees is the interpreter's exit status and stderr.
    run = subprocess.run(
        [sys.executable, "-m", "nanoinfer.entrypoints.cli", "serve", "/nope", "--port", str(_free_port())],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": ROOT},
        timeout=120,
    )
    assert run.returncode == 1
    assert run.stderr.startswith("nanoinfer serve: error: model path '/nope' does not exist"), run.stderr
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr


def test_bad_engine_option_value_is_one_line(tiny_qwen3):
    argv = ["serve", tiny_qwen3, "--port", str(_free_port()), "--max-num-seqs", "0"]
    with pytest.raises(SystemExit, match=r"^nanoinfer serve: error: max_num_seqs must be an integer >= 1"):
        cli.main(argv)


def test_a_port_in_use_is_reported_before_the_model_loads(monkeypatch):
    def must_not_load(*args, **kwargs):
        raise AssertionError("the model was loaded although the port is taken")

    monkeypatch.setattr(server, "run_server", must_not_load)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["serve", "/nope", "--host", "127.0.0.1", "--port", str(port)])
    message = str(exit_info.value.code)
    assert message.startswith(f"nanoinfer serve: error: cannot listen on 127.0.0.1:{port}: ")
    assert "--port" in message and "\n" not in message


def test_a_free_port_passes_the_check_and_stays_free():
    port = _free_port()
    cli_serve.check_port_is_free("127.0.0.1", port)
    cli_serve.check_port_is_free("127.0.0.1", port)  # the probe let it go again
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_serve_passes_its_flags_to_the_server(monkeypatch):
    calls = []

    def record(*args, **kwargs):
        calls.append((args, kwargs))

    monkeypatch.setattr(server, "run_server", record)
    port = _free_port()
    assert cli.main(["serve", "/models/m", "--port", str(port), "--max-model-len", "64"]) == 0
    ((args, kwargs),) = calls
    assert args == ("/models/m",) and kwargs["port"] == port and kwargs["host"] == "127.0.0.1"
    assert kwargs["max_model_len"] == 64


@pytest.mark.parametrize("port", ["-1", "65536", "http"])
def test_port_out_of_range_is_a_usage_error(capsys, port):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "/m", "--port", port])
    assert exit_info.value.code == 2
    assert "argument --port: must be an integer in [0, 65535]" in capsys.readouterr().err
