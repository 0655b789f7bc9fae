#!/usr/bin/env bash
# Run after scripts/gpu-check.sh on a GPU machine (it uses the same PYTHONPATH and OUT): the synthetic training
# benchmark on CUDA, 1 rank and 2 ranks sharing the GPU (plain, then fp16 compression with Adasum), each with
# a time limit, appended to the report.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-$PWD/gpu-check-out}
REPORT="$OUT/gpu-report.md"
SITE=$(mktemp -d /tmp/rvod-gpu-site.XXXXXX)
trap 'rm -rf "$SITE"' EXIT
"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$(ls -t dist/rvod-*.whl | head -n 1)"
export PYTHONPATH="$SITE" PYTHONUNBUFFERED=1
ARGS=(--num-warmup-batches 3 --num-batches-per-iter 5 --num-iters 3 --batch-size 64)
printf '\n## Synthetic training benchmark on CUDA\n\n```\n' >>"$REPORT"
for job in "1" "2" "2 --fp16-allreduce --use-adasum"; do
    set -- $job
    ranks=$1; shift
    echo "### -np $ranks $*" >>"$REPORT"
    timeout 120 "$PYTHON" -m rvod.runner -np "$ranks" --log-level INFO "$PYTHON" examples/torch_synthetic_benchmark.py \
        "${ARGS[@]}" "$@" 2>&1 | grep -E "Model:|Img/sec|Total img|GPU|rror|rvodrun:" | tail -n 20 >>"$REPORT"
    echo "(exit ${PIPESTATUS[0]})" >>"$REPORT"
done
printf '```\n' >>"$REPORT"
