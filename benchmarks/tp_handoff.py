"""Host cost of handing one decode step to a tensor-parallel worker (CPU only, no model).

For decode batches of several sizes (1024-token contexts, 64-entry block tables, already in the
persistent batch): the time to build the step's StepInputs on rank 0, to pickle and unpickle them, and
to send them through the shared-memory channel to a reader process (which includes waiting for its
acknowledgement of the previous step).

    python3 benchmarks/tp_handoff.py [--batch-sizes 64,256] [--result-file F]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import pickle
import time
from pathlib import Path

import torch

from nanoinfer.engine.scheduler import NewRequestData, ScheduledRequest, SchedulerOutput
from nanoinfer.executor.input_batch import InputBatch
from nanoinfer.executor.tp.channel import ChannelReader, ChannelWriter
from nanoinfer.sampling_params import SamplingParams

BLOCK_SIZE = 16


def _reader(handle) -> None:
    reader = ChannelReader(handle)
    while True:
        ok, step = reader.recv(lambda: True)
        if not ok or step is None:
            break
    reader.close()


def _per_call_us(fn, n: int) -> float:
    started = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - started) / n * 1e6


def measure(batch_size: int, n: int) -> dict:
    params = SamplingParams(temperature=0.6)
    batch = InputBatch(batch_size, 80, BLOCK_SIZE, torch.device("cpu"))
    ids = [str(i) for i in range(batch_size)]
    tables = [list(range(i * 64, i * 64 + 64)) for i in range(batch_size)]
    admit = SchedulerOutput(
        new_requests={
            rid: NewRequestData(rid, params, 0, table, [], None)
            for rid, table in zip(ids, tables, strict=True)
        }
    )
    batch.prepare(admit)
    batch.num_blocks[:] = 0  # the rows below send their tables
    out = SchedulerOutput(
        scheduled=[
            ScheduledRequest(rid, 1000 + i % 20, 1, [5], False, table, True, 10)
            for i, (rid, table) in enumerate(zip(ids, tables, strict=True))
        ]
    )
    batch.prepare(out)
    for row in out.scheduled:
        row.new_block_ids = []  # from now on a steady decode step: no block is new
    step, _ = batch.prepare(out)
    ctx = mp.get_context("spawn")
    writer = ChannelWriter(1 << 22, 1, ctx)
    process = ctx.Process(target=_reader, args=(writer.reader_handle(0),), daemon=True)
    process.start()
    try:
        writer.wait_acks(lambda: None, 60)
        send = _per_call_us(lambda: writer.send(step, lambda: None, 60), n)
        writer.send(None, lambda: None, 60)
        process.join(60)
    finally:
        writer.close()
    return {
        "batch_size": batch_size,
        "prepare_step_us": round(_per_call_us(lambda: batch.prepare(out), n)),
        "pickle_roundtrip_us": round(_per_call_us(lambda: pickle.loads(pickle.dumps(step, protocol=5)), n)),
        "channel_send_us": round(send),
        "message_bytes": len(pickle.dumps(step, protocol=5)),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="64,256")
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--result-file")
    args = parser.parse_args()
    results = [measure(int(b), args.iterations) for b in args.batch_sizes.split(",")]
    columns = list(results[0])
    print(" | ".join(columns))
    for r in results:
        print(" | ".join(str(r[c]) for c in columns))
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
