"""Slower engine steps for tests of servers whose engine core runs in a process of its own (where a test
cannot patch the engine): a core factory to pass to EngineCoreProcess, and a launcher for a live
`nanoinfer serve` that makes its engine process use it."""

from __future__ import annotations

import functools
import os
import textwrap
import time
from collections.abc import Callable

from nanoinfer.config import EngineConfig
from nanoinfer.engine.core import EngineCore

# A live server started with this launcher (``python -c LAUNCHER serve ...``) sleeps
# $NANOINFER_TEST_STEP_DELAY_S seconds before every step of its engine process.
STEP_DELAY_ENV = "NANOINFER_TEST_STEP_DELAY_S"
LAUNCHER = textwrap.dedent(
    f"""
    import os
    import sys

    from nanoinfer.entrypoints.cli import main
    from nanoinfer.frontend import core_client
    from tests.entrypoints.engine_delays import delayed_core

    real_init = core_client.EngineCoreProcess.__init__
    delay_s = float(os.environ["{STEP_DELAY_ENV}"])

    def init(self, config, on_outputs, on_dead, **kwargs):
        kwargs["core_factory"] = delayed_core(delay_s)
        real_init(self, config, on_outputs, on_dead, **kwargs)

    core_client.EngineCoreProcess.__init__ = init
    sys.exit(main(sys.argv[1:]))
    """
)


class FlagFile:
    """A flag that another process can read: set while its file exists."""

    def __init__(self, path: str):
        self.path = path

    def set(self) -> None:
        open(self.path, "w").close()

    def clear(self) -> None:
        if os.path.exists(self.path):
            os.unlink(self.path)

    def is_set(self) -> bool:
        return os.path.exists(self.path)


class _DelayedStepsCore(EngineCore):
    def __init__(self, config: EngineConfig, delay_s: float, flag_path: str | None):
        super().__init__(config)
        self.delay_s = delay_s
        self.flag_path = flag_path

    def step(self):
        if self.flag_path is None or os.path.exists(self.flag_path):
            time.sleep(self.delay_s)
        return super().step()


def delayed_core(delay_s: float, flag_path: str | None = None) -> Callable[[EngineConfig], EngineCore]:
    """A picklable core factory: every step sleeps ``delay_s`` first (while ``flag_path`` exists, if
    given)."""
    return functools.partial(_DelayedStepsCore, delay_s=delay_s, flag_path=flag_path)
