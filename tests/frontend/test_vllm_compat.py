"""A vLLM user's offline script and habits: vLLM's LLM keyword arguments, the model's default sampling
parameters (generation_config), LLM.chat's options (content parts, chat templates, tools,
continue_final_message), lora_request=None, RequestOutput.metrics, cpu_num_threads, and a script written
against vLLM's documented API run with only the import changed, on the tiny model and on the default one."""

from __future__ import annotations

import json
import os
import runpy
import shutil
import sys

import pytest
import torch
from tqdm.auto import tqdm

from nanoinfer import LLM, SamplingParams
from nanoinfer.entrypoints.cli_generate import chat_prompt_ids

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
EXAMPLE = os.path.join(os.path.dirname(__file__), "vllm_example.py")


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    engine = LLM(
        tiny_qwen3,
        device="cpu",
        max_model_len=256,
        num_kvcache_blocks=64,
        trust_remote_code=True,
        swap_space=4,
        disable_log_stats=True,
        tokenizer_mode="auto",
        quantization=None,
        dtype="float",
        enable_lora=False,
    )
    yield engine
    engine.close()


def _text(outputs) -> list[str]:
    return [o.outputs[0].text for o in outputs]


# -- default sampling parameters --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def greedy_by_default(tiny_qwen3, tmp_path_factory):
    """The tiny model with a generation_config.json that makes greedy decoding of 5 tokens the default."""
    model = shutil.copytree(tiny_qwen3, tmp_path_factory.mktemp("gen") / "model")
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 5}))
    engine = LLM(str(model), device="cpu", max_model_len=256, num_kvcache_blocks=64)
    yield engine
    engine.close()


def test_generate_and_chat_without_params_use_the_models_defaults(greedy_by_default):
    llm = greedy_by_default
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens) == (0.0, 5)
    defaults.max_tokens = 99  # a fresh object every call: changing it changes nothing else
    assert llm.get_default_sampling_params().max_tokens == 5
    explicit = SamplingParams(temperature=0.0, max_tokens=5)
    prompts = [[5, 6, 7], "The capital of France is"]
    assert _text(llm.generate(prompts, use_tqdm=False)) == _text(
        llm.generate(prompts, explicit, use_tqdm=False)
    )
    chat = llm.chat(QUESTION, use_tqdm=False)[0]
    assert chat.outputs[0].token_ids == llm.chat(QUESTION, explicit, use_tqdm=False)[0].outputs[0].token_ids
    assert len(chat.outputs[0].token_ids) <= 5


def test_override_generation_config_and_vllm_mode(tiny_qwen3):
    with LLM(tiny_qwen3, device="cpu", num_kvcache_blocks=16, override_generation_config={"top_k": 3}) as llm:
        assert llm.get_default_sampling_params().top_k == 3
    with LLM(tiny_qwen3, device="cpu", num_kvcache_blocks=16, generation_config="vllm") as llm:
        assert llm.get_default_sampling_params() == SamplingParams()


def test_the_engine_logs_which_defaults_are_in_force(greedy_by_default, tiny_qwen3, tmp_path, caplog):
    model = shutil.copytree(tiny_qwen3, tmp_path / "model")
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.3}))
    with caplog.at_level("INFO", logger="nanoinfer.frontend.llm_engine"):
        LLM(str(model), device="cpu", num_kvcache_blocks=16).close()
    assert "default sampling parameters: temperature=0.3 (from " in caplog.text
    assert "generation_config.json" in caplog.text


# -- LLM.chat ------------------------------------------------------------------------------------------------


def test_chat_prompt_is_the_rendered_text(llm):
    out = llm.chat(QUESTION, GREEDY, use_tqdm=False)[0]
    rendered = llm.get_tokenizer().apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert out.prompt == rendered
    assert out.prompt_token_ids == llm.get_tokenizer().encode(rendered, add_special_tokens=False)


def test_chat_content_as_a_list_of_text_parts(llm):
    parts = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {
            "role": "user",
            "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "France?"}],
        },
    ]
    joined = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is\nFrance?"}]
    a = llm.chat(parts, GREEDY, use_tqdm=False)[0]
    b = llm.chat(joined, GREEDY, use_tqdm=False)[0]
    assert a.prompt == b.prompt and a.outputs[0].token_ids == b.outputs[0].token_ids
    # "openai" passes the parts to the template as they are.
    listing = "{% for m in messages %}{% for p in m['content'] %}<{{ p['text'] }}>{% endfor %}{% endfor %}"
    out = llm.chat(
        parts, GREEDY, use_tqdm=False, chat_template=listing, chat_template_content_format="openai"
    )
    assert out[0].prompt == "<Be brief.><What is><France?>"


@pytest.mark.parametrize(
    "part", [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}, {"type": "input_audio"}]
)
def test_chat_rejects_other_content_parts_by_type(llm, part):
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, part]}]
    with pytest.raises(ValueError, match=f"this model takes text only: content parts of type {part['type']}"):
        llm.chat(messages, GREEDY, use_tqdm=False)


def test_chat_template_options(llm, tmp_path):
    template = (
        "{% if tools %}[tools:{{ tools | map(attribute='name') | join(',') }}]{% endif %}"
        "{% for m in messages %}{{ m['role'] }}={{ m['content'] }};{% endfor %}"
        "{% if greeting %}{{ greeting }};{% endif %}{% if add_generation_prompt %}assistant={% endif %}"
    )
    out = llm.chat(
        QUESTION,
        GREEDY,
        use_tqdm=False,
        chat_template=template,
        chat_template_kwargs={"greeting": "hello"},
        tools=[{"name": "search"}, {"name": "calc"}],
    )[0]
    assert out.prompt == "[tools:search,calc]user=What is the capital of France?;hello;assistant="
    file = tmp_path / "template.jinja"
    file.write_text(template)
    out = llm.chat(QUESTION, GREEDY, use_tqdm=False, chat_template=str(file), add_generation_prompt=False)[0]
    assert out.prompt == "user=What is the capital of France?;"


def test_continue_final_message(llm):
    messages = QUESTION + [{"role": "assistant", "content": "The capital is"}]
    out = llm.chat(messages, GREEDY, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
    assert out[0].prompt.endswith("<|im_start|>assistant\nThe capital is")
    with pytest.raises(
        ValueError, match="continue_final_message and add_generation_prompt cannot both be true"
    ):
        llm.chat(messages, GREEDY, use_tqdm=False, continue_final_message=True)


def test_chat_argument_errors(llm):
    with pytest.raises(ValueError, match="chat_template_kwargs may only hold template variables"):
        llm.chat(QUESTION, GREEDY, use_tqdm=False, chat_template_kwargs={"tokenize": True})
    with pytest.raises(ValueError, match="mm_processor_kwargs is not supported"):
        llm.chat(QUESTION, GREEDY, use_tqdm=False, mm_processor_kwargs={"size": 3})
    with pytest.raises(ValueError, match="chat_template_content_format"):
        llm.chat(QUESTION, GREEDY, use_tqdm=False, chat_template_content_format="markdown")
    with pytest.raises(ValueError, match="messages\\[0\\] must be a dict with a 'role'"):
        llm.chat([{"content": "x"}], GREEDY, use_tqdm=False)


def test_the_engines_chat_template_option(tiny_qwen3):
    template = "{% for m in messages %}{{ m['content'] }}|{% endfor %}"
    with LLM(tiny_qwen3, device="cpu", num_kvcache_blocks=16, chat_template=template) as llm:
        assert llm.chat(QUESTION, GREEDY, use_tqdm=False)[0].prompt == "What is the capital of France?|"
        # The CLI's generate and chat render with the engine's tokenizer, so they use it too.
        expected = llm.get_tokenizer().encode("What is the capital of France?|", add_special_tokens=False)
        assert chat_prompt_ids(llm, QUESTION) == expected


# -- generate's vLLM arguments, metrics, threads -------------------------------------------------------------


def test_lora_request_none_is_accepted_and_anything_else_rejected(llm):
    assert len(llm.generate([[5, 6]], GREEDY, use_tqdm=False, lora_request=None)) == 1
    for call in (llm.generate, llm.chat):
        prompt = [[5, 6]] if call is llm.generate else QUESTION
        with pytest.raises(ValueError, match="lora_request is not supported: nanoinfer has no LoRA adapters"):
            call(prompt, GREEDY, use_tqdm=False, lora_request=object())
    assert len(llm.generate([[5], [6]], GREEDY, use_tqdm=False, priority=[0, 0])) == 2
    with pytest.raises(ValueError, match="priority is not supported"):
        llm.generate([[5], [6]], GREEDY, use_tqdm=False, priority=[1, 0])


def test_use_tqdm_may_be_a_progress_bar_class(llm):
    made = []

    def progress(**kwargs):
        made.append(kwargs)
        return tqdm(**{**kwargs, "disable": True})

    llm.generate([[5, 6], [7]], GREEDY, use_tqdm=progress)
    assert made and made[0]["total"] == 2


def test_request_metrics_are_filled(llm):
    for out in llm.generate([[5, 6, 7], [8, 9]], GREEDY, use_tqdm=False):
        m = out.metrics
        assert m.arrival_time <= m.first_token_time <= m.last_token_time <= m.finished_time


def test_cpu_num_threads_is_applied_at_engine_start(tiny_qwen3):
    before = torch.get_num_threads()
    try:
        LLM(tiny_qwen3, device="cpu", num_kvcache_blocks=16, cpu_num_threads=1).close()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


# -- a vLLM script, with only the import changed -------------------------------------------------------------


def _run_vllm_example(model: str, tmp_path, capsys, monkeypatch) -> str:
    with open(EXAMPLE) as f:
        source = f.read()
    vllm_import = "\nfrom vllm import LLM, SamplingParams\n"
    assert source.count(vllm_import) == 1
    script = tmp_path / "example.py"
    script.write_text(source.replace(vllm_import, "\nfrom nanoinfer import LLM, SamplingParams\n"))
    monkeypatch.setattr(sys, "argv", [str(script), model])
    runpy.run_path(str(script), run_name="__main__")
    return capsys.readouterr().out


def test_a_vllm_example_script_runs_on_the_tiny_model(tiny_qwen3, tmp_path, capsys, monkeypatch):
    out = _run_vllm_example(tiny_qwen3, tmp_path, capsys, monkeypatch)
    assert out.count("Prompt: ") == 4 + 1 + 2
    assert "Prompt: 'The capital of France is', Generated text: '" in out
    assert "Prompt: '<|im_start|>system\\nYou are a helpful assistant<|im_end|>" in out
    assert "Answer: '" in out and "arrival: " in out


@pytest.mark.slow
def test_a_vllm_example_script_runs_on_the_default_model(smollm2_path, tmp_path, capsys, monkeypatch):
    out = _run_vllm_example(smollm2_path, tmp_path, capsys, monkeypatch)
    assert out.count("Prompt: ") == 4 + 1 + 2
    answer = next(line for line in out.splitlines() if line.startswith("Answer: "))
    assert "Paris" in answer, out
