"""Tensor-parallel state: the rank and size layers are built for, the process group, and the collectives.

Layers read ``tp_rank()`` / ``tp_size()`` once, when they are built, from the scope the model runner
opens around model construction (:func:`tensor_parallel_scope`); outside any scope a model is built
whole. Each layer keeps its own rank and size, so a single-process engine built while a tensor-parallel
one is open in the same process stays unsharded.

The collectives run on torch.distributed's default process group, which the model runner of every rank
creates (:func:`init_process_group`) before building its model: one tensor-parallel engine per process.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# How long a collective (and the start-up rendezvous) may wait for the other ranks. A rank that exits
# is noticed much sooner (gloo fails as soon as its connection closes; under NCCL rank 0 checks its
# workers while it waits for its GPU work, and a watchdog thread acts when that wait is stuck; rank 0
# also checks its workers before every step): this bounds what is left, a rank that hangs without
# exiting.
COLLECTIVE_TIMEOUT = timedelta(minutes=5)
# How long closing an engine waits for the NCCL communicator's abort (see start_abort).
ABORT_TIMEOUT_S = 10.0

logger = logging.getLogger(__name__)

_rank, _size = 0, 1
# Rank 0 installs a check that raises a precise error (which worker died, its traceback) when a
# collective fails; held weakly so it does not keep the engine alive.
_failure_check: weakref.WeakMethod | None = None
_abort_thread: threading.Thread | None = None


def tp_rank() -> int:
    return _rank


def tp_size() -> int:
    return _size


@contextmanager
def tensor_parallel_scope(rank: int, size: int) -> Iterator[None]:
    """Layers built inside take this rank's shard of a ``size``-way split."""
    global _rank, _size
    previous = _rank, _size
    _rank, _size = rank, size
    try:
        yield
    finally:
        _rank, _size = previous


def check_tensor_parallel_size(hf_config: Any, size: int) -> None:
    """Raises ValueError when the model cannot be split ``size`` ways (checked before any process
    starts)."""
    if size == 1:
        return
    num_heads = hf_config.num_attention_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    if num_heads % size:
        raise ValueError(
            f"tensor_parallel_size={size} must divide the number of attention heads ({num_heads})"
        )
    # Fewer KV heads than ranks is fine (each is replicated), as long as the split is even.
    if num_kv_heads % size and size % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size={size} and the number of key/value heads ({num_kv_heads}) must "
            "divide one another"
        )
    if hf_config.intermediate_size % size:
        raise ValueError(
            f"tensor_parallel_size={size} must divide the MLP intermediate size "
            f"({hf_config.intermediate_size})"
        )


# -- process group ------------------------------------------------------------------------------------


def create_master_store(world_size: int) -> dist.TCPStore:
    """Rank 0's rendezvous store on a port the OS picks, so engines on one host never collide."""
    return dist.TCPStore(
        "127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False, timeout=COLLECTIVE_TIMEOUT
    )


def connect_store(port: int, world_size: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=COLLECTIVE_TIMEOUT)


def ensure_no_process_group() -> None:
    if _abort_thread is not None and _abort_thread.is_alive():
        raise RuntimeError(
            "the NCCL communicator of a tensor-parallel engine whose worker died could not be aborted "
            "(NCCL waits for the dead rank); a new tensor-parallel engine needs a new process"
        )
    if dist.is_initialized():
        raise RuntimeError(
            "a torch.distributed process group already exists in this process; a tensor-parallel "
            "engine needs its own: close the other tensor-parallel engine first"
        )


def init_process_group(store: dist.Store, rank: int, size: int, device: torch.device) -> None:
    """NCCL between GPUs (rank r on cuda:r), gloo on the CPU."""
    ensure_no_process_group()
    if device.type == "cuda":
        if rank == 0:
            # On an NCCL error or timeout PyTorch's default is to kill the process; rank 0 is the user's
            # process, so only abort the communicator (the failing call then raises). Read at group
            # creation; a value the user set is kept.
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        dist.init_process_group(
            "nccl", store=store, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT, device_id=device
        )
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT)


def destroy_process_group() -> bool:
    """Leaves this process's group without waiting for the other ranks, whatever state they are in.
    Returns False when an NCCL abort did not finish within ABORT_TIMEOUT_S (this process's GPU work
    may then never finish; the group is left as it is).

    Under NCCL the communicator is aborted: torch's orderly ``destroy_process_group`` waits for the
    other ranks to tear down too and for the communicator's work captured in CUDA graphs, and never
    returns if a rank is gone or a graph is still alive (seen on 2 x H200, torch 2.11). Aborting an
    idle communicator loses nothing (it is what ``destroy_process_group`` itself did in torch 2.4-2.6).
    """
    global _failure_check, _abort_thread
    _failure_check = None
    if _abort_thread is None and not dist.is_initialized():
        return True
    if _abort_thread is not None or dist.get_backend() == "nccl":
        thread = start_abort()
        thread.join(ABORT_TIMEOUT_S)
        if thread.is_alive():
            logger.error(
                "the NCCL communicator did not abort within %s s (a rank died mid-collective); this "
                "process's GPU work may never finish: restart the process",
                ABORT_TIMEOUT_S,
            )
            return False
        _abort_thread = None
        return True
    dist.destroy_process_group()
    return True


def start_abort() -> threading.Thread:
    """Aborts the NCCL communicators in a thread of their own (once; later calls return the same thread)
    and returns it. With a rank dead, NCCL's abort did not return in any run on 2 x H200 (it waits
    for every rank of the host while freeing), so no caller waits on it without a bound. torch's
    abort is private API; no public one exists."""
    global _abort_thread
    if _abort_thread is None:
        _abort_thread = threading.Thread(
            target=dist.distributed_c10d._abort_process_group, name="nanoinfer-nccl-abort", daemon=True
        )
        _abort_thread.start()
    return _abort_thread


def set_failure_check(check: Callable[[], None] | None) -> None:
    """``check`` (a bound method) runs when a collective fails and may raise a more precise error."""
    global _failure_check
    _failure_check = weakref.WeakMethod(check) if check is not None else None


def _collective_failed(name: str, error: Exception) -> RuntimeError:
    check = _failure_check() if _failure_check is not None else None
    if check is not None:
        check()  # raises when it finds the cause
    return RuntimeError(f"tensor-parallel {name} failed, another rank probably exited: {error}")


# -- collectives --------------------------------------------------------------------------------------
# A failed collective raises RuntimeError; one called after the abort thread (start_abort) has torn the
# group down raises ValueError (no default group): both mean another rank is gone.


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sums ``x`` across ranks, in place."""
    try:
        dist.all_reduce(x)
    except (RuntimeError, ValueError) as e:
        raise _collective_failed("all-reduce", e) from e
    return x


def all_reduce_min(value: int, device: torch.device) -> int:
    t = torch.tensor([value], dtype=torch.int64, device=device)
    try:
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
    except (RuntimeError, ValueError) as e:
        raise _collective_failed("all-reduce", e) from e
    return int(t.item())


def broadcast_from_rank0(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's ``x`` on every rank, in place."""
    try:
        dist.broadcast(x, src=0)
    except (RuntimeError, ValueError) as e:
        raise _collective_failed("broadcast", e) from e
    return x


def gather_to_rank0(x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
    """Concatenates every rank's (equally shaped) shard along ``dim`` on rank 0; other ranks get None.

    An all-gather rather than ``dist.gather``: NCCL builds gather from point-to-point sends, which stay
    blocked when their peer dies, through an abort too (pytorch#113281; rank 0 was seen blocked in one
    on 2 x H200); an all-gather is a collective like the all-reduces around it. The root receives the
    same bytes either way (no throughput difference measured at TP=2).
    """
    x = x.contiguous()
    try:
        shards = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(shards, x)
        rank = dist.get_rank()
    except (RuntimeError, ValueError) as e:
        raise _collective_failed("all-gather", e) from e
    return torch.cat(shards, dim=dim) if rank == 0 else None
