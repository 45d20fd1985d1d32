# Quick start: `make run` (set-up + the embedded stack) and `make test` (set-up + the whole suite).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run test setup fuzz bench-train bench-predict gpu-smoke clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev,bench]'
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(BIN)/torchyard up

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

bench-train: $(STAMP)
	$(BIN)/python bench/train.py

bench-predict: $(STAMP)
	$(BIN)/python bench/predict.py

gpu-smoke: $(STAMP)
	scripts/gpu-smoke.sh

clean:
	rm -rf $(VENV) var .pytest_cache
