#!/usr/bin/env bash
# Everything CI runs: the house rules (scripts/check-house.sh), the Rust unit and in-process collective tests,
# then the Python tests against the wheel users install (built once, installed in .venv).
# Run from a fresh clone: bash scripts/run-tests.sh
set -euo pipefail
cd "$(dirname "$0")/.."
# Each stage says how long it took (bash's SECONDS), so a CI log shows where the time goes.
stage_done() { echo "== $1 took $((SECONDS - STAGE_START)) s"; STAGE_START=$SECONDS; }
STAGE_START=$SECONDS
bash scripts/setup-system.sh
WHEEL=$(bash scripts/setup-env.sh pytest pytest-timeout scikit-learn torch "tensorflow-cpu==2.21.*" "keras>=3.3" mpi4py "ray[train]" pyspark pyarrow pandas "jax[cpu]" optax ruff mypy "mkdocs>=1.6,<2" "mkdocs-material>=9.5,<10" "mkdocstrings[python]>=0.29,<2" | tail -n 1)
VENV=${RVOD_VENV:-.venv}

stage_done "set-up (Debian packages, .venv, wheel)"

bash scripts/check-house.sh "$VENV/bin/python"
stage_done "house rules"

echo "== cargo test"
cargo test --quiet 2>&1 | grep -v '^$'
stage_done "cargo test"

echo "== pytest (wheel: $WHEEL)"
# The tests import the installed wheel, never the source tree.
cd tests
PATH="$PWD/../$VENV/bin:$PATH" RVOD_TEST_WHEEL="$PWD/../$WHEEL" \
    "../$VENV/bin/python" -m pytest python -q -rs --durations=25 -p no:cacheprovider "$@"
stage_done "pytest"

echo "== MXNet (its own environment: MXNet 1.9.1 needs numpy<1.24)"
cd ..
bash scripts/run-mxnet-tests.sh "$WHEEL"
stage_done "MXNet tests"
echo "== all stages took $SECONDS s"
