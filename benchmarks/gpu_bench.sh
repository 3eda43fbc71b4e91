#!/usr/bin/env bash
# bench's single-GPU rows, a sweep of the levers of a fast step and a profile of the best, in one command on a GPU
# machine with no network access needed: the machine's own python3 and torch, this working tree on PYTHONPATH, and
# the wheels of what the machine lacks (jsonargparse for the CLI each run starts, torchao for fp8), prepared elsewhere
# by `make gpu-wheels` into .gpu-wheels/. Nothing is fetched: pip runs with --no-index only. From the repository root:
#
#   bash benchmarks/gpu_bench.sh [--out DIR] [--budget-s S] [--levers a,b] [--best JSON] [--no-rows]
#
# Writes DIR/gpu_bench.json, gpu_bench.png, gpu_bench.log, recipe_best.yaml, best.trace.json.gz and best.ops.txt
# (default DIR: bench_results/gpu_bench), rewritten as runs end; prints a line per run. docs/gpu.md says more.
# Environment: PYTHON (default python3), GPU_WHEELS (default .gpu-wheels), GPU_SITE (where the wheels are unpacked,
# default /tmp/lightning-fastdist-gpu-site).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WHEELS=${GPU_WHEELS:-.gpu-wheels}
SITE=${GPU_SITE:-/tmp/lightning-fastdist-gpu-site}

if compgen -G "$WHEELS/*.whl" >/dev/null; then
    "$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "$WHEELS"/*.whl
else
    echo "no wheels in $WHEELS: the runs need jsonargparse (make gpu-wheels prepares it), fp8 needs torchao" >&2
fi
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
exec "$PYTHON" benchmarks/gpu_bench.py "$@"
