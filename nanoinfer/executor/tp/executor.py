"""Tensor parallelism: rank 0's model runner in the engine's process and ranks 1..N-1 in worker
processes, all running every step's StepInputs (their collectives pair up)."""

from __future__ import annotations

import torch

from nanoinfer.config import EngineConfig
from nanoinfer.engine.scheduler import SchedulerOutput
from nanoinfer.executor.executor import Executor, PreparedStep
from nanoinfer.executor.model_runner import ModelRunner, StagedInputs, StepHandle
from nanoinfer.executor.tp.workers import TensorParallelWorkers


class TensorParallelExecutor(Executor):
    def __init__(self, config: EngineConfig):
        self.config = config
        self.runner = None
        size = config.tensor_parallel_size
        self.device = torch.device("cuda", 0) if config.device == "cuda" else torch.device("cpu")
        if self.device.type == "cuda" and torch.cuda.device_count() < size:
            raise ValueError(
                f"tensor_parallel_size={size} needs one GPU per rank, but {torch.cuda.device_count()} "
                "are visible"
            )
        self.workers = TensorParallelWorkers(config)
        try:
            # The workers attach to the channel as soon as they have started: a worker that fails to
            # start is reported here rather than after the rendezvous's timeout.
            self.workers.wait_ready()
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            self.workers.init_process_group(self.device)
            self.runner = ModelRunner(config, rank=0)
        except BaseException:
            # Leaves no worker process or process group behind; the workers are stopped at once (a
            # graceful stop would wait for workers that are stuck in a collective with this rank).
            self.workers.stop(graceful=False)
            self.workers = None
            self.close()
            raise
        if self.device.type == "cuda":
            self.runner.device_wait = self._wait_for_device

    def _wait_for_device(self, event: torch.cuda.Event) -> None:
        with self.workers.running_step():
            self.workers.wait_for_device(event)

    def stage(self, prepared: PreparedStep) -> None:
        """Nothing early: the workers copy their inputs when the step is sent to them."""
        return None

    def launch(
        self,
        out: SchedulerOutput,
        prepared: PreparedStep,
        defer_sampling: bool = False,
        staged_inputs: StagedInputs | None = None,
    ) -> StepHandle:
        step, plan = prepared
        with self.workers.running_step():
            self.workers.send(step)
            return self.runner.execute(out, step, plan, defer_sampling, staged_inputs)

    def close(self) -> None:
        """Stops the workers and leaves the process group; frees the graphs first, since they hold the
        communicator's captured collectives. After a worker's death the work waiting for it may never
        finish, so nothing waits for it: the workers are stopped first (with a bounded abort under
        NCCL)."""
        if self.workers is not None and not self.workers.healthy:
            self.workers.stop()
            self.workers = None
        elif self.device.type == "cuda" and self.runner is not None:
            torch.cuda.synchronize(self.device)
        super().close()
        if self.workers is not None:
            self.workers.stop()
            self.workers = None
