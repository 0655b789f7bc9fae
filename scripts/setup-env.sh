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
"$VENV/bin/python" -m pip install -q "maturin>=1.5,<2"
case "$(uname -m)" in
    x86_64 | aarch64)  # the wheel users get: manylinux2014, built with zig and checked (scripts/build-wheels.sh)
        # The build (CPU) runs while pip fetches and unpacks the dependencies (network and disk).
        bash scripts/build-wheels.sh --tools only
        BUILD_LOG=$(mktemp)
        BUILT=$(mktemp)
        bash scripts/build-wheels.sh --arch native --no-sdist --tools skip >"$BUILT" 2>"$BUILD_LOG" &
        BUILD=$!
        trap 'kill $BUILD 2>/dev/null || true' EXIT  # a failed pip install stops the build too
        [ $# -eq 0 ] || "$VENV/bin/python" -m pip install -q "$@"
        if ! wait "$BUILD"; then
            cat "$BUILD_LOG" >&2
            echo "setup: building the wheel failed (scripts/build-wheels.sh, output above)" >&2
            exit 1
        fi
        trap - EXIT
        cat "$BUILD_LOG" >&2
        WHEEL=$(tail -n 1 "$BUILT")
        rm -f "$BUILD_LOG" "$BUILT" ;;
    *)  # no manylinux2014 wheel is made for other machines: a wheel for this system's glibc
        [ $# -eq 0 ] || "$VENV/bin/python" -m pip install -q "$@"
        rm -f dist/rvod-*.whl
        "$VENV/bin/python" -m maturin build --release --quiet -o dist >/dev/null
        WHEEL=$(ls dist/rvod-*.whl) ;;
esac
"$VENV/bin/python" -m pip install -q --force-reinstall --no-deps "$WHEEL"
"$VENV/bin/python" -m pip install -q "$WHEEL"
echo "$WHEEL"
