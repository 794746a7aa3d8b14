"""Offline batch generation with the vLLM-style API.

python examples/generate.py [MODEL]   # MODEL: HF directory or .gguf; default: SmolLM2-135M-Instruct
"""

import sys

from nanoinfer import LLM, SamplingParams
from nanoinfer.models.default_model import default_model_path


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else default_model_path()
    llm = LLM(model, max_model_len=2048)
    params = SamplingParams(temperature=0.0, max_tokens=48)
    questions = ["What is the capital of France?", "Name three primary colors.", "What is 7 times 8?"]
    outputs = llm.chat([[{"role": "user", "content": q}] for q in questions], params)
    for question, out in zip(questions, outputs, strict=True):
        print(f"Q: {question}\nA: {out.outputs[0].text.strip()}\n")
    print(llm.engine_stats())


if __name__ == "__main__":
    main()
