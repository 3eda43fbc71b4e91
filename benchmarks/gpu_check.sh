#!/usr/bin/env bash
# All GPU-only checks in a few minutes, for a lent GPU machine (one H100/H200-class GPU).
# Run from the repository root:  bash benchmarks/gpu_check.sh
# It installs the package into .venv with the CUDA build of torch, prints the environment
# (`lightning-fastdist doctor` when it exists), then runs benchmarks/gpu_check.py.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv-gpu
.venv-gpu/bin/pip install --quiet --upgrade pip
.venv-gpu/bin/pip install --quiet torch -e ".[test]"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
.venv-gpu/bin/lightning-fastdist doctor 2>/dev/null || true
timeout 480 .venv-gpu/bin/python benchmarks/gpu_check.py --steps 60
