#!/usr/bin/env bash
# The main job: build and install rvod (with scikit-learn and PyTorch), then train a small CNN on
# scikit-learn's digits data on two ranks with rvod.torch, Horovod-style. Run from a fresh clone: bash scripts/run-example.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh scikit-learn >/dev/null
VENV=${RVOD_VENV:-.venv}
# PyTorch's CPU build unless RVOD_TORCH=cuda (scripts/install-torch.sh says which it installs, and why).
bash scripts/install-torch.sh "$VENV/bin/python"
PATH="$PWD/$VENV/bin:$PATH" rvodrun -np 2 python examples/torch_digits.py
