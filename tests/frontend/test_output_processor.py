"""The output processor's short path for quiet completions (one final output, no stop strings, no
logprobs) against the full path of the same token stream."""

import pytest
from transformers import AutoTokenizer

from nanoinfer import SamplingParams
from nanoinfer.engine.request import EngineRequest
from nanoinfer.engine.scheduler import EngineCoreOutput
from nanoinfer.frontend.input_processor import ProcessedRequest
from nanoinfer.frontend.output_processor import OutputProcessor
from nanoinfer.sampling_params import RequestOutputKind

PROMPT = [5, 6, 7]


def _request(request_id: str, n: int, kind: RequestOutputKind) -> ProcessedRequest:
    params = SamplingParams(n=n, max_tokens=8, output_kind=kind)
    children = [EngineRequest(f"{request_id}-{i}", PROMPT, params, seed=i) for i in range(n)]
    return ProcessedRequest(request_id, None, PROMPT, params, children, arrival_time=0.0)


def _stream(core_id: str, index: int) -> list[EngineCoreOutput]:
    """Two tokens in the first step (a chunk's last row and a spec step alike), one per step after, an
    empty step, and an EOS that ends the last step: 'stop' with the stop token's text left out."""
    ids = [40 + index, 41, 42, 43, 44]
    return [
        EngineCoreOutput(core_id, ids[:2], num_cached_tokens=2),
        EngineCoreOutput(core_id, []),
        EngineCoreOutput(core_id, ids[2:3]),
        EngineCoreOutput(core_id, ids[3:4]),
        EngineCoreOutput(core_id, [ids[4], 0], finish_reason="stop", stopped_by_token=True),
    ]


@pytest.mark.parametrize("n", [1, 2])
def test_quiet_completions_end_as_the_full_path_does(tiny_qwen3, n):
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    final = {}
    for kind in (RequestOutputKind.FINAL_ONLY, RequestOutputKind.CUMULATIVE):
        processor = OutputProcessor(tokenizer)
        processor.add_request(_request("r", n, kind))
        assert [c.quiet for _, c in processor._by_core_id.values()] == [
            kind == RequestOutputKind.FINAL_ONLY
        ] * n
        streams = [_stream(f"r-{i}", i) for i in range(n)]
        for step, outputs in enumerate(zip(*streams, strict=True)):
            results, ended = processor.process_outputs(list(outputs))
            assert ended == []
            if kind == RequestOutputKind.FINAL_ONLY and step < len(streams[0]) - 1:
                assert results == []
        assert results[0].finished and not processor.requests
        final[kind] = results[0]
    quiet, full = final[RequestOutputKind.FINAL_ONLY], final[RequestOutputKind.CUMULATIVE]
    assert quiet.num_cached_tokens == full.num_cached_tokens == 2
    assert quiet.metrics.first_token_time is not None and quiet.metrics.last_token_time is not None
    for got, want in zip(quiet.outputs, full.outputs, strict=True):
        assert got.token_ids == want.token_ids and len(got.token_ids) == 6
        assert got.text == want.text == tokenizer.decode(want.token_ids[:-1], skip_special_tokens=True)
        assert (
            (got.finish_reason, got.stop_reason) == (want.finish_reason, want.stop_reason) == ("stop", None)
        )
