#!/usr/bin/env bash
# The main job: build and install rvod, then train a small network on scikit-learn's digits data on two
# ranks with rvod.numpy. Run from a fresh clone: bash scripts/run-example.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh scikit-learn >/dev/null
VENV=${RVOD_VENV:-.venv}
PATH="$PWD/$VENV/bin:$PATH" rvodrun -np 2 python examples/numpy_digits.py
