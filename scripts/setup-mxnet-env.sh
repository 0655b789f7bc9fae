#!/usr/bin/env bash
# Creates the MXNet environment .venv-mxnet (MXNet 1.9.1 needs numpy<1.24, which the other frameworks do not
# accept, so it has its own venv) with requirements/mxnet.txt and the rvod wheel, and prints the wheel.
#   bash scripts/setup-mxnet-env.sh [WHEEL]     (RVOD_MXNET_PYTHON: the interpreter, CPython 3.8-3.11)
# The wheel is WHEEL (or $RVOD_WHEEL) when given, else the one in dist/ when there is one (so CI builds the
# extension once), else one built here with maturin (needs cargo). Debian packages: libmxnet.so needs
# libquadmath0 and libgomp1; they are installed with apt-get when missing (as root, or with sudo).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WHEEL=${1:-${RVOD_WHEEL:-}}
if [ -n "$WHEEL" ]; then  # relative to the caller's directory, or else to the repository's
    if [ -f "$WHEEL" ]; then
        WHEEL=$(realpath "$WHEEL")
    elif [ -f "$ROOT/$WHEEL" ]; then
        WHEEL="$ROOT/$WHEEL"
    else
        echo "setup-mxnet-env: no wheel at $WHEEL" >&2
        exit 1
    fi
fi
cd "$ROOT"
VENV=${RVOD_MXNET_VENV:-.venv-mxnet}

if [ "$(uname -s)-$(uname -m)" != "Linux-x86_64" ]; then
    echo "setup-mxnet-env: MXNet 1.9.1 has wheels for Linux x86_64 only (this is $(uname -s)-$(uname -m))" >&2
    exit 1
fi

LIBRARIES=$("$(command -v ldconfig || echo /sbin/ldconfig)" -p)
missing=()
grep -q 'libquadmath\.so\.0 ' <<<"$LIBRARIES" || missing+=(libquadmath0)
grep -q 'libgomp\.so\.1 ' <<<"$LIBRARIES" || missing+=(libgomp1)
if [ ${#missing[@]} -gt 0 ]; then
    echo "setup-mxnet-env: installing ${missing[*]} (needed by libmxnet.so) with apt-get" >&2
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# MXNet 1.9.1 needs numpy 1.23, whose wheels exist for CPython 3.8 to 3.11 only (later ones would build NumPy
# from source, which fails on 3.12+); say so in a sentence rather than as pip's build error.
PYTHON=${RVOD_MXNET_PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
    version=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) || {
        echo "setup-mxnet-env: cannot run $PYTHON (set RVOD_MXNET_PYTHON to a CPython 3.8-3.11)" >&2
        exit 1
    }
    case "$version" in
        3.8 | 3.9 | 3.10 | 3.11) ;;
        *)
            echo "setup-mxnet-env: MXNet 1.9.1 runs on CPython 3.8 to 3.11 (its numpy 1.23 has no wheels for" \
                 "later ones), and $PYTHON is $version; set RVOD_MXNET_PYTHON to a CPython 3.8-3.11" >&2
            exit 1 ;;
    esac
    "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -r requirements/mxnet.txt

if [ -z "$WHEEL" ]; then
    WHEEL=$(ls -t dist/rvod-*.whl 2>/dev/null | head -n 1 || true)
fi
if [ -z "$WHEEL" ]; then
    if ! command -v cargo >/dev/null 2>&1; then
        echo "setup-mxnet-env: cargo (the Rust toolchain) is needed to build rvod from source" >&2
        exit 1
    fi
    "$VENV/bin/python" -m pip install -q "maturin>=1.5,<2"
    "$VENV/bin/python" -m maturin build --release --quiet -o dist >/dev/null
    WHEEL=$(ls -t dist/rvod-*.whl | head -n 1)
fi
# The constraints keep NumPy at the version MXNet needs while rvod's dependencies are installed.
"$VENV/bin/python" -m pip install -q --force-reinstall --no-deps "$WHEEL"
"$VENV/bin/python" -m pip install -q "$WHEEL" -c requirements/mxnet.txt
"$VENV/bin/python" -c "import mxnet, rvod.mxnet" >&2
echo "$WHEEL"
