"""Engine options as command-line flags (``--max-model-len`` etc.), derived from EngineConfig's fields."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any

from nanoinfer.config import EngineConfig

_SKIP = {"model"}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Adds one ``--flag`` per engine option; unset flags keep the engine's defaults."""
    hints = typing.get_type_hints(EngineConfig)
    group = parser.add_argument_group("engine options")
    for f in dataclasses.fields(EngineConfig):
        if not f.init or f.name in _SKIP:
            continue
        flag = "--" + f.name.replace("_", "-")
        hint = hints[f.name]
        base = next((t for t in typing.get_args(hint) if t is not type(None)), hint)
        if base is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
        else:
            group.add_argument(flag, type=base, default=None, metavar=f.name.upper())


def engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options the user actually set on the command line."""
    names = [f.name for f in dataclasses.fields(EngineConfig) if f.init and f.name not in _SKIP]
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
