"""The CPython interpreters on this machine that rvod's wheel supports (3.10 and later).

Looked for as `python3.N` on PATH, in pyenv's versions folder and in /usr/bin and /usr/local/bin; one per
version. conftest.py names them in the run's header; test_wheel_install.py installs the wheel into each.
"""

from __future__ import annotations

import functools
import glob
import os
import shutil
import subprocess
import sys
from pathlib import Path

OLDEST_SUPPORTED = (3, 10)
PROBE = "import platform, sys; print(platform.python_implementation(), *sys.version_info[:3])"


def _candidates() -> list[str]:
    found = [sys.executable]
    found += [path for minor in range(10, 30) if (path := shutil.which(f"python3.{minor}"))]
    pyenv_root = os.environ.get("PYENV_ROOT") or str(Path.home() / ".pyenv")
    found += sorted(glob.glob(f"{pyenv_root}/versions/*/bin/python3"))
    for folder in ("/usr/bin", "/usr/local/bin"):
        found += sorted(glob.glob(f"{folder}/python3.[0-9]*"))
    return found


@functools.cache
def supported_cpythons() -> dict[str, str]:
    """{"3.10.13": "/path/to/python", ...} for every CPython >= 3.10 found, oldest first."""
    by_version: dict[tuple[int, int, int], str] = {}
    for candidate in _candidates():
        try:
            probe = subprocess.run([candidate, "-c", PROBE], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            continue
        words = probe.stdout.split()
        if probe.returncode != 0 or len(words) != 4 or words[0] != "CPython":
            continue  # a pyenv shim for a version not selected, a broken link, PyPy
        version = tuple(int(word) for word in words[1:])
        if version[:2] >= OLDEST_SUPPORTED:
            by_version.setdefault(version, os.path.realpath(candidate))  # type: ignore[arg-type]
    return {".".join(map(str, version)): path for version, path in sorted(by_version.items())}
