"""The command line's parsing: engine flags (help, defaults, choices, vLLM's aliases and extra flags),
and errors shown with the subcommand's own usage. Nothing here loads a model."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from nanoinfer import config
from nanoinfer.config import EngineConfig
from nanoinfer.entrypoints import cli, engine_args
from nanoinfer.entrypoints.engine_args import add_engine_args, engine_kwargs_from_args


def _engine_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="test")
    add_engine_args(parser)
    return parser


def _engine_actions() -> dict[str, argparse.Action]:
    return {action.dest: action for action in _engine_parser()._actions if action.dest != "help"}


def test_every_engine_option_has_a_flag_with_help_and_its_default():
    actions = _engine_actions()
    for f in dataclasses.fields(EngineConfig):
        if not f.init or f.name == "model":
            continue
        assert f.name in actions, f"no flag for the engine option {f.name}"
        help_text = actions[f.name].help
        assert help_text.startswith(engine_args.ENGINE_OPTION_HELP.get(f.name, "<missing>")), (
            f"add a help text for {f.name} to engine_args.ENGINE_OPTION_HELP"
        )
        if f.default is not None:
            assert f"(default: {f.default})" in help_text, f.name
        assert actions[f.name].default is None  # unset flags never reach the engine


def test_choices_are_the_engines():
    actions = _engine_actions()
    assert actions["device"].choices == list(config._DEVICES)
    assert actions["dtype"].choices == ["auto", *config._DTYPES]
    assert actions["attention_backend"].choices == list(config._ATTENTION_BACKENDS)


def test_help_lists_every_engine_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--max-model-len", "-tp", "--block-size", "--chat-template", "--generation-config"):
        assert flag in text
    assert "{auto,cuda,cpu}" in text and "(default: 256)" in text  # choices, and max_num_seqs's default


def test_nothing_set_means_no_engine_kwargs():
    assert engine_kwargs_from_args(_engine_parser().parse_args([])) == {}


def test_vllm_aliases():
    args = _engine_parser().parse_args(["-tp", "2", "--block-size", "32"])
    assert engine_kwargs_from_args(args) == {"tensor_parallel_size": 2, "kvcache_block_size": 32}
    args = _engine_parser().parse_args(["--tensor-parallel-size", "4", "--kvcache-block-size", "64"])
    assert engine_kwargs_from_args(args) == {"tensor_parallel_size": 4, "kvcache_block_size": 64}


def test_vllm_flags_map_to_engine_kwargs(tmp_path):
    args = _engine_parser().parse_args(
        ["--chat-template", "{{ messages }}", "--trust-remote-code", "--generation-config", "vllm"]
    )
    assert engine_kwargs_from_args(args) == {
        "chat_template": "{{ messages }}",
        "trust_remote_code": True,
        "generation_config": "vllm",
    }
    for value in ("auto", str(tmp_path)):
        args = _engine_parser().parse_args(["--generation-config", value])
        assert engine_kwargs_from_args(args) == {"generation_config": value}


def test_bad_generation_config_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "Hi", "--generation-config", str(tmp_path / "absent")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "usage: nanoinfer generate" in err and "--generation-config" in err and "'auto'" in err


@pytest.mark.parametrize(
    ("argv", "usage"),
    [
        (["generate", "Hi", "--bogus"], "usage: nanoinfer generate"),
        (["generate", "Hi", "extra"], "usage: nanoinfer generate"),
        (["chat", "--bogus"], "usage: nanoinfer chat"),
        (["serve", "/m", "--bogus"], "usage: nanoinfer serve"),
        (["bench", "throughput", "--bogus"], "usage: nanoinfer bench throughput"),
        (
            ["bench", "serve", "--base-url", "http://x", "--model", "m", "--bogus"],
            "usage: nanoinfer bench serve",
        ),
    ],
)
def test_an_unknown_flag_shows_the_subcommands_usage(capsys, argv, usage):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage), err
    assert f"{usage.removeprefix('usage: ')}: error: unrecognized arguments: {argv[-1]}" in err


def test_an_unknown_subcommand_still_shows_the_top_level_usage(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bogus"])
    assert capsys.readouterr().err.startswith("usage: nanoinfer [-h]")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-output-len", "64"], "--min-output-len (100) must be <= --max-output-len (64)"),
        (["--min-input-len", "300", "--max-input-len", "200"], "--min-input-len (300) must be <="),
        (["--num-seqs", "0"], "argument --num-seqs: must be an integer >= 1"),
        (["--min-output-len", "0"], "argument --min-output-len: must be an integer >= 1"),
    ],
)
def test_bench_throughput_rejects_empty_workload_ranges(capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "throughput", *flags])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "usage: nanoinfer bench throughput" in err and message in err


def test_bench_throughput_model_and_random_shape_exclude_each_other(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "throughput", "--model", "m", "--random-shape", "qwen3-0.6b"])
    assert "not allowed with argument --model" in capsys.readouterr().err
