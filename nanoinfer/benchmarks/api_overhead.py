"""What the API-server process alone can deliver: `nanoinfer serve` with its engine process replaced by a
stub core that computes nothing (every running request gets one token per step, as fast as the loop
turns), measured with `nanoinfer bench serve` at an unlimited rate.

The figure is an upper bound of the server's output tok/s whatever the model: HTTP, request intake,
the engine-process messages, detokenization and one SSE event per step per request, against an engine
that is never the bottleneck. Compare it with the offline engine's tok/s on the same workload: a server
cannot deliver more than the smaller of the two.

    python3 -m nanoinfer.benchmarks.api_overhead --model DIR [--num-prompts 300] [--output-len 128]
        [--max-num-seqs 256] [--step-ms 0] [--result-file PATH]

DIR is only read for its tokenizer and config (no weights are loaded).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

from nanoinfer.config import EngineConfig
from nanoinfer.engine.core import EngineCoreOutputs
from nanoinfer.engine.request import EngineRequest
from nanoinfer.engine.scheduler import EngineCoreOutput

# Runs `nanoinfer serve` with every engine process built from StubCore (the serving path is unchanged).
_LAUNCHER = """
import functools
import sys

from nanoinfer.benchmarks.api_overhead import StubCore
from nanoinfer.entrypoints.cli import main
from nanoinfer.frontend import core_client

real_init = core_client.EngineCoreProcess.__init__

def init(self, config, on_outputs, on_dead, **kwargs):
    kwargs["core_factory"] = functools.partial(StubCore, step_s=float(sys.argv[1]))
    real_init(self, config, on_outputs, on_dead, **kwargs)

core_client.EngineCoreProcess.__init__ = init
sys.exit(main(sys.argv[2:]))
"""


class StubCore:
    """EngineCore's interface without a model: up to ``max_num_seqs`` requests run, each gets token id
    ``TOKEN_ID`` per step until its max_tokens. A step takes at least ``step_s`` seconds (a GPU's step
    time: the core sleeps, as the host does while it waits for the device)."""

    TOKEN_ID = 300

    def __init__(self, config: EngineConfig, step_s: float = 0.0):
        self.config = config
        self.step_s = step_s
        self.num_kv_blocks = 1 << 20
        self.running: dict[str, list[int]] = {}  # request id -> [generated, max_tokens]
        self.waiting: list[tuple[str, int]] = []
        self.num_steps = 0

    def add_request(self, request: EngineRequest) -> None:
        max_tokens = request.params.max_tokens or 16
        self.waiting.append((request.request_id, max_tokens))

    def abort_requests(self, request_ids: list[str]) -> None:
        gone = set(request_ids)
        for request_id in gone:
            self.running.pop(request_id, None)
        self.waiting = [w for w in self.waiting if w[0] not in gone]

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting)

    def step(self) -> EngineCoreOutputs:
        if self.step_s:
            time.sleep(self.step_s)
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            request_id, max_tokens = self.waiting.pop(0)
            self.running[request_id] = [0, max_tokens]
        outputs = []
        for request_id, state in list(self.running.items()):
            state[0] += 1
            finished = state[0] >= state[1]
            outputs.append(
                EngineCoreOutput(request_id, [self.TOKEN_ID], finish_reason="length" if finished else None)
            )
            if finished:
                del self.running[request_id]
        self.num_steps += 1
        return EngineCoreOutputs(outputs, 0, len(outputs))

    def stats(self) -> dict[str, int]:
        return {
            "num_kv_blocks_total": self.num_kv_blocks,
            "num_kv_blocks_free": self.num_kv_blocks,
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "num_preemptions": 0,
            "prefix_cache_queried_tokens": 0,
            "prefix_cache_hit_tokens": 0,
            "num_prompt_tokens_computed": 0,
            "num_generated_tokens": 0,
        }

    def close(self) -> None:
        self.running.clear()


def stat_cpu_seconds(path: str) -> tuple[str, float]:
    """(name, user + system CPU seconds) from a Linux /proc stat file: a process's (``/proc/PID/stat``,
    without its children, with its threads that have exited) or one thread's (``/proc/PID/task/TID/stat``)."""
    with open(path) as f:
        stat = f.read()
    name, fields = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
    return name, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="checkpoint directory (tokenizer and config only)")
    parser.add_argument("--num-prompts", type=int, default=300)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument(
        "--step-ms", type=float, default=0.0, help="the stub's least step time (a GPU's step time; default 0)"
    )
    parser.add_argument("--result-file", metavar="PATH")
    args = parser.parse_args(argv)
    port = _free_port()
    repo_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo_root, os.environ.get("PYTHONPATH", "")]))
    server = subprocess.Popen(
        [sys.executable, "-c", _LAUNCHER, str(args.step_ms / 1000), "serve", args.model, "--port", str(port),
         "--device", "cpu", "--max-num-seqs", str(args.max_num_seqs), "--log-level", "warning",
         "--disable-log-stats"],
        env=env,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        import httpx

        while True:
            try:
                httpx.get(url + "/health", timeout=2).raise_for_status()
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("the stub server did not start") from None
                time.sleep(0.5)
        with tempfile.TemporaryDirectory() as scratch:
            result_file = os.path.join(scratch, "serve.json")
            api_cpu_before = stat_cpu_seconds(f"/proc/{server.pid}/stat")[1]
            subprocess.run(
                [sys.executable, "-m", "nanoinfer.entrypoints.cli", "bench", "serve", "--base-url", url,
                 "--model", args.model, "--tokenizer", args.model, "--num-prompts", str(args.num_prompts),
                 "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
                 "--request-rate", "inf", "--result-file", result_file],
                check=True, env=env,
            )  # fmt: skip
            api_cpu_s = stat_cpu_seconds(f"/proc/{server.pid}/stat")[1] - api_cpu_before
            with open(result_file) as f:
                result = json.load(f)
    finally:
        server.terminate()
        server.wait(30)
    run = result["runs"][0] if "runs" in result else result
    record = {
        "benchmark": "api_overhead",
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "output_tok_per_s": round(run["output_throughput"], 1),
        "median_ttft_ms": round(run["median_ttft_ms"], 1),
        "duration_s": round(run["duration_s"], 2),
        "step_ms": args.step_ms,
        # CPU seconds over the run: a process near duration_s was saturated (one thread's worth).
        "api_process_cpu_s": round(api_cpu_s, 2),
        "client_cpu_s": round(run["client_cpu_s"], 2),
    }
    print(json.dumps(record))
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(record, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
