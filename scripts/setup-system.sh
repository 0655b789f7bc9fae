#!/usr/bin/env bash
# Debian packages the multi-host tests need: an sshd to run inside the test's network namespaces
# (openssh-server), Open MPI's launcher (openmpi-bin, with its headers for mpi4py) and UCX (libucx0, which
# rvod loads at run time for RVOD_TRANSPORT=ucx, and ucx-utils' ucx_info); the Java that Spark 4 runs on
# (Java 17) for the rvod.spark tests; iproute2 (`ip`, `tc`) for the namespace hosts. Installed only when
# missing, and only where we are root with apt-get; elsewhere the tests that need them skip and say why.
set -euo pipefail
PACKAGES=(openssh-server openssh-client openmpi-bin libopenmpi-dev libucx0 ucx-utils openjdk-17-jre-headless iproute2)
missing=()
for package in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "setup-system: not root or no apt-get; missing ${missing[*]} (the tests that need them will skip)" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
