#!/usr/bin/env bash
# The main job: build and install rvod (with PyTorch), then train a small CNN on scikit-learn's digits data
# on two ranks with rvod.torch, Horovod-style. Run from a fresh clone: bash scripts/run-example.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh scikit-learn torch >/dev/null
VENV=${RVOD_VENV:-.venv}
PATH="$PWD/$VENV/bin:$PATH" rvodrun -np 2 python examples/torch_digits.py
