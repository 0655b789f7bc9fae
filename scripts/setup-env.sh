#!/usr/bin/env bash
# Creates .venv (if needed), builds the rvod wheel once (the manylinux2014 wheel of scripts/build-wheels.sh,
# about 4 minutes on 2 cores) and installs it with the dependencies named as arguments. Sourced by the
# other scripts; prints the wheel it installed.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v cargo >/dev/null 2>&1; then
    echo "setup: cargo (the Rust toolchain) is needed to build rvod from source" >&2
    exit 1
fi
VENV=${RVOD_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "maturin>=1.5,<2" "$@"
case "$(uname -m)" in
    x86_64 | aarch64)  # the wheel users get: manylinux2014, built with zig and checked (scripts/build-wheels.sh)
        WHEEL=$(bash scripts/build-wheels.sh --arch native --no-sdist | tail -n 1) ;;
    *)  # no manylinux2014 wheel is made for other machines: a wheel for this system's glibc
        rm -f dist/rvod-*.whl
        "$VENV/bin/python" -m maturin build --release --quiet -o dist >/dev/null
        WHEEL=$(ls dist/rvod-*.whl) ;;
esac
"$VENV/bin/python" -m pip install -q --force-reinstall --no-deps "$WHEEL"
"$VENV/bin/python" -m pip install -q "$WHEEL"
echo "$WHEEL"
