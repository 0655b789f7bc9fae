#!/usr/bin/env bash
# The full benchmark run whose medians the README and docs/performance.md quote (issue 36 item 5): every
# benchmark in benches/ that a figure there comes from, one after the other, on a machine with nothing else
# running. Each one's output goes to OUT/<name>.log (and its own files to OUT/<name>/); OUT/manifest.json says
# what ran where: the commit, the date, the machine, the versions, each benchmark's command, exit status,
# seconds and the load average before and after it, so a figure can be traced to the run it came from.
#   bash scripts/run-benchmarks.sh [--out DIR] [--only name,name] [--skip name,name] [--list]
# About 27 minutes on the project's 2-core VM with --skip autotune,scale_fit (their two: about 25 more). Needs root for the two-host benchmarks (network namespaces), as
# the multi-host tests do. Settings differ from the defaults only where a benchmark says so (its docstring and
# docs/performance.md name the setting and why).
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${RVOD_VENV:-.venv}
PY="$PWD/$VENV/bin/python"
export PATH="$PWD/$VENV/bin:$PATH"
OUT="bench-out/full-$(date -u +%Y%m%d-%H%M)"
ONLY=""
SKIP=""
LIST=0
while [ $# -gt 0 ]; do
    case "$1" in
        --out) OUT=$2; shift 2 ;;
        --only) ONLY=",$2,"; shift 2 ;;
        --skip) SKIP=",$2,"; shift 2 ;;
        --list) LIST=1; shift ;;
        *) echo "run-benchmarks: unknown argument $1 (try --out DIR, --only a,b, --skip a,b or --list)" >&2; exit 2 ;;
    esac
done

# name | seconds it may take | command (OUT_DIR stands for OUT/<name>)
BENCHES=(
    "collectives|1500|$PY benches/collectives.py --impls rvod-shm,rvod-tcp,mpi,gloo --rounds 5 --out OUT_DIR"
    "torch_training|900|rvodrun -np 2 $PY benches/torch_training.py --rounds 7"
    "keras_step|600|rvodrun -np 2 $PY benches/keras_step.py --rounds 15"
    "jax_training|600|rvodrun -np 2 $PY benches/jax_training.py --rounds 7"
    "torch_compile_training|900|rvodrun -np 2 $PY benches/torch_compile_training.py --rounds 5"
    "adasum|300|rvodrun -np 2 $PY benches/adasum.py"
    "timeline_cost|600|env RVOD_TIMELINE=DYNAMIC RVOD_CACHE_CAPACITY=2048 rvodrun -np 2 $PY benches/timeline_cost.py --rounds 6 --out OUT_DIR"
    "elastic_recovery|1200|$PY benches/elastic_recovery.py --kills 10 --adds 3"
    "hosts_allreduce|1500|$PY benches/hosts_allreduce.py --rates 2gbit,10gbit --rounds 3 --out OUT_DIR"
    "hosts_ucx|1200|$PY benches/hosts_ucx.py --rates 10gbit --rounds 3 --out OUT_DIR"
    "sharded_optimizer|1200|$PY benches/sharded_optimizer.py --ranks 2 4 --rounds 3"
    "reducescatter_burst|600|$PY benches/reducescatter_burst.py --np 2 --rounds 3"
    "cluster_step|900|$PY benches/cluster_step.py --rounds 3"
    "compression|1800|$PY benches/compression.py --rounds 3 --out OUT_DIR"
    "autotune|1500|$PY benches/autotune.py --out OUT_DIR"
    "scale_fit|900|$PY benches/scale_fit.py --out OUT_DIR"
)

if [ "$LIST" = 1 ]; then
    for b in "${BENCHES[@]}"; do echo "${b%%|*}"; done
    exit 0
fi
# The plots (collectives, hosts_allreduce) need matplotlib, which the test set-up does not install.
"$PY" -c "import matplotlib" 2>/dev/null || "$PY" -m pip install -q matplotlib
mkdir -p "$OUT"
MANIFEST="$OUT/manifest.jsonl"
: >"$MANIFEST"
"$PY" - "$OUT" <<'EOF'
import json, os, platform, subprocess, sys, datetime
out = sys.argv[1]
def run(*cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout.strip()
    except Exception as e:  # the manifest records what could not be read, the run goes on
        return f"unavailable ({e})"
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
from importlib import metadata
versions = {}
for dist in ("numpy", "torch", "tensorflow-cpu", "keras", "jax", "mpi4py", "ray", "pyspark", "rvod"):
    try:
        versions[dist] = metadata.version(dist)
    except metadata.PackageNotFoundError:
        versions[dist] = "not installed"
import rvod._rvod as ext
info = {
    "commit": run("git", "rev-parse", "HEAD"),
    "dirty": bool(run("git", "status", "--porcelain", "--untracked-files=no")),
    "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "machine": {"cpu": cpu, "cores": os.cpu_count(),
                "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
                "kernel": platform.release()},
    "python": platform.python_version(), "versions": versions,
    "rvod_extension": ext.__file__,
    "mpirun": run("mpirun", "--version").splitlines()[0] if run("which", "mpirun") else "absent",
}
json.dump(info, open(os.path.join(out, "machine.json"), "w"), indent=1)
print(f"run-benchmarks: commit {info['commit'][:10]}{' (dirty tree)' if info['dirty'] else ''}, "
      f"{info['started_utc']}, {cpu}, {os.cpu_count()} cores")
EOF

failed=0
for b in "${BENCHES[@]}"; do
    name=${b%%|*}; rest=${b#*|}; limit=${rest%%|*}; cmd=${rest#*|}
    if [ -n "$ONLY" ] && [[ "$ONLY" != *",$name,"* ]]; then continue; fi
    if [[ "$SKIP" == *",$name,"* ]]; then echo "run-benchmarks: $name skipped (--skip)"; continue; fi
    dir="$OUT/$name"
    mkdir -p "$dir"
    cmd=${cmd//OUT_DIR/$dir}
    load_before=$(cut -d' ' -f1 /proc/loadavg)
    echo "run-benchmarks: $name (at most ${limit}s): $cmd"
    start=$SECONDS
    # Its own process group, so a benchmark past its limit is stopped with everything it started.
    timeout --kill-after=30 "$limit" setsid $cmd >"$OUT/$name.log" 2>&1
    rc=$?
    took=$((SECONDS - start))
    load_after=$(cut -d' ' -f1 /proc/loadavg)
    [ "$rc" = 0 ] || { failed=$((failed + 1)); echo "run-benchmarks: $name failed (exit $rc); its output: $OUT/$name.log" >&2; tail -n 20 "$OUT/$name.log" >&2; }
    printf '{"name": "%s", "command": "%s", "exit": %d, "seconds": %d, "load_before": %s, "load_after": %s}\n' \
        "$name" "${cmd//\"/\\\"}" "$rc" "$took" "$load_before" "$load_after" >>"$MANIFEST"
    echo "run-benchmarks: $name took ${took}s (exit $rc; load average $load_before -> $load_after)"
done
echo "run-benchmarks: done in ${SECONDS}s, $failed failed; outputs in $OUT"
[ "$failed" = 0 ]
