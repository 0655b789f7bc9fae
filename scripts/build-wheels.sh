#!/usr/bin/env bash
# The release artefacts, built and checked: one abi3 wheel per platform for manylinux2014 (glibc 2.17: Ubuntu
# 18.04+, RHEL/Rocky 7+, Debian 10+), on x86_64 and aarch64, and an sdist, all in dist/. The wheels are
# cross-built here with zig as the C toolchain and linker (ziglang from PyPI, so no container and no older
# system are needed) against glibc 2.17's symbols; aarch64 needs Rust's aarch64 standard library (rustup
# target add, done here when missing). Every artefact is then checked by scripts/check_wheels.py: auditwheel
# (no library outside the manylinux2014 policy), abi3audit (only the stable ABI of CPython 3.10), the wheel's
# tags (cp310-abi3 and manylinux2014 for its architecture, matching the ELF machine of its library) and
# twine check (the metadata PyPI will show).
#   bash scripts/build-wheels.sh [--arch x86_64|aarch64|native|all] [--no-sdist] [--out DIR] [--tools only|skip]
# --tools only installs the build and check tools into the venv and stops; --tools skip assumes they are there
# (scripts/setup-env.sh installs them first, then builds while it installs other packages into the same venv).
# Prints the paths of what it built, one per line (the last line is the last wheel). About 4 minutes per
# architecture on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
ARCHES=(x86_64 aarch64)
SDIST=1
OUT=dist
TOOLS=install
while [ $# -gt 0 ]; do
    case "$1" in
        --arch)
            case "${2:-}" in
                all) ARCHES=(x86_64 aarch64) ;;
                native) ARCHES=("$(uname -m)") ;;
                x86_64 | aarch64) ARCHES=("$2") ;;
                *) echo "build-wheels: --arch takes x86_64, aarch64, native or all (got '${2:-}')" >&2; exit 2 ;;
            esac
            shift 2 ;;
        --no-sdist) SDIST=0; shift ;;
        --out) OUT=${2:?--out needs a directory}; shift 2 ;;
        --tools)
            case "${2:-}" in
                only | skip) TOOLS=$2 ;;
                *) echo "build-wheels: --tools takes only or skip (got '${2:-}')" >&2; exit 2 ;;
            esac
            shift 2 ;;
        *) echo "build-wheels: unknown argument '$1' (see the header of $0)" >&2; exit 2 ;;
    esac
done
for arch in "${ARCHES[@]}"; do
    case "$arch" in
        x86_64 | aarch64) ;;
        *) echo "build-wheels: manylinux2014 wheels are built for x86_64 and aarch64, not $arch" >&2; exit 2 ;;
    esac
done

VENV=${RVOD_VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PYTHON="$VENV/bin/python"
if [ "$TOOLS" != skip ]; then
    "$PYTHON" -m pip install -q "maturin>=1.5,<2" "ziglang>=0.13" "auditwheel>=6" "abi3audit>=0.0.20" "twine>=5" >&2
fi
[ "$TOOLS" = only ] && exit 0

mkdir -p "$OUT"
built=()
for arch in "${ARCHES[@]}"; do
    target="$arch-unknown-linux-gnu"
    if ! rustup target list --installed 2>/dev/null | grep -qx "$target"; then
        echo "build-wheels: adding Rust's standard library for $target (rustup target add)" >&2
        rustup target add "$target" >&2 || {
            echo "build-wheels: rustup could not add $target; the $arch wheel needs it" >&2
            exit 1
        }
    fi
    rm -f "$OUT"/rvod-*-"$arch".whl "$OUT"/rvod-*_"$arch".whl
    echo "build-wheels: building the manylinux2014 $arch wheel with zig" >&2
    PATH="$PWD/$VENV/bin:$PATH" "$PYTHON" -m maturin build --release --quiet --zig --compatibility manylinux2014 \
        --target "$target" -o "$OUT" >&2
    built+=("$(ls -t "$OUT"/rvod-*manylinux2014_"$arch"*.whl | head -n 1)")
done
if [ "$SDIST" -eq 1 ]; then
    rm -f "$OUT"/rvod-*.tar.gz
    "$PYTHON" -m maturin sdist -o "$OUT" >&2
    built=("$(ls -t "$OUT"/rvod-*.tar.gz | head -n 1)" "${built[@]}")
fi
PATH="$PWD/$VENV/bin:$PATH" "$PYTHON" scripts/check_wheels.py "${built[@]}" >&2
printf '%s\n' "${built[@]}"
