#!/usr/bin/env bash
# The house rules that machines keep, run by scripts/run-tests.sh before the tests (about two minutes on
# CI's 2 cores, most of it clippy compiling): rustfmt (rustfmt.toml), clippy with warnings as errors (and no
# unwrap/expect in library code: src/lib.rs denies them outside unit tests), ruff (pyproject.toml's
# [tool.ruff]) and DESIGN.md's import rules and Rust layers (tests/python/test_house_rules.py, test_rust_layers.py).
#   bash scripts/check-house.sh [PYTHON]   (PYTHON: an interpreter with ruff and pytest; default .venv's)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${1:-${RVOD_VENV:-.venv}/bin/python}

echo "== house rules: rustfmt"
cargo fmt --check >/dev/null || { echo "rustfmt: these files are not formatted (run cargo fmt):"; cargo fmt -- --check -l; exit 1; }
echo "== house rules: clippy"
# One pass: src/lib.rs denies unwrap/expect in the library outside its unit tests.
cargo clippy --quiet --all-targets --features python -- -D warnings
echo "== house rules: ruff"
"$PYTHON" -m ruff check --quiet python tests benches examples
echo "== house rules: imports"
"$PYTHON" -m pytest -q -p no:cacheprovider tests/python/test_house_rules.py tests/python/test_rust_layers.py | tail -n 1
