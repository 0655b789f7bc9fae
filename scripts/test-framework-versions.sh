#!/usr/bin/env bash
# Runs rvod's framework tests against the oldest supported and the newest release of PyTorch, TensorFlow
# (tensorflow-cpu with Keras 3) and JAX (with optax), each in a throwaway virtual environment of its own
# (python3 -m venv under a temporary folder, packages from PyPI, removed after its run), one at a time, and
# prints a table of the versions installed and the tests passed, failed and skipped (also written to REPORT).
#   bash scripts/test-framework-versions.sh [--report FILE] [WHEEL] [ENV...]
# ENV picks environments by name (torch-oldest torch-newest tensorflow-oldest tensorflow-newest jax-oldest
# jax-newest; all by default).
#
# The versions come from pyproject.toml's extras, so they follow its floors: "newest" installs the extra as
# written (pip takes the newest release), "oldest" pins each requirement of the extra to its floor's release
# (torch>=2.2 becomes torch==2.2.*: that release's last patch). PyTorch before 2.3 was built against NumPy 1,
# so the oldest PyTorch environment also gets numpy<2.
#
# rvod comes from WHEEL (or $RVOD_WHEEL) when given, installed with its dependencies as users install it;
# without one, from the checkout: its dependencies (pyproject.toml) are installed and the tests import
# python/rvod with the native module built there (maturin develop), which must exist.
#
# The tests, per framework (pytest's timeouts bound every job; each environment's run takes minutes):
# - torch: test_torch_collectives, test_torch_training, test_torch_compile, test_torch_examples, and the
#   torch cases of test_collectives (every op x dtype x variant on 2 and 3 ranks);
# - tensorflow: test_tensorflow_ops, test_tensorflow_graph, test_keras_training, test_keras_sharded, and the
#   tensorflow cases of test_collectives;
# - jax: test_jax and the jax cases of test_collectives.
# Each also has the test extra (pytest, pytest-timeout, scikit-learn). Set-up failures count as failures.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
REPORT="$ROOT/dist/framework-versions.md"
WHEEL=${RVOD_WHEEL:-}
SELECTED=()
while [ $# -gt 0 ]; do
    case "$1" in
        --report) REPORT=$(realpath -m "$2"); shift 2 ;;
        *.whl) WHEEL=$(realpath "$1"); shift ;;
        *) SELECTED+=("$1"); shift ;;
    esac
done
if [ -n "$WHEEL" ] && [ ! -f "$WHEEL" ]; then
    echo "test-framework-versions: no wheel at $WHEEL" >&2
    exit 1
fi
if [ -z "$WHEEL" ] && ! ls "$ROOT"/python/rvod/_rvod*.so >/dev/null 2>&1; then
    echo "test-framework-versions: give a wheel, or build the native module first (maturin develop)" >&2
    exit 1
fi

# What pyproject.toml says: a framework's extra, as written (newest) or pinned to its floors (oldest).
requirements() {  # requirements EXTRA oldest|newest
    python3 - "$ROOT/pyproject.toml" "$1" "$2" <<'EOF'
import re, sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
extra, which = sys.argv[2], sys.argv[3]
wanted = project["dependencies"] if extra == "rvod" else project["optional-dependencies"][extra]
for requirement in wanted:
    floor = re.fullmatch(r"([A-Za-z0-9_.\[\]-]+)>=([0-9.]+)(,.*)?", requirement)
    if which == "oldest" and floor:
        print(f"{floor.group(1)}=={floor.group(2)}.*")
    else:
        print(requirement)
EOF
}

declare -A TESTS=(
    [torch]="python/test_torch_collectives.py python/test_torch_training.py python/test_torch_compile.py python/test_torch_examples.py python/test_collectives.py"
    [tensorflow]="python/test_tensorflow_ops.py python/test_tensorflow_graph.py python/test_keras_training.py python/test_keras_sharded.py python/test_collectives.py"
    [jax]="python/test_jax.py python/test_collectives.py"
)
# What each framework's environment imports to say its versions.
declare -A MODULES=([torch]="torch numpy" [tensorflow]="tensorflow keras numpy" [jax]="jax jaxlib optax numpy")
ALL=(torch-oldest torch-newest tensorflow-oldest tensorflow-newest jax-oldest jax-newest)
[ ${#SELECTED[@]} -gt 0 ] || SELECTED=("${ALL[@]}")

WORK=$(mktemp -d "${TMPDIR:-/tmp}/rvod-versions.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$(dirname "$REPORT")"
COMMIT=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)
DIRTY=$(git -C "$ROOT" status --porcelain --untracked-files=no 2>/dev/null | grep -q . && echo " (with changes)" || true)
ROWS=()

run_env() {  # run_env FRAMEWORK WHICH: prints one table row
    local framework=$1 which=$2 venv="$WORK/$1-$2" start=$SECONDS install_s versions counts
    local -a packages
    mapfile -t packages < <(requirements "$framework" "$which"; requirements test newest)
    [ "$framework/$which" != "torch/oldest" ] || packages+=("numpy<2")
    echo "== $framework-$which: ${packages[*]}" >&2
    python3 -m venv "$venv"
    local pip=("$venv/bin/python" -m pip install -q --no-cache-dir --disable-pip-version-check)
    local pythonpath=""
    if ! { if [ -n "$WHEEL" ]; then "${pip[@]}" "$WHEEL" "${packages[@]}"
           else mapfile -t rvod_deps < <(requirements rvod newest)
                "${pip[@]}" "${rvod_deps[@]}" "${packages[@]}"; pythonpath="$ROOT/python"; fi; } >&2; then
        echo "| $framework | $which | (pip install failed: ${packages[*]}) | 0 | 1 | 0 | $((SECONDS - start)) s | - |"
        rm -rf "$venv"
        return
    fi
    install_s=$((SECONDS - start))
    versions=$("$venv/bin/python" -c "
import importlib.metadata as m
names = {'tensorflow': 'tensorflow-cpu'}
print(', '.join(f'{n} {m.version(names.get(n, n))}' for n in '${MODULES[$framework]}'.split()))")
    start=$SECONDS
    # The other frameworks' collective cases are deselected (their module imports none of them anyway).
    (cd "$ROOT/tests" && PATH="$venv/bin:$PATH" PYTHONPATH="$pythonpath" timeout 3600 "$venv/bin/python" -m pytest \
        ${TESTS[$framework]} -k "not test_collective or $framework" -q -rfEs -p no:cacheprovider \
        --junitxml="$WORK/$framework-$which.xml" >&2) || true
    counts=$("$venv/bin/python" - "$WORK/$framework-$which.xml" <<'EOF'
import sys, xml.etree.ElementTree as ET
try:
    suites = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError):
    print("0 | 1 | 0")  # pytest wrote no report: it was killed or could not start
    sys.exit()
suites = [suites] if suites.tag == "testsuite" else list(suites)
total, failed, skipped = (sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "skipped"))
failed += sum(int(s.get("errors", 0)) for s in suites)
print(f"{total - failed - skipped} | {failed} | {skipped}")
EOF
)
    echo "| $framework | $which | $versions | $counts | $install_s s | $((SECONDS - start)) s |"
    rm -rf "$venv"
}

for name in "${SELECTED[@]}"; do
    framework=${name%-*}
    which=${name##*-}
    if [ -z "${TESTS[$framework]:-}" ] || [[ "$which" != oldest && "$which" != newest ]]; then
        echo "test-framework-versions: unknown environment $name (known: ${ALL[*]})" >&2
        exit 1
    fi
    ROWS+=("$(run_env "$framework" "$which")")
    df -h "$WORK" | tail -n 1 >&2
done

{
    echo "rvod $COMMIT$DIRTY, $(date -u +%Y-%m-%d), Python $(python3 -c 'import platform; print(platform.python_version())'), rvod from ${WHEEL:-the checkout (python/ and its built module)}"
    echo
    echo "| framework | release | installed | passed | failed | skipped | install | tests |"
    echo "|---|---|---|---|---|---|---|---|"
    printf '%s\n' "${ROWS[@]}"
} | tee "$REPORT"
echo "(written to $REPORT)" >&2
! printf '%s\n' "${ROWS[@]}" | awk -F'|' '$6 + 0 > 0 { bad = 1 } END { exit !bad }'
