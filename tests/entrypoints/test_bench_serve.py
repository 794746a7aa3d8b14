"""`nanoinfer bench serve`: dataset generation, statistics, goodput, and a short run against a real
server that checks the result file."""

import argparse
import asyncio
import json
import math
import socket
import sys

import pytest
from transformers import AutoTokenizer

from nanoinfer.benchmarks import serve as bench
from tests.entrypoints.test_server import MODEL, serve_in_thread
from tests.models.test_gguf import write_tiny_gguf


def test_random_dataset_lengths_prefix_and_seed(tiny_qwen3):
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    vocab = bench._vocab_ids(tokenizer)
    assert not set(vocab) & set(tokenizer.all_special_ids) and len(vocab) > 100

    exact = bench.sample_random_requests(vocab, 20, 30, 7, 0.0, shared_prefix_len=5, seed=1)
    assert [len(r.prompt_token_ids) for r in exact] == [35] * 20
    assert [r.output_len for r in exact] == [7] * 20
    assert len({tuple(r.prompt_token_ids[:5]) for r in exact}) == 1
    assert len({tuple(r.prompt_token_ids[5:]) for r in exact}) == 20
    assert bench.sample_random_requests(vocab, 20, 30, 7, 0.0, 5, seed=1) == exact
    assert bench.sample_random_requests(vocab, 20, 30, 7, 0.0, 5, seed=2) != exact

    ranged = bench.sample_random_requests(vocab, 200, 100, 10, 0.5, seed=0)
    input_lens = [len(r.prompt_token_ids) for r in ranged]
    assert min(input_lens) >= 50 and max(input_lens) <= 150 and len(set(input_lens)) > 20
    assert all(5 <= r.output_len <= 15 for r in ranged)


def test_percentile_matches_linear_interpolation():
    values = [4.0, 1.0, 3.0, 2.0]
    assert bench.percentile(values, 50) == 2.5
    assert bench.percentile(values, 90) == pytest.approx(3.7)
    assert bench.percentile(values, 100) == 4.0 and bench.percentile(values, 0) == 1.0
    assert bench.percentile([], 50) == 0.0


def test_summary_throughputs_latencies_and_goodput():
    results = [
        # ttft 0.1 s, e2e 1.0 s, 10 tokens: tpot 0.1 s
        bench.RequestResult(True, prompt_len=20, output_tokens=10, ttft_s=0.1, e2el_s=1.0, itl_s=[0.1] * 9),
        # ttft 0.5 s, e2e 0.8 s, 4 tokens: tpot 0.1 s
        bench.RequestResult(True, prompt_len=30, output_tokens=4, ttft_s=0.5, e2el_s=0.8, itl_s=[0.1] * 3),
        bench.RequestResult(False, prompt_len=30, error="HTTP 500: boom"),
    ]
    summary = bench.summarize(results, duration_s=2.0, goodput_slos={"ttft": 200.0, "tpot": 150.0})
    assert summary["completed"] == 2 and summary["failed"] == 1 and summary["errors"] == ["HTTP 500: boom"]
    assert summary["total_input_tokens"] == 50 and summary["total_output_tokens"] == 14
    assert summary["request_throughput"] == 1.0
    assert summary["output_throughput"] == 7.0 and summary["total_token_throughput"] == 32.0
    assert summary["mean_ttft_ms"] == pytest.approx(300.0) and summary["median_ttft_ms"] == pytest.approx(
        300.0
    )
    assert summary["mean_tpot_ms"] == pytest.approx(100.0)
    assert summary["mean_itl_ms"] == pytest.approx(100.0) and summary["p99_itl_ms"] == pytest.approx(100.0)
    assert summary["p99_e2el_ms"] == pytest.approx(998.0)
    assert summary["goodput"] == 0.5  # only the first request meets the 200 ms TTFT SLO
    table = bench.format_table(summary)
    assert "Request goodput (req/s)" in table and "Time to first token" in table


def test_payloads_for_peers_that_reject_ignore_eos(tiny_qwen3):
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    request = bench.BenchRequest(prompt_token_ids=[5, 6, 7], output_len=9)
    plain = bench._payload("/v1/completions", "m", request, 0.0, tokenizer)
    assert plain["ignore_eos"] is True and plain["max_tokens"] == 9 and plain["prompt"] == [5, 6, 7]
    chat = bench._payload("/v1/chat/completions", "m", request, 0.0, tokenizer, ignore_eos=False)
    assert "ignore_eos" not in chat and chat["max_tokens"] == chat["max_completion_tokens"] == 9
    assert chat["messages"][0]["content"] == tokenizer.decode([5, 6, 7])


def test_argument_parsing_errors():
    assert bench.parse_goodput(["ttft:500", "e2el:2000"]) == {"ttft": 500.0, "e2el": 2000.0}
    for bad in (["ttft"], ["latency:5"], ["tpot:fast"], ["tpot:0"]):
        with pytest.raises(ValueError, match="goodput"):
            bench.parse_goodput(bad)
    assert bench.parse_request_rates("1, 2.5,inf") == [1.0, 2.5, math.inf]
    for bad in ("", "0", "fast"):
        with pytest.raises(ValueError, match="request-rates"):
            bench.parse_request_rates(bad)
    assert bench.main(["--base-url", "http://x", "--model", "m", "--num-prompts", "0"]) == 2
    assert bench.main(["--base-url", "http://x", "--model", "m", "--plot", "x.png"]) == 2
    with pytest.raises(SystemExit):
        bench.main(["--base-url", "http://x", "--model", "m", "--request-rate", "-1"])


def test_bench_against_a_running_server(tiny_qwen3, tmp_path, capsys):
    with serve_in_thread(tiny_qwen3, api_key="bench-key") as srv:
        common = [
            "--base-url",
            srv.url,
            "--model",
            MODEL,
            "--tokenizer",
            tiny_qwen3,
            "--api-key",
            "bench-key",
        ]
        result_file = tmp_path / "result.json"
        status = bench.main(
            [
                *common,
                "--num-prompts", "8",
                "--random-input-len", "16",
                "--random-output-len", "6",
                "--shared-prefix-len", "16",
                "--request-rate", "100",
                "--max-concurrency", "4",
                "--goodput", "ttft:60000", "tpot:60000",
                "--result-file", str(result_file),
            ]
        )  # fmt: skip
        assert status == 0
        result = json.loads(result_file.read_text())
        assert result["completed"] == 8 and result["failed"] == 0 and result["errors"] == []
        assert result["total_input_tokens"] == 8 * 32 and result["total_output_tokens"] == 8 * 6
        assert result["request_rate"] == 100 and result["max_concurrency"] == 4
        assert result["request_throughput"] > 0 and result["goodput"] == result["request_throughput"]
        assert result["output_throughput"] == pytest.approx(result["request_throughput"] * 6)
        for metric in bench.LATENCY_METRICS:
            assert result[f"mean_{metric}_ms"] > 0, metric
            assert result[f"median_{metric}_ms"] <= result[f"p90_{metric}_ms"] <= result[f"p99_{metric}_ms"]
        assert result["mean_e2el_ms"] >= result["mean_ttft_ms"]
        assert "Serving Benchmark Result" in capsys.readouterr().out
        stats = srv.llm.stats(timeout=10)
        assert stats["prefix_cache_hit_tokens"] > 0  # the shared prefix was reused

        # The chat endpoint, swept over two rates with a plot.
        plot, sweep_file = tmp_path / "sweep.png", tmp_path / "sweep.json"
        status = bench.main(
            [
                *common,
                "--endpoint", "/v1/chat/completions",
                "--num-prompts", "4",
                "--random-input-len", "8",
                "--random-output-len", "4",
                "--plot", str(plot),
                "--request-rates", "50,inf",
                "--result-file", str(sweep_file),
            ]
        )  # fmt: skip
        assert status == 0
        runs = json.loads(sweep_file.read_text())["runs"]
        assert [r["request_rate"] for r in runs] == [50, "inf"]
        assert all(r["completed"] == 4 and r["total_output_tokens"] == 16 for r in runs)
        assert plot.stat().st_size > 10_000

        # A wrong model name fails before the timed run.
        assert bench.main([*common[:2], "--model", "other", *common[4:], "--num-prompts", "1"]) == 1
        assert "does not serve" in capsys.readouterr().err


def test_cli_registers_bench_subcommands():
    pytest.importorskip("nanoinfer.benchmarks.throughput")
    from nanoinfer.entrypoints import cli_bench

    parser = argparse.ArgumentParser()
    cli_bench.register(parser.add_subparsers())
    args = parser.parse_args(
        ["bench", "serve", "--base-url", "http://h:1", "--model", "m", "--request-rate", "inf"]
    )
    assert args.func is bench.run and args.request_rate == math.inf


# -- GGUF checkpoints and --plot -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("bench_gguf") / "tiny.gguf")
    write_tiny_gguf(path)
    return path


def _dead_url() -> str:
    """A local URL nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_tokenizer_from_a_gguf_file(tiny_gguf):
    tokenizer = bench.load_tokenizer(tiny_gguf)
    vocab = bench._vocab_ids(tokenizer)
    assert len(vocab) > 100 and not set(vocab) & set(tokenizer.all_special_ids)


def test_a_missing_tokenizer_path_is_a_clear_error(tmp_path, capsys):
    absent = str(tmp_path / "absent.gguf")
    assert bench.main(["--base-url", _dead_url(), "--model", absent, "--num-prompts", "1"]) == 2
    err = capsys.readouterr().err
    assert "no tokenizer at" in err and "--tokenizer" in err


def test_a_gguf_model_path_is_its_own_tokenizer(tiny_gguf, capsys):
    # `nanoinfer serve FILE.gguf` serves the model under its path: the same path names the tokenizer.
    # The tokenizer loads, and the run gets as far as the (absent) server.
    assert bench.main(["--base-url", _dead_url(), "--model", tiny_gguf, "--num-prompts", "1"]) == 1
    assert "cannot reach the server" in capsys.readouterr().err


def test_plot_without_matplotlib_fails_before_the_run(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # find_spec and import see no matplotlib
    argv = ["--base-url", _dead_url(), "--model", "m", "--plot", str(tmp_path / "p.png")]
    assert bench.main([*argv, "--request-rates", "1,inf"]) == 2
    err = capsys.readouterr().err
    assert "--plot needs matplotlib" in err and "cannot reach" not in err


def test_output_directories_are_checked_before_the_run(tmp_path, capsys):
    absent = str(tmp_path / "absent" / "out")
    base = ["--base-url", _dead_url(), "--model", "m"]
    assert bench.main([*base, "--result-file", absent + ".json"]) == 2
    assert bench.main([*base, "--plot", absent + ".png", "--request-rates", "1"]) == 2
    err = capsys.readouterr().err
    assert "--result-file: the directory of" in err and "--plot: the directory of" in err


def test_bench_a_gguf_model_and_keep_results_when_the_plot_fails(tiny_gguf, tmp_path, monkeypatch):
    def failing_plot(runs, path):
        raise RuntimeError("no display")

    monkeypatch.setattr(bench, "plot_sweep", failing_plot)
    result_file = tmp_path / "sweep.json"
    with serve_in_thread(tiny_gguf) as srv:
        argv = ["--base-url", srv.url, "--model", MODEL, "--tokenizer", tiny_gguf, "--num-prompts", "3"]
        argv += ["--random-input-len", "8", "--random-output-len", "3", "--num-warmups", "0"]
        argv += ["--plot", str(tmp_path / "p.png"), "--request-rates", "inf"]
        with pytest.raises(RuntimeError, match="no display"):
            bench.main([*argv, "--result-file", str(result_file)])
    (run,) = json.loads(result_file.read_text())["runs"]
    assert run["completed"] == 3 and run["failed"] == 0 and run["total_output_tokens"] == 9


def test_api_overhead_benchmark_runs_against_a_stub_core(tmp_path):
    from nanoinfer.benchmarks import api_overhead
    from tests.fixtures import build_model

    model = build_model(str(tmp_path / "model"), max_position_embeddings=1024)
    result_file = tmp_path / "result.json"
    argv = ["--model", model, "--num-prompts", "12", "--input-len", "32", "--output-len", "8"]
    assert api_overhead.main([*argv, "--result-file", str(result_file)]) == 0
    record = json.loads(result_file.read_text())
    assert record["output_tok_per_s"] > 0 and record["num_prompts"] == 12


def _sweep(scale: float) -> list[dict]:
    return [
        {
            "request_rate": rate,
            "median_ttft_ms": 10 * scale,
            "p99_ttft_ms": 20 * scale,
            "median_tpot_ms": 0.0 if scale > 100 else scale,  # a zero is left off the log scale
            "output_throughput": 1000 / scale,
        }
        for rate in (8, 32, "inf")
    ]


def test_comparison_plot_of_two_servers(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "compare.png"
    bench.plot_comparison({"fast": _sweep(1.0), "slow": _sweep(1000.0)[:2]}, str(path))
    assert path.read_bytes().startswith(b"\x89PNG")


def test_model_check_accepts_a_server_that_lists_no_model():
    class Response:
        status = 200

        def __init__(self, cards):
            self.body = json.dumps({"data": cards}).encode()

        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc):
            return False

        async def read(self):
            return self.body

    class Session:
        def __init__(self, cards):
            self.cards = cards

        def get(self, url, headers):
            return Response(self.cards)

    asyncio.run(bench._check_model(Session([]), "http://x", "m", {}))  # loads models on demand
    asyncio.run(bench._check_model(Session([{"id": "m"}]), "http://x", "m", {}))
    with pytest.raises(RuntimeError, match="does not serve 'm'"):
        asyncio.run(bench._check_model(Session([{"id": "other"}]), "http://x", "m", {}))
