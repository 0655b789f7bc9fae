"""Check release artefacts before anyone installs them: python scripts/check_wheels.py DIST_FILE...

For each wheel: its tags are exactly cp310-abi3 on manylinux2014 (= manylinux_2_17) for one architecture, and
its native library is an ELF file for that architecture; auditwheel finds nothing outside the manylinux2014
policy; abi3audit finds only symbols of CPython 3.10's stable ABI (see ALLOWED_LATER_ABI3); twine check passes.
For an sdist: it holds what a build from source needs, and twine check passes. Exits 1 naming every failure.
Needs auditwheel, abi3audit and twine on PATH (scripts/build-wheels.sh installs them).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

# ELF e_machine values (the ELF specification's registry).
ELF_MACHINES = {"x86_64": 0x3E, "aarch64": 0xB7}
# Two buffer-protocol functions that src/py/buffer.rs calls: CPython 3.11 added them to the stable ABI, but
# CPython 3.10 already exports them with the same signatures and the same Py_buffer layout, so the wheel runs
# on 3.10 (tests/python/test_wheel_install.py runs it under every CPython it finds from 3.10 on).
ALLOWED_LATER_ABI3 = {"PyObject_GetBuffer", "PyBuffer_Release"}
SDIST_NEEDS = ("pyproject.toml", "Cargo.toml", "Cargo.lock", "README.md", "src/lib.rs", "python/rvod/__init__.py",
               "python/rvod/_rvod.pyi")
WHEEL_NAME = re.compile(r"^rvod-(?P<version>[^-]+)-cp310-abi3-(?P<platforms>[^-]+)\.whl$")


def run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def check_wheel(wheel: Path) -> list[str]:
    problems = []
    name = WHEEL_NAME.match(wheel.name)
    if name is None:
        return [f"{wheel.name}: not named rvod-VERSION-cp310-abi3-PLATFORM.whl"]
    arch = next((a for a in ELF_MACHINES if name["platforms"].endswith(a)), None)
    if arch is None:
        return [f"{wheel.name}: platform {name['platforms']} is none of {sorted(ELF_MACHINES)}"]
    expected_tags = {f"cp310-abi3-manylinux2014_{arch}", f"cp310-abi3-manylinux_2_17_{arch}"}
    with zipfile.ZipFile(wheel) as archive:
        metadata = archive.read(f"rvod-{name['version']}.dist-info/WHEEL").decode()
        libraries = [n for n in archive.namelist() if n.endswith(".so")]
        if libraries != ["rvod/_rvod.abi3.so"]:
            problems.append(f"{wheel.name}: native libraries {libraries}, expected only rvod/_rvod.abi3.so")
        header = archive.read(libraries[0])[:20] if libraries else b""
    tags = {line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Tag:")}
    if tags != expected_tags:
        problems.append(f"{wheel.name}: WHEEL tags {sorted(tags)}, expected {sorted(expected_tags)}")
    if "Root-Is-Purelib: false" not in metadata:
        problems.append(f"{wheel.name}: WHEEL does not say Root-Is-Purelib: false")
    if header[:4] != b"\x7fELF" or int.from_bytes(header[18:20], "little") != ELF_MACHINES[arch]:
        problems.append(f"{wheel.name}: rvod/_rvod.abi3.so is not an ELF library for {arch}")

    shown = run("auditwheel", "show", str(wheel))
    policy = f'"manylinux_2_17_{arch}"'
    if shown.returncode != 0 or f"consistent with the following platform tag:\n{policy}" not in shown.stdout:
        problems.append(f"{wheel.name}: auditwheel does not find it consistent with {policy}:\n"
                        f"{shown.stdout}{shown.stderr}")

    audit = run("abi3audit", "--report", str(wheel))
    try:
        report = json.loads(audit.stdout[audit.stdout.index("{"):])
        results = [entry["result"] for spec in report["specs"].values() for entry in spec["wheel"]]
    except (ValueError, KeyError) as error:
        problems.append(f"{wheel.name}: abi3audit gave no report ({error}):\n{audit.stdout}{audit.stderr}")
        results = []
    for result in results:
        later = set(result.get("future_abi3_objects", {})) - ALLOWED_LATER_ABI3
        if not result.get("is_abi3") or result.get("non_abi3_symbols") or later:
            problems.append(f"{wheel.name}: abi3audit: not abi3, or symbols outside CPython 3.10's stable ABI: "
                            f"{result}")
    return problems


def check_sdist(sdist: Path) -> list[str]:
    with tarfile.open(sdist) as archive:
        names = archive.getnames()
    root = names[0].split("/", 1)[0]
    missing = [need for need in SDIST_NEEDS if f"{root}/{need}" not in names]
    return [f"{sdist.name}: missing {missing}"] if missing else []


def main(paths: list[str]) -> int:
    if not paths:
        print(__doc__.strip().splitlines()[0], file=sys.stderr)
        return 2
    problems = []
    for path in map(Path, paths):
        if path.name.endswith(".whl"):
            found = check_wheel(path)
        elif path.name.endswith(".tar.gz"):
            found = check_sdist(path)
        else:
            found = [f"{path.name}: neither a wheel nor an sdist"]
        twine = run("twine", "check", "--strict", str(path))
        if twine.returncode != 0:
            found.append(f"{path.name}: twine check failed:\n{twine.stdout}{twine.stderr}")
        print(f"check_wheels: {path.name}: {'ok' if not found else 'FAILED'}")
        problems += found
    for problem in problems:
        print(f"check_wheels: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
