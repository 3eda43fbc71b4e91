# Two entry points for a fresh machine (Python >= 3.10 and pip only):
#   make demo   - install into .venv, then train TinyGPT on 2 CPU processes (gloo)
#   make test   - install into .venv with the test extra, then lint (make lint) and run the whole test suite
# CPU-only machines get the CPU build of torch (TORCH_SPEC); a range would pull a
# multi-GB CUDA build. Override on GPU machines: make demo TORCH_SPEC=torch

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: demo lint test test-fast install clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -qq --upgrade pip

install: $(BIN)/python  # -qq: errors only (setuptools warns about every editable install)
	$(BIN)/pip install -qq "$(TORCH_SPEC)"
	$(BIN)/pip install -qq -e ".[test]"

# The progress bar and the final numbers only: Lightning's informational lines are hidden.
demo: install
	LIGHTNING_FASTDIST_QUIET=1 $(BIN)/lightning-fastdist fit --config cpu_smoke

# ruff's rules and line length are in pyproject.toml; the formatter's output is the project's layout.
lint: install
	$(BIN)/ruff check lightning_fastdist tests benchmarks
	$(BIN)/ruff format --check lightning_fastdist tests benchmarks

test: lint
	$(BIN)/python -m pytest -q --durations=15

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) lightning_logs build *.egg-info .pytest_cache
