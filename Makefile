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
	$(PY) examples/generate.py

bench: install
	$(PY) benchmarks/throughput.py

clean:
	rm -rf $(VENV) build *.egg-info
