# Quick start: `make run` (set-up + the embedded stack) and `make test` (set-up + the whole suite).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# What serving needs (`make run`): the package and the `export` extra (ONNX exports from the
# dashboard). The test, bench and lint tools (`.[dev,bench]`: Playwright, MLflow's server, Triton's
# client, schemathesis, ruff, mypy, ...) come with `make test` (STAMP), on top of it.
RUN_STAMP := $(VENV)/.installed-run
# A CPU-only host: TORCH_INDEX=https://download.pytorch.org/whl/cpu takes torch's CPU wheels
# (under 1 GB installed) instead of PyPI's, which bring the CUDA libraries (about 5 GB). README.
TORCH_INDEX ?=
PIP_INSTALL := $(BIN)/python -m pip install --quiet -c constraints.txt $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))

.PHONY: run test lint setup browser fuzz bench-train bench-predict bench-gpu gpu-smoke compose-test chaos mutation clean

$(RUN_STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(PIP_INSTALL) -e '.[export]'
	touch $(RUN_STAMP)

$(STAMP): $(RUN_STAMP)
	$(PIP_INSTALL) -e '.[dev,bench,export]'
	touch $(STAMP)

# The dashboard's browser test drives Debian's Chromium, never a browser Playwright downloads.
# Skipped when /usr/bin/chromium is there; harmless without apt or root (that one test then skips).
browser:
	@test -x /usr/bin/chromium || ! command -v apt-get >/dev/null || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } || \
	  echo "chromium could not be installed: the dashboard's browser test will skip"

.PHONY: perf-analyzer bench-oip

# Triton's perf_analyzer into .tools/perf_analyzer/ from the package registries (PyPI, Debian), for the
# Open Inference Protocol's test and bench. Best effort: without it only that test skips, saying why.
perf-analyzer: $(STAMP)
	@scripts/install-perf-analyzer.sh || echo "perf_analyzer could not be installed: its test (tests/e2e/test_oip_perf_analyzer.py) will skip"

setup: $(STAMP) browser perf-analyzer

run: $(RUN_STAMP)
	$(BIN)/torchyard up

test: $(STAMP) browser perf-analyzer lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# Lint and import order (ruff), then types (mypy); configured in pyproject.toml.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

# A longer, randomised property-based pass over the whole API (tests/e2e/test_fuzz.py): no 5xx.
FUZZ_EXAMPLES ?= 300
fuzz: $(STAMP)
	TORCHYARD_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) TORCHYARD_FUZZ_RANDOM=1 $(BIN)/python -m pytest tests/e2e/test_fuzz.py -q --timeout=0 $(PYTEST_ARGS)

bench-train: $(STAMP)
	$(BIN)/python bench/train.py

bench-predict: $(STAMP)
	$(BIN)/python bench/predict.py

# The Open Inference Protocol against /predict on the same model and images (bench/oip.py): binary
# FP32, binary BYTES-JPEG and JSON tensors at 1/8/32 concurrent requests, by perf_analyzer and by
# the project's own load client.
bench-oip: $(STAMP) perf-analyzer
	$(BIN)/python bench/oip.py $(BENCH_ARGS)

# Photos end to end (bench/photos.py): upload, two training jobs, /predict at 1/32/128 clients, the
# floors and LitServe in the same run; resnet18 at 224 on a GPU host, its CPU twin elsewhere. No
# set-up here: a GPU host runs it with its own python3 (scripts/gpu-bench.sh, docs/benchmarks.md).
# BENCH_ARGS=--write-docs replaces this host's section of docs/benchmarks.md.
bench-gpu:
	scripts/gpu-bench.sh $(BENCH_ARGS)

gpu-smoke: $(STAMP)
	scripts/gpu-smoke.sh

# Build the image and run docker-compose.yml on a real Docker engine (installed and started here
# when none runs): walk, faults, clean-up. See docs/deployment.md, "Testing the Docker deployment".
compose-test: $(STAMP)
	scripts/compose-test.sh

# The chaos soak (scripts/chaos.py): jobs through the API while the API, workers and Redis are
# killed and frozen at random; fails on any job lost, run twice or with a mismatched checkpoint.
# The long pass by default (>= 200 jobs, >= 50 faults, one 60 s Redis freeze); CHAOS_ARGS to change.
CHAOS_ARGS ?= --jobs 200 --faults 50 --long-redis-outage
chaos: $(STAMP)
	$(BIN)/python scripts/chaos.py $(CHAOS_ARGS)

# The mutation pass (scripts/mutation.py): each guard in scripts/mutation_guards.py broken by one line in
# a copy of the tree, its tests run; fails unless every one is caught by the assertion that names it.
# Not part of `make test`. MUTATION_ARGS=--write-docs puts the result in docs/reliability.md.
mutation: $(STAMP)
	$(BIN)/python scripts/mutation.py $(MUTATION_ARGS)

clean:
	rm -rf $(VENV) var .pytest_cache
