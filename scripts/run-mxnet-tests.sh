#!/usr/bin/env bash
# The MXNet tests: makes .venv-mxnet (scripts/setup-mxnet-env.sh) and runs tests/python/test_mxnet_*.py in it,
# against the installed wheel, never the source tree. Run from a fresh clone: bash scripts/run-mxnet-tests.sh
#   bash scripts/run-mxnet-tests.sh [WHEEL] [PYTEST ARGS...]
# WHEEL (or $RVOD_WHEEL) is a wheel already built, e.g. by scripts/run-tests.sh; without one, the wheel in
# dist/ is used, or one is built.
set -euo pipefail
SETUP_ARGS=()
if [ $# -gt 0 ] && [[ "$1" == *.whl ]]; then
    SETUP_ARGS=("$1")
    shift
fi
WHEEL=$(bash "$(dirname "$0")/setup-mxnet-env.sh" "${SETUP_ARGS[@]}" | tail -n 1)
cd "$(dirname "$0")/.."
VENV=${RVOD_MXNET_VENV:-.venv-mxnet}

echo "== pytest, MXNet environment (wheel: $WHEEL)"
cd tests
PATH="$PWD/../$VENV/bin:$PATH" MXNET_SUBGRAPH_VERBOSE=0 \
    "../$VENV/bin/python" -m pytest python/test_mxnet_*.py python/test_docs_site.py -k "mxnet" -q -rs -p no:cacheprovider "$@"
