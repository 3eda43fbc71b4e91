# Two entry points for a fresh machine (Python >= 3.10 and pip only):
#   make demo   - install into .venv, then train TinyGPT on 2 CPU processes (gloo)
#   make test   - install into .venv with the test extra, then lint (make lint) and run the whole test suite
# CPU-only machines get the CPU build of torch (TORCH_SPEC); a range would pull a
# multi-GB CUDA build. Override on GPU machines: make demo TORCH_SPEC=torch==2.14.1

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: demo lint test test-fast test-versions install clean gpu-wheels slurm-daemons

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

# Bytecode first: where PYTHONDONTWRITEBYTECODE is set (as on this machine), every process the suite starts would
# otherwise compile the package again (about 1 s of each start-up here); pip compiled the dependencies.
# Two workers: a multi-process test spends much of its time starting processes one after another (Lightning
# starts rank 1 once rank 0 has imported everything) and waiting for them, which leaves a core idle.
# One intra-op thread per process: two workers share two cores, and torch's default (a thread per core in every
# process, the ranks each test starts included) made them wait on each other's threads: 739 s, with one 685 s.
test: lint slurm-daemons
	$(BIN)/python -m compileall -q lightning_fastdist tests
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2 --durations=15

# The daemons of tests/slurm (a real SLURM cluster on this machine): Debian's slurm-wlm and munge, installed where they
# are missing and this is root with apt-get (as on CI). Elsewhere nothing is installed and those tests skip, each with
# one line saying why. The packages start no daemon and write no configuration the tests read (tests/slurm/conftest.py).
slurm-daemons:
	@missing=$$(for tool in munged slurmctld slurmd sbatch; do command -v $$tool >/dev/null || echo $$tool; done); \
	if [ -n "$$missing" ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing slurm-wlm and munge (apt-get) for tests/slurm"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null; \
	fi

# One process, no network namespaces: what the markers in pyproject.toml say takes long or needs root is left out.
test-fast: install
	$(BIN)/python -m pytest -q -m "not slow and not multiprocess and not emulated"

# The other end of the versions pyproject.toml claims, in a second virtual environment: the newest torch with the
# oldest Lightning (make test runs the oldest torch with the newest Lightning), on the contract matrix and the checks
# that every private Lightning name and internal we use exists there. .ci/run runs it after make test. torch 2.14.1
# is a CUDA build of several GB: quick where a copy lies on disk (as on CI), a long download elsewhere.
VERSIONS_VENV ?= .venv-versions
VERSIONS_TORCH_SPEC ?= torch==2.14.1
VERSIONS_LIGHTNING_SPEC ?= lightning==2.6.0
VERSIONS_BIN := $(VERSIONS_VENV)/bin

$(VERSIONS_BIN)/python:
	$(PYTHON) -m venv $(VERSIONS_VENV)
	$(VERSIONS_BIN)/python -m pip install -qq --upgrade pip

test-versions: $(VERSIONS_BIN)/python
	$(VERSIONS_BIN)/pip install -qq "$(VERSIONS_TORCH_SPEC)"
	$(VERSIONS_BIN)/pip install -qq -e ".[test]" "$(VERSIONS_LIGHTNING_SPEC)"
	$(VERSIONS_BIN)/python -c 'import torch, lightning; print("torch", torch.__version__, "lightning", lightning.__version__)'
	$(VERSIONS_BIN)/python -m pytest -q tests/contract tests/project/test_lightning_private_names.py \
		tests/callbacks/test_sync_free_logging.py::test_the_lightning_internals_we_patch_exist_in_the_installed_version

clean:
	rm -rf $(VENV) $(VERSIONS_VENV) lightning_logs build *.egg-info .pytest_cache

# The wheels a GPU machine without network lacks, for its python3 3.12 on x86-64 Linux (its own torch
# stays): DeepSpeed (built here from its source: pure Python), pydantic, jsonargparse and their needs,
# at the versions this .venv runs. benchmarks/gpu_check.sh installs them there with pip --no-index.
GPU_WHEELS ?= .gpu-wheels
GPU_WHEEL_PACKAGES := pydantic pydantic-core annotated-types typing-inspection typing-extensions hjson \
	jsonargparse docstring-parser typeshed-client torchao
VERSIONS_OF = $(BIN)/python -c 'import importlib.metadata as m, sys; print(*(f"{n}=={m.version(n)}" for n in sys.argv[1:]))'
gpu-wheels: install
	mkdir -p $(GPU_WHEELS) && rm -f $(GPU_WHEELS)/*.whl
	$(BIN)/python -m pip wheel -q --no-deps --no-build-isolation -w $(GPU_WHEELS) $$($(VERSIONS_OF) deepspeed)
	$(BIN)/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d $(GPU_WHEELS) $$($(VERSIONS_OF) $(GPU_WHEEL_PACKAGES))
	@ls $(GPU_WHEELS)
