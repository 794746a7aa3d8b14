# An offline-inference script written against vLLM's documented API (LLM, SamplingParams, generate, chat,
# get_default_sampling_params, RequestOutput), as a vLLM user writes one. The test runs it with nothing
# changed but the import below (`from vllm import LLM, SamplingParams`); the model is the first argument.
import sys

from vllm import LLM, SamplingParams

prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)


def print_outputs(outputs):
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
    print("-" * 80)


def main(model: str):
    llm = LLM(model=model, trust_remote_code=True, seed=0, swap_space=4, max_model_len=1024)

    outputs = llm.generate(prompts, sampling_params)
    print_outputs(outputs)

    conversation = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello! How can I assist you today?"},
        {"role": "user", "content": "Write an essay about the importance of higher education."},
    ]
    outputs = llm.chat(conversation, sampling_params, use_tqdm=False)
    print_outputs(outputs)

    # Several conversations at once, one with its content as a list of parts.
    parts = [{"role": "user", "content": [{"type": "text", "text": "Tell me a joke."}]}]
    outputs = llm.chat([conversation, parts], sampling_params, use_tqdm=False, lora_request=None)
    print_outputs(outputs)

    # The model's recommended sampling parameters (its generation config), with a longer answer.
    default_params = llm.get_default_sampling_params()
    default_params.max_tokens = 32
    question = [{"role": "user", "content": "What is the capital of France?"}]
    answer = llm.chat(question, default_params, use_tqdm=False)[0]
    print(f"Answer: {answer.outputs[0].text!r}")
    print(f"Finish reason: {answer.outputs[0].finish_reason}, arrival: {answer.metrics.arrival_time}")


if __name__ == "__main__":
    main(sys.argv[1])
