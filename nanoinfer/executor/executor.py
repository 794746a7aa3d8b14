"""The engine core's handle on the device: an executor runs each SchedulerOutput as one step."""

from __future__ import annotations

from nanoinfer.config import EngineConfig
from nanoinfer.engine.scheduler import SchedulerOutput
from nanoinfer.engine.structured_outputs import GrammarBitmask
from nanoinfer.executor.input_batch import StepInputs, StepPlan
from nanoinfer.executor.model_runner import ModelRunner, StagedInputs, StepHandle

# A step's inputs as host arrays and its row bookkeeping, made before it is launched.
PreparedStep = tuple[StepInputs, StepPlan]


class Executor:
    """One device, one process: the model runner of the only rank."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.runner = ModelRunner(config)

    @property
    def num_kv_blocks(self) -> int:
        return self.runner.num_kv_blocks

    def prepare(self, out: SchedulerOutput) -> PreparedStep:
        """The step's inputs, on the host: nothing is launched, so the sampling of a step before it may
        still be launched first (its tokens are this step's pending inputs)."""
        return self.runner.prepare(out)

    def stage(self, prepared: PreparedStep) -> StagedInputs | None:
        """Copies a prepared step's inputs to the device now, for :meth:`launch`: while the step before
        it waits for its bitmask, before its deferred sampling (see ``ModelRunner.stage``)."""
        step, plan = prepared
        return self.runner.stage(step, plan)

    def launch(
        self,
        out: SchedulerOutput,
        prepared: PreparedStep,
        defer_sampling: bool = False,
        staged_inputs: StagedInputs | None = None,
    ) -> StepHandle:
        """Launches a prepared step (its inputs copied now, or by :meth:`stage`); the handle's result()
        waits for it. ``defer_sampling``: launch the forward pass and the logits only; :meth:`sample`
        launches the rest."""
        step, plan = prepared
        return self.runner.execute(out, step, plan, defer_sampling, staged_inputs)

    def sample(self, handle: StepHandle, bitmask: GrammarBitmask | None) -> None:
        """Launches the sampling of a step executed with ``defer_sampling``, under ``bitmask``."""
        self.runner.sample(handle, bitmask)

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()
            self.runner = None


def create_executor(config: EngineConfig) -> Executor:
    if config.tensor_parallel_size > 1:
        from nanoinfer.executor.tp.executor import TensorParallelExecutor

        return TensorParallelExecutor(config)
    return Executor(config)
