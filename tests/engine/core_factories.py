"""Engine cores that fail on purpose, for tests of an engine core in a process of its own. Module-level
(and functools.partial of module-level callables) so that a spawned engine process can unpickle them."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

from nanoinfer.config import EngineConfig
from nanoinfer.engine.core import EngineCore


class _StepFailsCore(EngineCore):
    """Its third step raises ``message``, as a device failure would (not attributable to any request)."""

    def __init__(self, config: EngineConfig, message: str):
        super().__init__(config)
        self.message = message
        self.num_steps = 0

    def step(self):
        self.num_steps += 1
        if self.num_steps == 3:
            raise RuntimeError(self.message)
        return super().step()


def step_fails_core(message: str) -> Callable[[EngineConfig], EngineCore]:
    return functools.partial(_StepFailsCore, message=message)


def no_core(config: EngineConfig) -> EngineCore:
    raise RuntimeError("injected start failure")


def _sleeping_core(config: EngineConfig, seconds: float) -> None:
    time.sleep(seconds)


def slow_core(seconds: float) -> Callable[[EngineConfig], EngineCore]:
    """A core that takes ``seconds`` to build (the test stops its process first)."""
    return functools.partial(_sleeping_core, seconds=seconds)
