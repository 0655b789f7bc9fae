"""What a result was measured on: machine, versions, the git commit of this tree, and which rvod build ran.

The benchmark measures the *installed* rvod (the wheel in the running Python), not the source tree, so the
installed extension's path, modification time and sha256 are recorded next to the commit.
"""

import datetime
import hashlib
import importlib.metadata
import importlib.util
import os
import platform
import socket
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _git(*args):
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10,
                              check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _version(dist):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model():
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _mem_total_gib():
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                return round(int(line.split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    return None


def _rvod_build():
    spec = importlib.util.find_spec("rvod")
    if spec is None or spec.origin is None:
        return {"installed": False}
    package = Path(spec.origin).parent
    info = {"installed": True, "package": str(package), "version": _version("rvod")}
    extensions = sorted(package.glob("_rvod*.so"))
    if extensions:
        ext = extensions[0]
        info["extension"] = str(ext)
        info["extension_mtime"] = datetime.datetime.fromtimestamp(ext.stat().st_mtime).isoformat(timespec="seconds")
        info["extension_sha256"] = hashlib.sha256(ext.read_bytes()).hexdigest()
    return info


def describe(argv, rvodrun):
    head = _git("rev-parse", "HEAD")
    changed = sorted({line.split(maxsplit=1)[1].split("/")[0] for line in _git("status", "--porcelain").splitlines()
                      if line.strip()})
    dirty = bool(changed)
    today = datetime.date.today().isoformat()
    if head:
        describe_text = head + (f" + uncommitted changes in {', '.join(changed)}" if dirty else "")
    else:
        describe_text = f"uncommitted working tree of {today}"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(argv),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "mem_gib": _mem_total_gib(),
        "python": platform.python_version(),
        "versions": {d: _version(d) for d in ("torch", "numpy", "matplotlib")},
        "rvod": _rvod_build(),
        "rvodrun": rvodrun,
        "git": {"head": head or None, "dirty": dirty, "changed": changed, "describe": describe_text},
    }
