#!/usr/bin/env bash
# The MXNet tests: makes .venv-mxnet (scripts/setup-mxnet-env.sh) and runs tests/python/test_mxnet_*.py in it,
# against the installed wheel, never the source tree. Run from a fresh clone: bash scripts/run-mxnet-tests.sh
#   bash scripts/run-mxnet-tests.sh [WHEEL] [PYTEST ARGS...]
# WHEEL (or $RVOD_WHEEL) is a wheel already built, e.g. by scripts/run-tests.sh; without one, the wheel in
# dist/ is used, or one is built.
set -euo pipefail
WHEEL_ARG=${RVOD_WHEEL:-}
if [ $# -gt 0 ] && [[ "$1" == *.whl ]]; then
    WHEEL_ARG=$(realpath "$1")
    shift
fi
cd "$(dirname "$0")/.."
WHEEL=$(bash scripts/setup-mxnet-env.sh ${WHEEL_ARG:+"$WHEEL_ARG"} | tail -n 1)
VENV=${RVOD_MXNET_VENV:-.venv-mxnet}

echo "== pytest, MXNet environment (wheel: $WHEEL)"
cd tests
PATH="$PWD/../$VENV/bin:$PATH" MXNET_SUBGRAPH_VERBOSE=0 \
    "../$VENV/bin/python" -m pytest python/test_mxnet_*.py -q -p no:cacheprovider "$@"
