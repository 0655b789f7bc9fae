#!/usr/bin/env bash
# The long chaos soak (issue 37): tests/python/test_chaos.py with 100 faults (or $1) from seed $2 (default
# 20261129), writing its summary to bench-out/chaos-soak.json; docs/chaos.md keeps the last report. Needs
# root (network namespaces), an sshd and iproute2, as the multi-host tests do; about 15 s per fault here.
#   bash scripts/chaos-soak.sh [FAULTS] [SEED]
set -euo pipefail
cd "$(dirname "$0")/.."
FAULTS=${1:-100}
SEED=${2:-20261129}
VENV=${RVOD_VENV:-.venv}
mkdir -p bench-out
# A folder of its own: pytest keeps only its last three run folders, and another pytest started on this machine
# during the soak would delete the one the job writes to.
BASETEMP=$(mktemp -d /tmp/rvod-chaos-soak.XXXXXX)
cd tests
RVOD_CHAOS_FAULTS=$FAULTS RVOD_CHAOS_SEED=$SEED RVOD_CHAOS_REPORT="$PWD/../bench-out/chaos-soak.json" \
    PATH="$PWD/../$VENV/bin:$PATH" "../$VENV/bin/python" -m pytest python/test_chaos.py -q -s -p no:cacheprovider --basetemp "$BASETEMP" \
    | grep -v '^\[' || { echo "chaos-soak: the soak failed (its output above names the fault and the invariant)" >&2; exit 1; }
echo "chaos-soak: summary in bench-out/chaos-soak.json"
