#!/usr/bin/env bash
# The one prepared check on a machine with a GPU (issue 30): install a wheel built elsewhere into that
# machine's own Python (which already has PyTorch with CUDA, NCCL's Python package and pytest, and no
# network), run the GPU tests and the GPU benchmark, and write one report.
#
#   bash scripts/gpu-check.sh [WHEEL]        (default: the newest dist/rvod-*.whl)
#
# Environment: PYTHON (default python3), OUT (where the report and logs go; default ./gpu-check-out),
# GPU_CHECK_TEST_TIMEOUT / GPU_CHECK_BENCH_TIMEOUT (seconds; defaults 270 and 180, so the whole check ends
# within 8 minutes and can be run twice in a quarter of an hour). Exit status: that of the tests.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
REPORT="$OUT/gpu-report.md"
WHEEL=${1:-$(ls -t dist/rvod-*.whl 2>/dev/null | head -n 1)}
if [ -z "$WHEEL" ] || [ ! -f "$WHEEL" ]; then
    echo "gpu-check: no wheel given and none in dist/ (build one with: maturin build --release -o dist)" >&2
    exit 2
fi

SITE=$(mktemp -d /tmp/rvod-gpu-site.XXXXXX)
trap 'rm -rf "$SITE"' EXIT
"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEEL" || {
    echo "gpu-check: pip could not install $WHEEL into $SITE" >&2
    exit 2
}
# The GPU machine has pytest but maybe not pytest-timeout (no network there): dist/extra may carry its wheel.
if ! "$PYTHON" -c "import pytest_timeout" 2>/dev/null; then
    for extra in dist/extra/pytest_timeout-*.whl; do
        [ -f "$extra" ] && "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$extra"
    done
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

section() { printf '\n## %s\n\n```\n' "$1" >>"$REPORT"; }
end_section() { printf '```\n' >>"$REPORT"; }

{
    echo "# rvod GPU check"
    echo
    echo "- date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "- wheel: $(basename "$WHEEL")"
    echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
} >"$REPORT"

section "machine"
{
    nvidia-smi -L 2>&1 || echo "nvidia-smi: not available"
    "$PYTHON" - <<'EOF' 2>&1
import sys
print("python", sys.version.split()[0])
try:
    import torch
    print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
          "devices", torch.cuda.device_count(), "nccl", ".".join(map(str, torch.cuda.nccl.version())))
except Exception as error:  # noqa: BLE001 - the report says what is missing
    print("torch:", error)
import rvod
print("rvod", rvod.__version__, "from", rvod.__file__)
EOF
} >>"$REPORT"
end_section

section "rvodrun --check-build"
timeout 60 "$PYTHON" -m rvod.runner --check-build >>"$REPORT" 2>&1
end_section

section "GPU tests"
started=$SECONDS
timeout "${GPU_CHECK_TEST_TIMEOUT:-270}" "$PYTHON" -m pytest tests/python/test_gpu*.py -q -p no:cacheprovider \
    -o addopts="" -rfEs --timeout 120 2>&1 | tee "$OUT/gpu-tests.log" | tail -n 60 >>"$REPORT"
tests_status=${PIPESTATUS[0]}
echo "(exit $tests_status after $((SECONDS - started)) s; the whole log is gpu-tests.log)" >>"$REPORT"
end_section

section "GPU benchmark"
started=$SECONDS
if [ -f benches/gpu_allreduce.py ]; then
    timeout "${GPU_CHECK_BENCH_TIMEOUT:-180}" "$PYTHON" benches/gpu_allreduce.py --out "$OUT/gpu-bench.json" \
        >>"$REPORT" 2>&1
    echo "(exit $? after $((SECONDS - started)) s)" >>"$REPORT"
else
    echo "benches/gpu_allreduce.py is not in this tree" >>"$REPORT"
fi
end_section

echo "gpu-check: report in $REPORT (tests exit $tests_status)"
exit "$tests_status"
